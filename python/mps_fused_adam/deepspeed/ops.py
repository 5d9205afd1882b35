"""DeepSpeed's Adam op interfaces, served by this package's kernels.

DeepSpeed's optimizers never call a kernel directly: ``FusedAdam`` calls
``FusedAdamBuilder().load().multi_tensor_adam(...)`` and ``DeepSpeedCPUAdam`` calls
``CPUAdamBuilder().load().create_adam/adam_update/adam_rollback/destroy_adam(...)``.
The two objects here have exactly those interfaces and forward every update to
:func:`mps_fused_adam.backends.get_backend`, so the math is the package's numeric contract
(docs/numerics.md) and nothing here does arithmetic of its own, except the rollback, which
DeepSpeed defines as an algebraic inverse of the step and which no backend provides (it inverts
the contract's step, from the contract's own host scalars).

This module does not import DeepSpeed.
"""
from __future__ import annotations

import sys
import threading
from typing import Dict, List, Sequence, Tuple

import torch

from ..backends import get_backend
from ..numerics.contract import AdamHyper, adam_scalars

from .op_support import _check, _count, _update, cpu_weight_decay, kernel_calls, reset_kernel_calls

__all__ = ["FusedAdamOp", "CPUAdamOp", "FUSED_ADAM_OP", "CPU_ADAM_OP", "kernel_calls", "reset_kernel_calls"]

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
        self._zenflow: Dict[int, object] = {}
        self._next_zenflow = 0

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
                       weight_decay=cpu_weight_decay(weight_decay), step=int(step), adam_w_mode=cfg["adamw_mode"],
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
        (``adamw_mode=False`` at ``create_adam``), so the rollback inverts the step that was
        actually taken; an ``optimizer_id`` that is not (or no longer) created inverts the AdamW
        form, as DeepSpeed's always does. A weight decay of 0 or below inverts no decay, as the
        update applied none. The result equals the state before the step up to fp32 rounding,
        not bit for bit.

        fp16 and bf16 storage (params and grads, and states in fp32 or the param dtype) is rolled
        back too, where DeepSpeed's returns -1 and changes nothing (its caller then decrements the
        step count anyway, leaving the state one step ahead of its count): every tensor is widened
        to fp32 exactly, the fp32 inverse above runs, ``exp_avg_sq`` is clamped at 0 (it is a sum of
        squares, and the rounding of the stored value can push the inverse below 0, which would make
        a later step take the square root of a negative number), and the results are rounded to
        each tensor's storage dtype. With ``u`` the unit roundoff of a storage dtype (bf16 2**-8,
        fp16 2**-11, fp32 2**-24) and ``Δ = lr * m̂ / (sqrt(v̂) + eps)`` the step's update, the
        restored values lie within::

            |p' - p0| <= (u_p |p1| + (u_m + u_v) |Δ|) / decay + u_p |p'|
            |m' - m0| <= u_m |m1| / beta1 + u_m |m'|
            |v' - v0| <= u_v |v1| / beta2 + u_v |v'|

        plus a few fp32 ulps of each term (and, below a dtype's normal range, half its subnormal
        spacing per rounding: 2**-25 for fp16), where ``p1, m1, v1`` are the stored values after the
        step, ``decay = 1 - lr * wd`` (1 in L2 mode) and, in L2 mode, the moments' bound gains the
        param's error times ``wd``. The first term of each is the rounding the step's storage
        already lost, which no inverse can recover; when it is below half a storage ulp of the old
        value, the old value comes back exactly.
        """
        with self._lock:
            cfg = self._optimizers.get(int(optimizer_id))
        # DeepSpeed's rollback never looks the id up (it always inverts the AdamW form): an id that
        # was never created, or was destroyed, gets that form here too instead of an error.
        adamw_mode = True if cfg is None else cfg["adamw_mode"]
        tensors = dict(params=params, grads=grads, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        for name, t in tensors.items():
            _check(name, t, None if name == "params" else params)
        if exp_avg.dtype != exp_avg_sq.dtype or exp_avg.dtype not in (torch.float32, params.dtype):
            raise TypeError(f"mps_fused_adam.deepspeed: adam_rollback: exp_avg is {exp_avg.dtype} and exp_avg_sq "
                            f"{exp_avg_sq.dtype} with params {params.dtype}; states must share one dtype, "
                            f"float32 or the param's")
        step = int(step)
        if step < 1:
            raise ValueError(f"mps_fused_adam.deepspeed: adam_rollback needs the step to undo (>= 1), got {step}")

        # The scalars our update used (contract v2), so the rollback inverts our step.
        k = adam_scalars(AdamHyper(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(epsilon),
                                   weight_decay=cpu_weight_decay(weight_decay), step=step, adam_w_mode=adamw_mode,
                                   bias_correction=bool(bias_correction)))
        with torch.no_grad():
            p = params.detach()
            # The step read the grad rounded to the param dtype (see _update); so must its inverse.
            g = grads.detach().to(p.dtype)
            low_precision = any(t.dtype != torch.float32 for t in (p, exp_avg, exp_avg_sq))
            # Upcast (exact), the fp32 inverse, round to storage: all results exist before any
            # tensor is written, so nothing is half-updated if anything above raised.
            new_p, new_m, new_v = _rollback_fp32(p.float(), g.float(), exp_avg.float(), exp_avg_sq.float(), k)
            if low_precision:
                new_v = new_v.clamp_min(0.0)
            p.copy_(new_p)
            exp_avg.copy_(new_m)
            exp_avg_sq.copy_(new_v)
        _count("adam_rollback", "torch")
        return 0


    # --- ZenFlow's native cross-process API (DeepSpeed 0.19.8; see .zenflow) -------------------

    def zenflow_adam_create(self, optimizer_id: int, zf_affinity: Sequence[int]) -> int:
        """A ZenFlow optimizer on ``create_adam`` id ``optimizer_id`` whose pool is pinned to the
        cores ``zf_affinity`` (Linux); returns its handle."""
        from .zenflow import ZenFlowAdam
        zf = ZenFlowAdam(self, optimizer_id, zf_affinity)
        with self._lock:
            handle = self._next_zenflow
            self._next_zenflow += 1
            self._zenflow[handle] = zf
        return handle

    def _zenflow_handle(self, handle: int):
        with self._lock:
            zf = self._zenflow.get(int(handle))
        if zf is None:
            raise KeyError(f"mps_fused_adam.deepspeed: no ZenFlow optimizer with handle {handle}; "
                           f"zenflow_adam_create returns the handles")
        return zf

    def zenflow_adam_register_group(self, handle: int, param: torch.Tensor, grad0: torch.Tensor, grad1: torch.Tensor,
                                    exp_avg0: torch.Tensor, exp_avg1: torch.Tensor, exp_avg_sq0: torch.Tensor,
                                    exp_avg_sq1: torch.Tensor, stale: torch.Tensor | None) -> None:
        """Add one param group: the param, its two gradient buffers and two state pairs (``now_state``
        of a submitted step picks one of each), and ``stale``, which receives the updated param."""
        self._zenflow_handle(handle).register_group(param, grad0, grad1, exp_avg0, exp_avg1, exp_avg_sq0,
                                                    exp_avg_sq1, stale)

    def zenflow_adam_destroy(self, handle: int) -> None:
        """Forget a ZenFlow optimizer (unknown handles are ignored, as in DeepSpeed)."""
        with self._lock:
            self._zenflow.pop(int(handle), None)

    def zenflow_adam_run_worker(self, handle: int, control_ptr: int) -> None:
        """Optimizer process: run submitted steps until ``zenflow_adam_ctrl_exit`` (Linux only)."""
        self._zenflow_handle(handle).run_worker(control_ptr)

    @staticmethod
    def zenflow_adam_ctrl_size() -> int:
        """Bytes of the shared control block (Linux only)."""
        from . import zenflow
        return zenflow.ctrl_size()

    @staticmethod
    def zenflow_adam_ctrl_init(control_ptr: int, num_groups: int) -> None:
        """Set up the control block at ``control_ptr`` for ``num_groups`` groups (at most 1024; Linux only)."""
        from . import zenflow
        zenflow.ctrl_init(control_ptr, num_groups)

    @staticmethod
    def zenflow_adam_submit(control_ptr: int, now_state: int, step: int, lr: Sequence[float], beta1: Sequence[float],
                            beta2: Sequence[float], eps: Sequence[float], weight_decay: Sequence[float],
                            bias_correction: Sequence[int]) -> None:
        """Hand step ``step`` (per-group hyperparameters, buffer ``now_state``) to the optimizer process."""
        from . import zenflow
        zenflow.submit(control_ptr, now_state, step, lr, beta1, beta2, eps, weight_decay, bias_correction)

    @staticmethod
    def zenflow_adam_wait(control_ptr: int, timeout_s: float) -> bool:
        """Consume one completion, waiting up to ``timeout_s`` seconds; ``False`` on time-out."""
        from . import zenflow
        return zenflow.wait(control_ptr, timeout_s)

    @staticmethod
    def zenflow_adam_ctrl_exit(control_ptr: int) -> None:
        """Make the optimizer process's ``zenflow_adam_run_worker`` return."""
        from . import zenflow
        zenflow.ctrl_exit(control_ptr)

