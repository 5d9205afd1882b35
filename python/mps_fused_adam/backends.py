"""Kernel backends: one small interface, chosen once per device type, reported by ``backend_info()``.

A backend updates lists of tensors that the optimizer has already validated: every list has the
same length; all tensors are on one device, contiguous and non-empty; params and grads share one
dtype, exp_avg and exp_avg_sq share one (possibly different) state dtype; all share one
:class:`AdamHyper`. A backend never fails on such input, so a step that passed validation
cannot leave tensors half-updated.
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Callable, Optional, Protocol, Sequence

import torch

from .contract import AdamHyper, kernel_scalars


class Addressed(list):
    """A list of tensors that also carries what a backend would otherwise read from each of them:
    ``addresses`` (``data_ptr()``) and, where known, ``numels``. The optimizer's step plans hand
    these over (step_plan.py), having read and checked the addresses this step."""

    addresses: list[int]
    numels: Optional[list[int]]


def addresses(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Every tensor's ``data_ptr()``, taken from an :class:`Addressed` list when it has them."""
    return tensors.addresses if type(tensors) is Addressed else [t.data_ptr() for t in tensors]


def numels(tensors: Sequence[torch.Tensor]) -> list[int]:
    known = tensors.numels if type(tensors) is Addressed else None
    return known if known is not None else [t.numel() for t in tensors]


class Backend(Protocol):
    name: str

    def update(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
               hp: AdamHyper) -> None: ...


class ForeachBackend:
    """Tier 4: ``torch._foreach_*`` ops in fp32 math, rounded back to the storage dtype.

    The ops are separate (no addcmul/addcdiv, which may fuse multiply-adds) and in the kernels'
    order, so in fp32 this tier agrees with the reference bit for bit.
    """

    name = "foreach"

    def update(self, params, grads, exp_avgs, exp_avg_sqs, hp: AdamHyper) -> None:
        s = kernel_scalars(hp)
        p = [t.float() for t in params]
        g = [t.float() for t in grads]
        m = [t.float() for t in exp_avgs]
        v = [t.float() for t in exp_avg_sqs]
        if s.maximize:
            g = torch._foreach_neg(g)
        if not s.adam_w_mode:
            g = torch._foreach_add(g, torch._foreach_mul(p, s.weight_decay))
        m = torch._foreach_add(torch._foreach_mul(m, s.beta1), torch._foreach_mul(g, s.one_minus_beta1))
        gg = torch._foreach_mul(torch._foreach_mul(g, s.one_minus_beta2), g)
        v = torch._foreach_add(torch._foreach_mul(v, s.beta2), gg)
        # Division by full tensors and a float64 sqrt: torch's CPU kernels turn division by a scalar
        # into multiplication by its reciprocal, and its fp32 sqrt is not always correctly rounded.
        vc = torch._foreach_div(v, [torch.full_like(t, s.bc2) for t in v])
        denom = torch._foreach_add([t.double().sqrt_().float() for t in vc], s.eps)
        upd = torch._foreach_div(torch._foreach_div(m, [torch.full_like(t, s.bc1) for t in m]), denom)
        if s.adam_w_mode:
            upd = torch._foreach_add(upd, torch._foreach_mul(p, s.weight_decay))
        p = torch._foreach_sub(p, torch._foreach_mul(upd, s.lr))
        with torch.no_grad():
            torch._foreach_copy_(list(params), p)
            torch._foreach_copy_(list(exp_avgs), m)
            torch._foreach_copy_(list(exp_avg_sqs), v)


class CPUBackend:
    """The ``_cpu`` extension: SIMD C++ kernel on a persistent thread pool, GIL released."""

    name = "cpu"

    def __init__(self) -> None:
        from . import _cpu  # noqa: F401  (ImportError tells the caller why this tier is out)
        self._cpu = _cpu
        self.simd = _cpu.simd_path()
        wanted = os.environ.get("MPS_FUSED_ADAM_SIMD")
        if wanted and wanted != self.simd:
            warnings.warn(f"mps_fused_adam: MPS_FUSED_ADAM_SIMD={wanted!r} is not supported on this CPU "
                          f"(supported: {', '.join(_cpu.simd_paths())}); using {self.simd}", RuntimeWarning)

    def update(self, params, grads, exp_avgs, exp_avg_sqs, hp: AdamHyper) -> None:
        self._cpu.adam_step(
            addresses(params), addresses(grads), addresses(exp_avgs), addresses(exp_avg_sqs), numels(params),
            _DTYPE_CODES[params[0].dtype], _DTYPE_CODES[exp_avgs[0].dtype],
            *kernel_scalars(hp), torch.get_num_threads(),
        )


