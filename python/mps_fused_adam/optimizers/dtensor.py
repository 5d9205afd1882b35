"""DTensor params (FSDP2's ``fully_shard``, tensor parallel): each rank steps its local shards.

The update rules are elementwise, so a rank that updates the local tensors of a param, its grad
and its states, all laid out alike, computes exactly the elements the same step on the whole
tensors would (the tests compare bit for bit). What must hold is that the four are laid out
alike: the same device mesh and the same placements (a grad still ``Partial``, awaiting its
reduction, or ``Replicate`` beside a ``Shard`` param, holds other elements than the param's local
shard), and local tensors of the same shape. States are created as DTensors like their param
(``torch.zeros_like``), so the state dict holds DTensors as torch's optimizers' does and
``torch.distributed.checkpoint`` saves and loads it. FSDP2 with ``CPUOffloadPolicy`` keeps params
and grads on the CPU, where the step runs on the C++ kernel.

Nothing here imports ``torch.distributed``: without ``torch.distributed.tensor`` loaded no
DTensor exists, and a step pays one dictionary lookup per group for knowing that.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import torch

_MODULE = "torch.distributed.tensor"


def dtensor_type() -> Optional[type]:
    """DTensor's class where ``torch.distributed.tensor`` is loaded, else None (then no param is
    one)."""
    module = sys.modules.get(_MODULE)
    return getattr(module, "DTensor", None) if module is not None else None


def any_dtensor(tensors: Sequence[Any]) -> bool:
    """Whether any of ``tensors`` is a DTensor."""
    cls = dtensor_type()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (an alias: writing it writes the DTensor), else ``t``."""
    cls = dtensor_type()
    return t.to_local() if cls is not None and isinstance(t, cls) else t


def check_like_param(p: torch.Tensor, t: Any, name: str, what: str) -> None:
    """Raise ValueError unless ``t`` (the grad or a state of DTensor param ``p``, ``what`` saying
    which) is a DTensor on ``p``'s mesh with ``p``'s placements and local shape."""
    cls = dtensor_type()
    if not isinstance(t, cls):
        raise ValueError(f"{name}: the param is a DTensor (placements {tuple(p.placements)}), so its {what} must "
                         f"be one laid out alike; got a {type(t).__name__}")
    if t.device_mesh != p.device_mesh or tuple(t.placements) != tuple(p.placements):
        raise ValueError(f"{name}: its {what} must be laid out as the param, on mesh {p.device_mesh} with "
                         f"placements {tuple(p.placements)}; got mesh {t.device_mesh} with placements "
                         f"{tuple(t.placements)} ({what_fix(what)})")
    if t.to_local().shape != p.to_local().shape:
        raise ValueError(f"{name}: its {what}'s local shape must be the param's, {tuple(p.to_local().shape)}; "
                         f"got {tuple(t.to_local().shape)}")


def what_fix(what: str) -> str:
    """How to give a grad or state the param's layout. A ``Partial`` grad (say, of a replicated
    norm weight under sequence parallelism) needs its reduction, a collective the caller chooses to
    run; torch's own optimizers run it implicitly inside an elementwise op."""
    return (f"{what}.redistribute(p.device_mesh, p.placements) gives it that layout" if what == "grad" else
            "torch.distributed.checkpoint loads a sharded state dict into a sharded model")


def check_plain(p: torch.Tensor, g: Any, states: Sequence[Any], name: str, state_names: Sequence[str]) -> None:
    """Raise ValueError if the grad or a state of a param that is no DTensor is one (a state dict
    of a sharded model loaded into an unsharded one, say): its local tensor holds other elements."""
    cls = dtensor_type()
    for what, t in [("grad", g), *((f"state {n!r}", t) for n, t in zip(state_names, states))]:
        if isinstance(t, cls):
            raise ValueError(f"{name}: the param is a plain tensor, but its {what} is a DTensor (placements "
                             f"{tuple(t.placements)}); a param, its grad and its states are all DTensors laid out "
                             f"alike or all plain tensors")