def _rollback_fp32(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, k) -> Tuple[torch.Tensor, ...]:
    """The fp32 inverse of one step (see ``CPUAdamOp.adam_rollback``): new (param, exp_avg,
    exp_avg_sq) from fp32 tensors and the step's ``contract.adam_scalars``; inputs unchanged."""

    def f32(x: float, like: torch.Tensor) -> torch.Tensor:
        # A full tensor: torch may turn division by a scalar into a multiplication by its
        # reciprocal, which rounds differently from a true per-element division.
        return torch.full(like.shape, x, dtype=torch.float32)

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
    return new_p, new_m, new_v


# DeepSpeed's cpu_adam op defines these only on Linux (``#if defined(__linux__)`` in cpu_adam.cpp,
# 0.19.8), and code that can use them (its own test_zenflow_adam_cross_process) asks
# ``hasattr(op, "zenflow_adam_ctrl_size")``; so off Linux ours lacks them too.
ZENFLOW_LINUX_ONLY = ("zenflow_adam_ctrl_size", "zenflow_adam_ctrl_init", "zenflow_adam_run_worker",
                      "zenflow_adam_submit", "zenflow_adam_wait", "zenflow_adam_ctrl_exit")


def without_linux_only_zenflow(cls: type) -> type:
    """``cls`` (:class:`CPUAdamOp`) as it is built off Linux: without :data:`ZENFLOW_LINUX_ONLY`, so
    ``hasattr`` answers False, and reading one of them raises an ``AttributeError`` that says why."""
    ns = {k: v for k, v in vars(cls).items() if k not in ZENFLOW_LINUX_ONLY + ("__dict__", "__weakref__")}

    def __getattr__(self, name: str):
        if name in ZENFLOW_LINUX_ONLY:
            from .zenflow import LINUX_ONLY
            raise AttributeError(f"{name}: {LINUX_ONLY}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    ns["__getattr__"] = __getattr__
    return type(cls.__name__, cls.__bases__, ns)


if not sys.platform.startswith("linux"):
    CPUAdamOp = without_linux_only_zenflow(CPUAdamOp)  # type: ignore[misc]

FUSED_ADAM_OP = FusedAdamOp()
CPU_ADAM_OP = CPUAdamOp()
