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
* the optimizer process is spawned, so it never ran ``install()``; :func:`patch_optimizer_process`
  (called by ``install()``) makes it run ``install()`` before DeepSpeed's own process body, so its
  ``CPUAdamBuilder().load()`` returns our op too and nothing is JIT-built there either.

ZenFlow's cross-process API is Linux-only, as in DeepSpeed (macOS has no unnamed process-shared
semaphores); elsewhere the control-block functions raise ``RuntimeError`` saying so.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..contract import AdamHyper

__all__ = ["ZenFlowAdam", "supported", "control_info", "patch_optimizer_process"]

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
        self.affinity = [int(c) for c in affinity]
        if any(c < 0 for c in self.affinity):
            raise ValueError(f"zenflow_adam_create: core numbers must be >= 0, got {self.affinity}")
        self.groups: List[_Group] = []

    def register_group(self, param: torch.Tensor, grad0: torch.Tensor, grad1: torch.Tensor, exp_avg0: torch.Tensor,
                       exp_avg1: torch.Tensor, exp_avg_sq0: torch.Tensor, exp_avg_sq1: torch.Tensor,
                       stale: Optional[torch.Tensor]) -> None:
        from .ops import _check
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
        from .ops import _update

        cpu = _linux_cpu()
        ctrl = int(ctrl)
        threads_before = torch.get_num_threads()
        cores_before = cpu.thread_cores()
        borrowed = cpu.thread_pool() != "own"
        if self.affinity:
            # One pool thread per core of ZenFlow's list, this thread on the first, as DeepSpeed's
            # pinned pool; torch's thread count sizes our pool (backends.CPUBackend). Steps run on
            # our own pool here, not on torch's OpenMP threads, which we do not pin.
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
                for i, grp in enumerate(self.groups):
                    lr, beta1, beta2, eps, weight_decay = hp[5 * i:5 * i + 5]
                    h = AdamHyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=int(step),
                                  adam_w_mode=adamw_mode, bias_correction=bool(bias_correction[i]))
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


# --- Making the spawned optimizer process run install() ------------------------------------------

_original: Dict[str, Any] = {}
_patch_lock = threading.Lock()


def _optimizer_process_entry(install_kwargs: dict, *args, **kwargs):
    """ZenFlow's optimizer process target: ``install()`` here, then DeepSpeed's own process body."""
    from . import install
    install(**install_kwargs)
    return _original["zenflow_optimizer_process"](*args, **kwargs)


def patch_optimizer_process(block_jit: bool) -> bool:
    """Make ZenFlow's optimizer process (started with the "spawn" method, so it has not run
    ``install()``) run ``install(block_jit=block_jit)`` first. Returns whether DeepSpeed has ZenFlow.

    ``start_optimizer_process`` looks ``zenflow_optimizer_process`` up in its module when it starts
    the process, so rebinding that name is enough; the replacement is a ``functools.partial`` of a
    function of this module, which pickles by reference into the spawned process.
    """
    try:
        import deepspeed.runtime.zenflow.zenflow_utils as zu
    except ImportError:  # a DeepSpeed without ZenFlow
        return False
    with _patch_lock:
        current = getattr(zu, "zenflow_optimizer_process", None)
        if current is None:
            return False
        if isinstance(current, functools.partial) and current.func is _optimizer_process_entry:
            current = _original["zenflow_optimizer_process"]
        _original["zenflow_optimizer_process"] = current
        zu.zenflow_optimizer_process = functools.partial(_optimizer_process_entry,
                                                         {"block_jit": bool(block_jit), "use_mps": False})
    return True

