"""A device's tiers as one backend, kernel by kernel (``get_backend("mps")``: Metal tiers 1 to 3,
then the foreach tier).

The first tier that loads is the chain's primary and gives it its name. ``prepare(kernels)``
fixes, once per kernel, the first tier that runs it: a tier that refuses a kernel (its pipeline
did not build, its probe failed) costs that kernel only, and later tiers are loaded only when a
kernel needs one. ``update`` hands each call to its kernel's tier, so a refused kernel never
touches a real tensor. Knows nothing of Metal: it uses only the Backend protocol
(``unavailable``, ``prepare``, ``update``) and, for ``backend_info()``, a tier's optional
``kernels_unavailable()``.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from .kernel import Kernel, describe, kernel_of

# Not tried: a later tier no kernel has needed yet. Failed: it did not load (or its first-use
# probe failed). Chosen: the first that loaded. Loaded: a later tier a kernel needed.
NOT_TRIED, FAILED, CHOSEN, LOADED = "not tried", "failed", "chosen", "loaded"


@dataclass
class Tier:
    label: str
    make: Callable[[], Any]
    backend: Any = None
    state: str = NOT_TRIED
    reason: Optional[str] = None
    refused: dict = field(default_factory=dict)  # Kernel -> why, as this chain saw it


class TierChain:
    """Tiers in preference order as one backend (see the module docstring).

    ``load(label, make)`` builds one tier: ``(backend, None)``, or ``(None, why not)`` after
    recording and warning it (``backends.load_tier``); the last tier must always load (foreach)."""

    def __init__(self, device_type: str, tiers: Sequence[tuple[str, Callable[[], Any]]],
                 load: Callable[[str, Callable[[], Any]], tuple[Any, Optional[str]]]) -> None:
        self.device_type = device_type
        self._tiers = [Tier(label, make) for label, make in tiers]
        self._load = load
        self._route: dict[Kernel, Any] = {}
        self._lock = threading.RLock()
        for tier in self._tiers:
            if self._try_load(tier):
                tier.state = CHOSEN
                break
        chosen = self.chosen
        if chosen is None:
            raise RuntimeError(f"no backend for {device_type} tensors loaded")
        self.name: str = chosen.backend.name

    @property
    def chosen(self) -> Optional[Tier]:
        return next((t for t in self._tiers if t.state == CHOSEN), None)

    def _try_load(self, tier: Tier) -> bool:
        if tier.state == NOT_TRIED:
            backend, tier.reason = self._load(tier.label, tier.make)
            if backend is None:
                tier.state = FAILED
            else:
                tier.backend, tier.state = backend, LOADED
        return tier.backend is not None

    def unavailable(self, kernel: Kernel) -> Optional[str]:
        """None if a loaded tier runs ``kernel`` (tiers not yet loaded are not asked), else why each did not."""
        kernel = Kernel(*kernel)
        if kernel in self._route:
            return None
        reasons = []
        for tier in self._tiers:
            if tier.backend is None:
                continue
            why = tier.refused.get(kernel) or tier.backend.unavailable(kernel)
            if why is None:
                return None
            reasons.append(f"{tier.label}: {why}")
        return "; ".join(reasons) or f"no loaded {self.device_type} backend runs {describe(kernel)}"

    def prepare(self, kernels: Iterable[Kernel]) -> None:
        """Fixes each kernel's tier, loading and probing (through each tier's ``prepare``) as needed;
        raises only if no tier runs one of them."""
        pending = [k for k in dict.fromkeys(Kernel(*k) for k in kernels) if k not in self._route]
        if not pending:
            return
        with self._lock:
            pending = [k for k in pending if k not in self._route]
            passed_over: dict[Kernel, list[str]] = {k: [] for k in pending}
            for tier in self._tiers:
                if not pending:
                    break
                if not self._try_load(tier):
                    continue
                here = [k for k in pending if tier.refused.get(k) is None and tier.backend.unavailable(k) is None]
                error = None
                if here:
                    try:
                        tier.backend.prepare(here)
                    except Exception as exc:  # per-kernel reasons are the tier's unavailable(); this is the rest
                        error = exc
                for k in pending:
                    why = tier.refused.get(k) or tier.backend.unavailable(k)
                    if why is None and error is not None and all(tier.backend.unavailable(h) is None for h in here):
                        why = f"its prepare raised {error!r}"  # not a per-kernel refusal: none of them runs here
                    if why is None:
                        self._route[k] = tier.backend
                        if passed_over[k]:
                            warnings.warn(f"mps_fused_adam: {describe(k)} ({self.device_type} tensors) runs on "
                                          f"{tier.label}: {'; '.join(passed_over[k])}", RuntimeWarning, stacklevel=4)
                    else:
                        tier.refused[k] = why
                        if tier.state in (CHOSEN, LOADED):
                            passed_over[k].append(f"{tier.label}: {why}")
                pending = [k for k in pending if k not in self._route]
            if pending:
                raise RuntimeError(f"no backend for {self.device_type} tensors runs "
                                   + "; ".join(f"{describe(k)} ({'; '.join(passed_over[k])})" for k in pending))

    def update(self, rule: str, params, grads, states, hp, sr_keys=None) -> None:
        backend = self._route.get(kernel_of(rule, params, states))
        if backend is None:
            self.prepare([kernel_of(rule, params, states)])
            backend = self._route[kernel_of(rule, params, states)]
        if sr_keys is None:
            backend.update(rule, params, grads, states, hp)
        else:
            backend.update(rule, params, grads, states, hp, sr_keys=sr_keys)

    def tier_of(self, kernel: Kernel) -> Optional[str]:
        """The name of the tier that runs ``kernel``, once :meth:`prepare` has fixed it."""
        backend = self._route.get(Kernel(*kernel))
        return None if backend is None else backend.name

    def tiers_info(self) -> list[dict[str, Any]]:
        """Per tier: ``tier`` (label), ``name`` (the backend's, when loaded), ``state`` (chosen,
        loaded, failed, not tried), ``reason`` (why it failed) and ``kernels_unavailable``
        (kernel -> why: what the tier reports itself, and what this chain saw it refuse)."""
        out = []
        for tier in self._tiers:
            refused: dict[str, str] = {}
            if tier.backend is not None:
                refused.update(getattr(tier.backend, "kernels_unavailable", dict)())
                refused.update({describe(k): why for k, why in tier.refused.items()})
            out.append({"tier": tier.label, "name": getattr(tier.backend, "name", None), "state": tier.state,
                        "reason": tier.reason, "kernels_unavailable": refused})
        return out

    def routes(self) -> dict[str, str]:
        """Kernel (``describe``) -> the name of the tier that runs it, for every kernel prepared so far."""
        return {describe(k): b.name for k, b in self._route.items()}
