"""What every DeepSpeed op facade shares: input checks, the Adam update call, and the count of
kernel calls that lets tests and the example prove DeepSpeed ran our kernels."""
from __future__ import annotations

import threading
from collections import Counter
from typing import Dict, List, Sequence, Tuple

import torch

from ..backends import get_backend, update_staged
from ..backends.versions import bump
from ..numerics.contract import AdamHyper

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)

# How many backend calls each facade made, per backend name: lets tests and the example prove
# that DeepSpeed's optimizers really ran our kernels (and which ones), not DeepSpeed's own.
_calls: Counter = Counter()
_calls_lock = threading.Lock()


def kernel_calls() -> Dict[str, int]:
    """Backend calls made through the DeepSpeed facades so far, keyed ``"<op>:<backend>"``."""
    with _calls_lock:
        return dict(_calls)


def reset_kernel_calls() -> None:
    """Forget the counts returned by :func:`kernel_calls`."""
    with _calls_lock:
        _calls.clear()


def _count(op: str, backend_name: str) -> None:
    with _calls_lock:
        _calls[f"{op}:{backend_name}"] += 1


def cpu_weight_decay(weight_decay: float) -> float:
    """The weight decay DeepSpeed's CPU kernels apply: they test ``weight_decay > 0`` (Adam in
    both modes, Lion, Adagrad; ``cpu_adam.h``, ``cpu_lion.h``, ``cpu_adagrad.h`` of 0.19.8), so a
    negative value, which their Python classes never reject, means none. The fused (CUDA) kernels
    apply any value, and so do the ``multi_tensor_*`` facades."""
    weight_decay = float(weight_decay)
    return weight_decay if weight_decay > 0 else 0.0


def _check(name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mps_fused_adam.deepspeed: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        # Sparse (COO, CSR, CSC, BSR, BSC) and mkldnn tensors: rejected here, before any group of a
        # call is written, not by a later group's kernel call.
        raise RuntimeError(f"mps_fused_adam.deepspeed: {name} has layout {t.layout}; the optimizer ops "
                           f"need dense (torch.strided) tensors")
    if t._is_zerotensor():
        raise RuntimeError(f"mps_fused_adam.deepspeed: {name} is a ZeroTensor (torch's zeros without memory); "
                           f"the optimizer ops need tensors with memory")
    if t.dtype not in _SUPPORTED:
        raise TypeError(f"mps_fused_adam.deepspeed: {name} has dtype {t.dtype}; expected one of "
                        f"{', '.join(str(d) for d in _SUPPORTED)}")
    if like is not None:
        if t.shape != like.shape:
            raise ValueError(f"mps_fused_adam.deepspeed: {name} has shape {tuple(t.shape)}, "
                             f"the param has {tuple(like.shape)}")
        if t.device != like.device:
            raise ValueError(f"mps_fused_adam.deepspeed: {name} is on {t.device}, the param on {like.device}")


def _update(op: str, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
            exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], hp: AdamHyper) -> None:
    """Validate, adapt to the backend's preconditions, and run one backend call per
    (device, param dtype, state dtype) group.

    DeepSpeed hands over tensors the backends' contract does not promise to accept: grads of
    another dtype than the param, non-contiguous views (DeepSpeed's own CPU Adam silently drops
    the update for those), empty partitions. They are adapted here rather than rejected, because
    DeepSpeed's own kernels accept them and ZeRO relies on that.
    """
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        _check(f"params[{i}]", p)
        _check(f"grads[{i}]", g, p)
        _check(f"exp_avgs[{i}]", m, p)
        _check(f"exp_avg_sqs[{i}]", v, p)
        if m.dtype != v.dtype:
            raise TypeError(f"mps_fused_adam.deepspeed: exp_avgs[{i}] is {m.dtype} but exp_avg_sqs[{i}] is "
                            f"{v.dtype}; both optimizer states must share one dtype")
        if m.dtype not in (torch.float32, p.dtype):
            raise TypeError(f"mps_fused_adam.deepspeed: state dtype {m.dtype} with param dtype {p.dtype}; "
                            f"states must be float32 or the param's dtype")

    groups: Dict[Tuple[torch.device, torch.dtype, torch.dtype], List[list]] = {}
    with torch.no_grad():
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            if p.numel() == 0:
                continue
            # The kernels read grads in the param dtype (DeepSpeed's CPU kernel reinterprets the
            # grad's bytes as the param dtype and reads garbage otherwise); one rounding of the
            # grad to the param dtype is what the param's own precision could hold anyway.
            g = g.detach()
            if g.dtype != p.dtype:
                g = g.to(p.dtype)
            lists = groups.setdefault((p.device, p.dtype, m.dtype), [[], [], [], []])
            lists[0].append(p.detach())
            lists[1].append(g)
            lists[2].append(m)
            lists[3].append(v)
        for (device, _, _), (ps, gs, ms, vs) in groups.items():
            backend = get_backend(device)
            update_staged(backend, "adam", ps, gs, [ms, vs], hp)
            bump(ps)  # detached views: the caller's tensors' counters (versions.py)
            _count(op, backend.name)
