"""DeepSpeed's Lion and Adagrad op interfaces, served by this package's kernels.

DeepSpeed 0.19.8's optimizers call:

* ``FusedLion``: ``FusedLionBuilder().load().multi_tensor_lion(chunk_size, noop_flag,
  [grads, params, exp_avgs], lr, beta1, beta2, step, weight_decay)``;
* ``DeepSpeedCPULion``: ``CPULionBuilder().load()``'s ``create_lion(id, alpha, betta1, betta2,
  weight_decay, should_log)``, ``lion_update(id, step, lr, beta1, beta2, weight_decay, params,
  grads, exp_avg)`` and ``destroy_lion(id)``;
* ``DeepSpeedCPUAdagrad``: ``CPUAdagradBuilder().load()``'s ``create_adagrad(id, alpha, eps,
  weight_decay, should_log)``, ``adagrad_update(id, step, lr, epsilon, weight_decay, params, grads,
  exp_avg_sq)`` and ``destroy_adagrad(id)``.

The objects here have exactly those interfaces and forward every update to the package's
backends, so the math is the package's Lion and Adagrad contracts (contract.py). Where DeepSpeed's
own kernels differ from the contract, the contract wins and the difference is documented:

* Lion: DeepSpeed's kernels fuse ``p * (1 - lr * wd) - lr * sign(c)`` into one FMA and take
  ``sign(0)`` as +1 (``-copysign(lr, c)``); ours round each operation and leave the parameter
  alone where the interpolated momentum is exactly 0 (as lion_pytorch does). NaN propagates.
* Adagrad: DeepSpeed's ``cpu_adagrad`` has no learning-rate decay (the step only counts), so
  neither has this facade; weight decay is L2 (added to the gradient).
* Weight decay in the CPU ops (``lion_update``, ``adagrad_update``, as ``adam_update``) applies
  only when positive, as DeepSpeed's CPU kernels test it (``ops.cpu_weight_decay``);
  ``multi_tensor_lion`` applies any value, as DeepSpeed's CUDA kernel does.

This module does not import DeepSpeed.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Sequence, Tuple

import torch

from ..backends import get_backend, update_staged
from ..backends.versions import bump
from ..numerics.contract import AdagradHyper, LionHyper
from .op_support import _check, _count, cpu_weight_decay

__all__ = ["FusedLionOp", "CPULionOp", "CPUAdagradOp", "FUSED_LION_OP", "CPU_LION_OP", "CPU_ADAGRAD_OP"]


def _update(op: str, rule: str, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
            state_names: Sequence[str], states: Sequence[Sequence[torch.Tensor]], hp) -> None:
    """Validate every tensor first, adapt to the backends' preconditions (grads in the param dtype,
    non-contiguous views staged, empty partitions skipped, as for Adam: DeepSpeed hands all of
    these over), then make one backend call per (device, param dtype, state dtype)."""
    for i, p in enumerate(params):
        _check(f"params[{i}]", p)
        _check(f"grads[{i}]", grads[i], p)
        for name, lst in zip(state_names, states):
            s = lst[i]
            _check(f"{name}[{i}]", s, p)
            if s.dtype not in (torch.float32, p.dtype):
                raise TypeError(f"mps_fused_adam.deepspeed: {name}[{i}] is {s.dtype} with param dtype {p.dtype}; "
                                f"states must be float32 or the param's dtype")
    groups: Dict[Tuple[torch.device, torch.dtype, torch.dtype], List[list]] = {}
    with torch.no_grad():
        for i, p in enumerate(params):
            if p.numel() == 0:
                continue
            g = grads[i].detach()
            if g.dtype != p.dtype:
                g = g.to(p.dtype)
            key = (p.device, p.dtype, states[0][i].dtype)
            lists = groups.setdefault(key, [[], []] + [[] for _ in states])
            lists[0].append(p.detach())
            lists[1].append(g)
            for k, lst in enumerate(states):
                lists[2 + k].append(lst[i])
        for (device, _, _), lists in groups.items():
            backend = get_backend(device)
            update_staged(backend, rule, lists[0], lists[1], lists[2:], hp)
            bump(lists[0])  # detached views: the caller's tensors' counters (versions.py)
            _count(op, backend.name)


class FusedLionOp:
    """What ``FusedLionBuilder().load()`` returns: DeepSpeed's ``multi_tensor_lion`` interface."""

    name = "mps_fused_adam.fused_lion"

    @staticmethod
    def multi_tensor_lion(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]],
                          lr: float, beta1: float, beta2: float, step: int, weight_decay: float, *args) -> None:
        """Update ``tensor_lists = [grads, params, exp_avgs]`` in place (``chunk_size``,
        ``noop_flag`` and ``step`` are accepted and unused, as in DeepSpeed's CUDA kernel)."""
        if len(tensor_lists) != 3:
            raise ValueError("mps_fused_adam.deepspeed: multi_tensor_lion expects tensor_lists = "
                             f"[grads, params, exp_avgs], got {len(tensor_lists)} lists")
        grads, params, exp_avgs = tensor_lists
        if not (len(grads) == len(params) == len(exp_avgs)):
            raise ValueError("mps_fused_adam.deepspeed: multi_tensor_lion lists differ in length: "
                             f"{len(grads)} grads, {len(params)} params, {len(exp_avgs)} exp_avgs")
        if not params:
            return
        hp = LionHyper(lr=float(lr), beta1=float(beta1), beta2=float(beta2), weight_decay=float(weight_decay))
        _update("multi_tensor_lion", "lion", params, grads, ["exp_avgs"], [exp_avgs], hp)


