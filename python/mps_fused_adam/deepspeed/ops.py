"""DeepSpeed's Adam op interfaces, served by this package's kernels.

DeepSpeed's optimizers never call a kernel directly: ``FusedAdam`` calls
``FusedAdamBuilder().load().multi_tensor_adam(...)`` and ``DeepSpeedCPUAdam`` calls
``CPUAdamBuilder().load().create_adam/adam_update/adam_rollback/destroy_adam(...)``.
The two objects here have exactly those interfaces and forward every update to
:func:`mps_fused_adam.backends.get_backend`, so the math is the package's numeric contract
(DESIGN.md section 2) and nothing here does arithmetic of its own, except the rollback, which
DeepSpeed defines as an algebraic inverse of the step and which no backend provides (it inverts
the contract's step, from the contract's own host scalars).

This module does not import DeepSpeed.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Dict, List, Sequence, Tuple

import torch

from ..backends import get_backend, update_staged
from ..contract import AdamHyper, adam_scalars

__all__ = ["FusedAdamOp", "CPUAdamOp", "FUSED_ADAM_OP", "CPU_ADAM_OP", "kernel_calls", "reset_kernel_calls"]

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


def _check(name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mps_fused_adam.deepspeed: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise RuntimeError(f"mps_fused_adam.deepspeed: {name} is sparse; Adam needs dense tensors")
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
            _count(op, backend.name)


class FusedAdamOp:
    """What ``FusedAdamBuilder().load()`` returns: DeepSpeed's ``multi_tensor_adam`` interface."""

    name = "mps_fused_adam.fused_adam"

    @staticmethod
    def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]],
                          lr: float, beta1: float, beta2: float, epsilon: float, step: int, adam_w_mode: int,
                          bias_correction: int, weight_decay: float, *args) -> None:
        """Update ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]`` in place.

        ``chunk_size`` and ``noop_flag`` belong to CUDA's multi-tensor-apply launcher; DeepSpeed's
        Adam functor never reads the flag, so both are accepted and ignored. ``step`` is the step
        being taken (1 for the first). Params may be leaf tensors that require grad (DeepSpeed
        passes bf16 params that way), hence the update runs under ``no_grad``.
        """
        if len(tensor_lists) != 4:
            raise ValueError("mps_fused_adam.deepspeed: multi_tensor_adam expects tensor_lists = "
                             f"[grads, params, exp_avgs, exp_avg_sqs], got {len(tensor_lists)} lists")
        grads, params, exp_avgs, exp_avg_sqs = tensor_lists
        if not (len(grads) == len(params) == len(exp_avgs) == len(exp_avg_sqs)):
            raise ValueError("mps_fused_adam.deepspeed: multi_tensor_adam lists differ in length: "
                             f"{len(grads)} grads, {len(params)} params, {len(exp_avgs)} exp_avgs, "
                             f"{len(exp_avg_sqs)} exp_avg_sqs")
        if not params:
            return
        hp = AdamHyper(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(epsilon),
                       weight_decay=float(weight_decay), step=int(step), adam_w_mode=bool(adam_w_mode),
                       bias_correction=bool(bias_correction))
        _update("multi_tensor_adam", params, grads, exp_avgs, exp_avg_sqs, hp)