class TorchFusedBackend:
    """Devices we ship no kernel for (CUDA, XPU): torch's fused Adam where it keeps the contract.

    torch's fused kernel computes in fp32 (opmath) for every storage dtype, but it needs params
    and states in one dtype; other mixes, and devices without a fused kernel, use the foreach tier.
    """

    name = "torch-fused"

    def __init__(self) -> None:
        self._fallback = ForeachBackend()

    def update(self, params, grads, exp_avgs, exp_avg_sqs, hp: AdamHyper) -> None:
        if exp_avgs[0].dtype != params[0].dtype:
            return self._fallback.update(params, grads, exp_avgs, exp_avg_sqs, hp)
        fused = torch._fused_adamw_ if hp.adam_w_mode else torch._fused_adam_
        steps = [torch.tensor(float(hp.step), device=params[0].device)] * len(params)
        bc_off = not hp.bias_correction
        # torch's fused kernel always bias-corrects; step=inf makes beta**step vanish.
        if bc_off:
            steps = [torch.tensor(float("inf"), device=params[0].device)] * len(params)
        fused(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], steps,
              lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
              amsgrad=False, maximize=hp.maximize)


def update_staged(backend: Backend, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], hp: AdamHyper) -> None:
    """``backend.update`` for tensors that need not be contiguous: non-contiguous ones go through
    contiguous copies that are written back, so their update is never lost (DeepSpeed's CPU Adam
    silently loses it)."""
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if all(t.is_contiguous() for tensors in lists for t in tensors):
        backend.update(params, grads, exp_avgs, exp_avg_sqs, hp)
        return
    staged = [[t.contiguous() for t in tensors] for tensors in lists]
    backend.update(*staged, hp)
    for originals, copies in ((params, staged[0]), (exp_avgs, staged[2]), (exp_avg_sqs, staged[3])):
        for orig, copy in zip(originals, copies):
            if copy is not orig:
                orig.copy_(copy)


_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
SUPPORTED_DTYPES = tuple(_DTYPE_CODES)

_lock = threading.Lock()
_chosen: dict[str, Backend] = {}
_reasons: dict[str, list[str]] = {}


def _try(device_type: str, factories: Sequence[tuple[str, Callable[[], Backend]]]) -> Backend:
    reasons = _reasons.setdefault(device_type, [])
    for label, make in factories:
        try:
            return make()
        except Exception as exc:  # any load failure means: say why once, use the next tier
            msg = f"mps_fused_adam: {label} backend unavailable for {device_type} tensors: {exc!r}"
            reasons.append(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return ForeachBackend()


def _tiers(device_type: str) -> list[tuple[str, Callable[[], Backend]]]:
    if device_type == "cpu":
        return [("_cpu extension", CPUBackend)]
    if device_type == "mps":
        from .mps_backends import mps_tiers
        return mps_tiers()
    if device_type in ("cuda", "xpu"):
        return [("torch fused", TorchFusedBackend)]
    return []


def get_backend(device: torch.device | str) -> Backend:
    """The backend for tensors on ``device``, chosen on first use and kept for the process."""
    device_type = torch.device(device).type
    backend = _chosen.get(device_type)
    if backend is None:
        with _lock:
            backend = _chosen.get(device_type)
            if backend is None:
                backend = _chosen[device_type] = _try(device_type, _tiers(device_type))
    return backend


def backend_info() -> dict[str, dict[str, object]]:
    """What is active per device type tried so far (CPU always; MPS when available), and why not the rest."""
    get_backend("cpu")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        get_backend("mps")
    info = {}
    for device_type, backend in _chosen.items():
        entry: dict[str, object] = {"backend": backend.name, "unavailable": list(_reasons.get(device_type, []))}
        if hasattr(backend, "simd"):
            entry["simd"] = backend.simd
        info[device_type] = entry
    return info