class _Registry:
    """DeepSpeed keeps one C++ optimizer object per id; every update passes its hyperparameters
    again, so an id only has to exist (updating an unknown id is an error)."""

    kind = ""

    def __init__(self) -> None:
        self._ids: Dict[int, dict] = {}
        self._lock = threading.Lock()

    def _create(self, optimizer_id: int, config: dict) -> int:
        with self._lock:
            self._ids[int(optimizer_id)] = config
        return 0

    def _destroy(self, optimizer_id: int) -> int:
        with self._lock:
            self._ids.pop(int(optimizer_id), None)
        return 0

    def _require(self, optimizer_id: int) -> dict:
        with self._lock:
            cfg = self._ids.get(int(optimizer_id))
        if cfg is None:
            # DeepSpeed's C++ dereferences a null pointer here; a clear error is kinder.
            raise KeyError(f"mps_fused_adam.deepspeed: no CPU {self.kind} optimizer with id {optimizer_id}; "
                           f"call create_{self.kind.lower()}({optimizer_id}, ...) first")
        return cfg


class CPULionOp(_Registry):
    """What ``CPULionBuilder().load()`` returns: DeepSpeed's ``cpu_lion`` module interface."""

    name = "mps_fused_adam.cpu_lion"
    kind = "Lion"

    def create_lion(self, optimizer_id: int, alpha: float = 1e-3, betta1: float = 0.9, betta2: float = 0.999,
                    weight_decay: float = 0.0, should_log: bool = False) -> int:
        """Register optimizer ``optimizer_id`` (re-creating an id replaces it, as DeepSpeed does)."""
        if should_log:
            print(f"Lion Optimizer #{optimizer_id} is created with mps_fused_adam "
                  f"({get_backend('cpu').name} backend for CPU tensors).\n"
                  f"Config: alpha={alpha:f}, betas=({betta1:f}, {betta2:f}), weight_decay={weight_decay:f}")
        return self._create(optimizer_id, dict(lr=float(alpha), beta1=float(betta1), beta2=float(betta2),
                                               weight_decay=float(weight_decay)))

    def destroy_lion(self, optimizer_id: int) -> int:
        """Forget optimizer ``optimizer_id`` (unknown ids are ignored, as in DeepSpeed)."""
        return self._destroy(optimizer_id)

    def lion_update(self, optimizer_id: int, step: int, lr: float, beta1: float, beta2: float, weight_decay: float,
                    params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor) -> int:
        """One Lion step of ``params`` in place (``step`` is not used by Lion); returns 0."""
        self._require(optimizer_id)
        hp = LionHyper(lr=float(lr), beta1=float(beta1), beta2=float(beta2), weight_decay=cpu_weight_decay(weight_decay))
        _update("lion_update", "lion", [params], [grads], ["exp_avg"], [[exp_avg]], hp)
        return 0


class CPUAdagradOp(_Registry):
    """What ``CPUAdagradBuilder().load()`` returns: DeepSpeed's ``cpu_adagrad`` module interface."""

    name = "mps_fused_adam.cpu_adagrad"
    kind = "Adagrad"

    def create_adagrad(self, optimizer_id: int, alpha: float = 1e-2, eps: float = 1e-8, weight_decay: float = 0.0,
                       should_log: bool = False) -> int:
        """Register optimizer ``optimizer_id`` (re-creating an id replaces it, as DeepSpeed does)."""
        if should_log:
            print(f"Adagrad Optimizer #{optimizer_id} is created with mps_fused_adam "
                  f"({get_backend('cpu').name} backend for CPU tensors).\n"
                  f"Config: alpha={alpha:f}, weight_decay={weight_decay:f}")
        return self._create(optimizer_id, dict(lr=float(alpha), eps=float(eps), weight_decay=float(weight_decay)))

    def destroy_adagrad(self, optimizer_id: int) -> int:
        """Forget optimizer ``optimizer_id`` (unknown ids are ignored, as in DeepSpeed)."""
        return self._destroy(optimizer_id)

    def adagrad_update(self, optimizer_id: int, step: int, lr: float, epsilon: float, weight_decay: float,
                       params: torch.Tensor, grads: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
        """One Adagrad step of ``params`` in place; ``exp_avg_sq`` is the running sum of squared
        gradients. DeepSpeed's kernel has no learning-rate decay, so ``step`` only counts. Returns 0."""
        self._require(optimizer_id)
        hp = AdagradHyper(lr=float(lr), eps=float(epsilon), weight_decay=cpu_weight_decay(weight_decay),
                          step=max(int(step), 1))
        _update("adagrad_update", "adagrad", [params], [grads], ["exp_avg_sq"], [[exp_avg_sq]], hp)
        return 0


FUSED_LION_OP = FusedLionOp()
CPU_LION_OP = CPULionOp()
CPU_ADAGRAD_OP = CPUAdagradOp()
