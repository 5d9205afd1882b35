"""ZenFlow's native cross-process Adam (DeepSpeed 0.19.8's ``cpu_adam`` op), on this package's kernel.

ZenFlow with ``"overlap_step": true`` runs the CPU Adam step in a separate optimizer process
(``deepspeed/runtime/zenflow/zenflow_utils.py``) and talks to it through a shared-memory control
block: the training process ``zenflow_adam_submit``\\ s a step (per-group hyperparameters, which of
two gradient/state buffers, the step number) and later ``zenflow_adam_wait``\\ s for its completion
with a time-out; the optimizer process sits in ``zenflow_adam_run_worker``, running each submitted
step on a thread pool pinned to ZenFlow's cores, and snapshots the updated params into a ``stale``
buffer. This module is that API with DeepSpeed's signatures and semantics:

* the control block and its semaphores are C++ (``src/cpu/zenflow_ctrl.cpp``, in ``_cpu``); the
  waits release the GIL, ``wait`` returns ``False`` on time-out (so DeepSpeed can notice a dead
  optimizer process), ``done`` counts, so a completion nobody waited for is consumed by the next
  wait;
* each step runs through the same path as ``adam_update`` (``ops._update``: the contract's scalars
  from ``contract.adam_scalars``, the CPU backend), so a ZenFlow step equals an ``adam_update``
  with the same arguments bit for bit; the pool's threads are pinned one per core of the affinity
  list for the duration of ``run_worker`` (Linux; macOS cannot pin threads);
* the optimizer process is spawned, so it never ran ``install()``; ``install()`` makes it run
  ``install()`` before DeepSpeed's own process body (``spawned.py``), so its
  ``CPUAdamBuilder().load()`` returns our op too and nothing is JIT-built there either.

ZenFlow's cross-process API is Linux-only, as in DeepSpeed (macOS has no unnamed process-shared
semaphores); elsewhere the control-block functions raise ``RuntimeError`` saying so.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from ..numerics.contract import AdamHyper, adam_scalars

__all__ = ["ZenFlowAdam", "supported", "control_info"]

LINUX_ONLY = ("ZenFlow's cross-process optimizer (zenflow_adam_ctrl_*, _submit, _wait, _run_worker) is Linux-only, "
              "as in DeepSpeed 0.19.8, whose cpu_adam op defines it only on Linux: it needs unnamed process-shared "
              "POSIX semaphores, which macOS does not implement. On macOS use ZenFlow with \"overlap_step\": false, "
              "or ZeRO-Offload without ZenFlow.")


def _cpu():
    try:
        from .. import _cpu as cpu
    except ImportError as exc:
        raise RuntimeError(f"ZenFlow's cross-process optimizer needs mps_fused_adam's _cpu extension, which did not "
                           f"load: {exc}") from exc
    return cpu


def supported() -> bool:
    """Whether the cross-process control block is available here (Linux, with the ``_cpu`` extension)."""
    try:
        return bool(_cpu().zenflow_supported())
    except RuntimeError:
        return False


def _linux_cpu():
    cpu = _cpu()
    if not cpu.zenflow_supported():
        raise RuntimeError(LINUX_ONLY)
    return cpu


def ctrl_size() -> int:
    return int(_linux_cpu().zenflow_ctrl_size())


def ctrl_init(ctrl: int, num_groups: int) -> None:
    _linux_cpu().zenflow_ctrl_init(int(ctrl), int(num_groups))


def submit(ctrl: int, now_state: int, step: int, lr: Sequence[float], beta1: Sequence[float],
           beta2: Sequence[float], eps: Sequence[float], weight_decay: Sequence[float],
           bias_correction: Sequence[int]) -> None:
    _linux_cpu().zenflow_submit(int(ctrl), int(now_state), int(step), [float(x) for x in lr],
                                [float(x) for x in beta1], [float(x) for x in beta2], [float(x) for x in eps],
                                [float(x) for x in weight_decay], [1 if b else 0 for b in bias_correction])


def wait(ctrl: int, timeout_s: float) -> bool:
    return bool(_linux_cpu().zenflow_wait(int(ctrl), float(timeout_s)))


def ctrl_exit(ctrl: int) -> None:
    _linux_cpu().zenflow_ctrl_exit(int(ctrl))


def control_info(ctrl: int) -> Dict[str, Any]:
    """What the optimizer process recorded in the control block: completed steps and the backend
    that ran them (lets the training process check that our kernel did the work)."""
    cpu = _linux_cpu()
    return {"steps_done": int(cpu.zenflow_steps_done(int(ctrl))), "backend": cpu.zenflow_backend(int(ctrl))}


class _Group:
    __slots__ = ("param", "grad", "exp_avg", "exp_avg_sq", "stale")

    def __init__(self, param, grad, exp_avg, exp_avg_sq, stale) -> None:
        self.param, self.grad, self.exp_avg, self.exp_avg_sq, self.stale = param, grad, exp_avg, exp_avg_sq, stale


class ZenFlowAdam:
    """One ``zenflow_adam_create`` handle: the registered groups and the affinity list.

    The Adam mode comes from the ``create_adam`` optimizer id it names, read at every step (as
    DeepSpeed reads its ``Adam_Optimizer``), the hyperparameters from each submitted command.
    """

    def __init__(self, op, optimizer_id: int, affinity: Sequence[int]) -> None:
        self.op = op
        self.optimizer_id = int(optimizer_id)
        # A negative entry leaves its pool thread unpinned, as in DeepSpeed's pinned pool.
        self.affinity = [int(c) for c in affinity]
        self.groups: List[_Group] = []

    def register_group(self, param: torch.Tensor, grad0: torch.Tensor, grad1: torch.Tensor, exp_avg0: torch.Tensor,
                       exp_avg1: torch.Tensor, exp_avg_sq0: torch.Tensor, exp_avg_sq1: torch.Tensor,
                       stale: Optional[torch.Tensor]) -> None:
        from .op_support import _check
        _check("param", param)
        if param.device.type != "cpu":
            raise ValueError(f"ZenFlowAdam: param is on {param.device}; the ZenFlow optimizer process works on CPU "
                             f"tensors")
        if not param.is_contiguous():
            raise ValueError("ZenFlowAdam: param must be contiguous")  # DeepSpeed's TORCH_CHECK
        named = dict(grad0=grad0, grad1=grad1, exp_avg0=exp_avg0, exp_avg1=exp_avg1, exp_avg_sq0=exp_avg_sq0,
                     exp_avg_sq1=exp_avg_sq1)
        if stale is not None:
            named["stale"] = stale
        for name, t in named.items():
            _check(name, t, param)
        for i, (m, v) in enumerate(((exp_avg0, exp_avg_sq0), (exp_avg1, exp_avg_sq1))):
            if m.dtype != v.dtype or m.dtype not in (torch.float32, param.dtype):
                raise TypeError(f"ZenFlowAdam: exp_avg{i} is {m.dtype} and exp_avg_sq{i} {v.dtype} with param "
                                f"{param.dtype}; states must share one dtype, float32 or the param's")
        if stale is not None and stale.dtype != param.dtype:
            raise TypeError(f"ZenFlowAdam: stale is {stale.dtype}, the param {param.dtype}; it receives a copy of the "
                            f"updated param")
        self.groups.append(_Group(param, (grad0, grad1), (exp_avg0, exp_avg1), (exp_avg_sq0, exp_avg_sq1), stale))

    def run_worker(self, ctrl: int) -> None:
        """The optimizer process's loop: run each submitted step until the exit command."""
        from ..backends import get_backend
        from .op_support import _update, cpu_weight_decay

        cpu = _linux_cpu()
        ctrl = int(ctrl)
        threads_before = torch.get_num_threads()
        cores_before = cpu.thread_cores()
        borrowed = cpu.thread_pool() != "own"
        if self.affinity:
            # One pool thread per core of ZenFlow's list, as DeepSpeed's pinned pool; this thread,
            # which takes part in each step, on the whole list (threads it starts, torch's, inherit
            # its mask). torch's thread count sizes our pool (backends.CPUBackend). Steps run on our
            # own pool here, not on torch's OpenMP threads, which we do not pin.
            cpu.use_torch_openmp(False)
            cpu.pin_pool(self.affinity, True)
            torch.set_num_threads(len(self.affinity))
        backend = get_backend("cpu").name
        try:
            while True:
                exit_now, now_state, step, hp, bias_correction = cpu.zenflow_wait_command(ctrl)
                if exit_now:
                    return
                if len(bias_correction) != len(self.groups):
                    raise RuntimeError(f"ZenFlowAdam: the control block carries {len(bias_correction)} param groups, "
                                       f"{len(self.groups)} were registered with zenflow_adam_register_group")
                adamw_mode = self.op._config(self.optimizer_id)["adamw_mode"]
                hypers = []
                for i in range(len(self.groups)):
                    lr, beta1, beta2, eps, weight_decay = hp[5 * i:5 * i + 5]
                    h = AdamHyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=cpu_weight_decay(weight_decay),
                                  step=int(step), adam_w_mode=adamw_mode, bias_correction=bool(bias_correction[i]))
                    try:  # every group's scalars before any group is written
                        adam_scalars(h)
                    except (ValueError, ArithmeticError) as exc:
                        raise RuntimeError(f"ZenFlowAdam: the submitted step {step} cannot run param group {i} "
                                           f"(lr {lr}, betas ({beta1}, {beta2}), eps {eps}): {exc}; no group of "
                                           f"this step was updated") from exc
                    hypers.append(h)
                for grp, h in zip(self.groups, hypers):
                    _update("zenflow_adam", [grp.param], [grp.grad[now_state]], [grp.exp_avg[now_state]],
                            [grp.exp_avg_sq[now_state]], h)
                    if grp.stale is not None:
                        grp.stale.copy_(grp.param)
                cpu.zenflow_post_done(ctrl, backend)
        finally:
            torch.set_num_threads(threads_before)
            if self.affinity and cores_before:
                cpu.pin_pool(cores_before, False)
            cpu.use_torch_openmp(borrowed)