class CPUAdamOp:
    """What ``CPUAdamBuilder().load()`` returns: DeepSpeed's ``cpu_adam`` module interface.

    DeepSpeed keeps one C++ ``Adam_Optimizer`` per id. Of what ``create_adam`` stores, only
    ``adamw_mode`` survives: every ``adam_update`` passes lr, betas, eps and weight decay again
    and they replace the stored ones. The bias corrections depend only on the ``step`` argument
    (not on how many calls were made), so calling ``adam_update`` with the same step for several
    sub-groups, or again on restored tensors, repeats the same update bit for bit.
    """

    name = "mps_fused_adam.cpu_adam"

    def __init__(self) -> None:
        self._optimizers: Dict[int, dict] = {}
        self._lock = threading.Lock()

    def create_adam(self, optimizer_id: int, alpha: float = 1e-3, betta1: float = 0.9, betta2: float = 0.999,
                    eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True,
                    should_log: bool = False) -> int:
        """Register optimizer ``optimizer_id`` (re-creating an id replaces it, as DeepSpeed does)."""
        with self._lock:
            self._optimizers[int(optimizer_id)] = dict(lr=float(alpha), beta1=float(betta1), beta2=float(betta2),
                                                       eps=float(eps), weight_decay=float(weight_decay),
                                                       adamw_mode=bool(adamw_mode))
        if should_log:
            print(f"Adam Optimizer #{optimizer_id} is created with mps_fused_adam "
                  f"({get_backend('cpu').name} backend for CPU tensors).\n"
                  f"Config: alpha={alpha:f}, betas=({betta1:f}, {betta2:f}, weight_decay={weight_decay:f}, "
                  f"adam_w={int(bool(adamw_mode))}")
        return 0

    def destroy_adam(self, optimizer_id: int) -> int:
        """Forget optimizer ``optimizer_id`` (unknown ids are ignored, as in DeepSpeed)."""
        with self._lock:
            self._optimizers.pop(int(optimizer_id), None)
        return 0

    def _config(self, optimizer_id: int) -> dict:
        with self._lock:
            cfg = self._optimizers.get(int(optimizer_id))
        if cfg is None:
            # DeepSpeed's C++ dereferences a null pointer here; a clear error is kinder.
            raise KeyError(f"mps_fused_adam.deepspeed: no CPU Adam optimizer with id {optimizer_id}; "
                           f"call create_adam({optimizer_id}, ...) first")
        return cfg

    def adam_update(self, optimizer_id: int, step: int, lr: float, beta1: float, beta2: float, epsilon: float,
                    weight_decay: float, bias_correction: bool, params: torch.Tensor, grads: torch.Tensor,
                    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
        """One Adam step of ``params`` in place with optimizer ``optimizer_id``'s mode; returns 0."""
        cfg = self._config(optimizer_id)
        hp = AdamHyper(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(epsilon),
                       weight_decay=float(weight_decay), step=int(step), adam_w_mode=cfg["adamw_mode"],
                       bias_correction=bool(bias_correction))
        _update("adam_update", [params], [grads], [exp_avg], [exp_avg_sq], hp)
        return 0

    def adam_rollback(self, optimizer_id: int, step: int, lr: float, beta1: float, beta2: float, epsilon: float,
                      weight_decay: float, bias_correction: bool, params: torch.Tensor, grads: torch.Tensor,
                      exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
        """Undo the ``adam_update`` of step ``step`` that used these same arguments; returns 0.

        DeepSpeed defines the rollback as the algebraic inverse of its step, computed in fp32 from
        the updated moments (``adamw_rollback_inplace``, 0.19.8). This inverts *our* step (the
        numeric contract v2, ``contract.py``) the same way, with the fp32 scalars the update used
        (``contract.adam_scalars``), each op rounded separately, in this order::

            denom = sqrt(v) * d2 + eps
            p = p + step_size * (m / denom)
            AdamW mode: p = p / decay                      # non-finite -> 0, as DeepSpeed
            L2 mode:    g = g + wd * p                     # the gradient the moments saw
            m = (m - omb1 * g) / beta1
            v = (v - omb2 * (g * g)) / beta2

        Where DeepSpeed ignores the flags (it always bias-corrects and always treats weight
        decay as decoupled), this honours ``bias_correction=False`` and L2 mode
        (``adamw_mode=False``), so the rollback inverts the step that was actually taken. Like
        DeepSpeed, only fp32 tensors can be rolled back (low precision storage cannot be
        inverted); DeepSpeed then prints an error and returns -1 with nothing changed, after which
        its caller decrements the step anyway, so this raises instead. The result equals the
        state before the step up to fp32 rounding, not bit for bit.
        """
        cfg = self._config(optimizer_id)
        tensors = dict(params=params, grads=grads, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        for name, t in tensors.items():
            _check(name, t, None if name == "params" else params)
            if t.dtype != torch.float32:
                raise TypeError(f"mps_fused_adam.deepspeed: adam_rollback supports float32 tensors only "
                                f"(as DeepSpeed's does); {name} is {t.dtype}")
        step = int(step)
        if step < 1:
            raise ValueError(f"mps_fused_adam.deepspeed: adam_rollback needs the step to undo (>= 1), got {step}")

        # The scalars our update used (contract v2), so the rollback inverts our step.
        k = adam_scalars(AdamHyper(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(epsilon),
                                   weight_decay=float(weight_decay), step=step, adam_w_mode=cfg["adamw_mode"],
                                   bias_correction=bool(bias_correction)))

        def f32(x: float, like: torch.Tensor) -> torch.Tensor:
            # A full tensor: torch may turn division by a scalar into a multiplication by its
            # reciprocal, which rounds differently from a true per-element division.
            return torch.full(like.shape, x, dtype=torch.float32)

        with torch.no_grad():
            p = params.detach()
            m, v = exp_avg, exp_avg_sq
            g = grads.detach()
            # torch's fp32 sqrt on CPU is not always correctly rounded (Sleef, measured with torch
            # 2.13); C++'s std::sqrt is. sqrt in double, rounded once to fp32, is exact.
            denom = torch.sqrt(v.double()).float() * f32(k.d2, v) + f32(k.eps, v)
            new_p = p + f32(k.step_size, p) * (m / denom)
            if k.adam_w_mode:
                new_p = new_p / f32(k.decay, p)
            else:
                g = g + f32(k.weight_decay, p) * new_p  # the L2 step fed g + wd * p_previous into the moments
            new_p = torch.where(torch.isfinite(new_p), new_p, torch.zeros_like(new_p))
            new_m = (m - f32(k.one_minus_beta1, m) * g) / f32(k.beta1, m)
            new_v = (v - f32(k.one_minus_beta2, v) * (g * g)) / f32(k.beta2, v)
            p.copy_(new_p)
            m.copy_(new_m)
            v.copy_(new_v)
        _count("adam_rollback", "torch")
        return 0


FUSED_ADAM_OP = FusedAdamOp()
CPU_ADAM_OP = CPUAdamOp()
