"""``state['step']``: a Python int while stepping, torch's 0-dim tensor in state dicts.

torch's optimizers keep each param's step count as a 0-dim float tensor. Ours keep a Python int
in ``opt.state[p]['step']``: the step path writes the count of every tensor on every step, and an
int costs a dict store, where keeping 0-dim tensors current costs a torch call per tensor on top
of our step (``fill_``, or ``torch._foreach_add_`` as torch's own optimizers call), as much as or
more than our whole planned step path of a tensor (docs/benchmarks.md, "Figures behind the code").
The kernels take the count from the host either way.

A state dict is what tools read (checkpoint diffing, ``torch.distributed.checkpoint``, resuming in
``torch.optim``), so :func:`state_dict` hands the counts out in torch's form: each param's state
dict is a copy whose ``step`` is ``torch.tensor(float(step))`` in torch's scalar dtype (float32,
float64 under a float64 default dtype), on the CPU as torch's non-fused optimizers keep it. The
moment tensors are the live ones, as in torch. Loading takes either form (``fused.py``'s
``_retake_states``), so checkpoints of earlier versions of ours (int steps) still load.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

try:
    from torch.optim.optimizer import _get_scalar_dtype
except ImportError:  # pragma: no cover - a torch without it keeps float32 steps
    def _get_scalar_dtype() -> torch.dtype:
        return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def as_tensor_steps(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every int ``step`` as torch's 0-dim tensor; the per-param dicts that
    change are copies, so the optimizer's own state keeps its ints."""
    dtype = _get_scalar_dtype()
    packed = {}
    for key, st in state_dict["state"].items():
        step = st.get("step") if isinstance(st, dict) else None
        if type(step) is int:
            st = dict(st)
            st["step"] = torch.tensor(float(step), dtype=dtype)
        packed[key] = st
    out = dict(state_dict)
    out["state"] = packed
    return out


def state_dict(opt: torch.optim.Optimizer, torch_state_dict: Callable[[torch.optim.Optimizer], dict[str, Any]]
               ) -> dict[str, Any]:
    """torch's ``state_dict`` (``torch_state_dict``), with tensor steps, and the state-dict
    post-hooks (``register_state_dict_post_hook``) run where torch runs them: after the dict is
    made, on the dict as a torch optimizer would hand it to them."""
    post = getattr(opt, "_optimizer_state_dict_post_hooks", None)
    if post is not None:
        opt._optimizer_state_dict_post_hooks = type(post)()
    try:
        result = as_tensor_steps(torch_state_dict(opt))
    finally:
        if post is not None:
            opt._optimizer_state_dict_post_hooks = post
    for hook in list((post or {}).values()):
        hooked = hook(opt, result)
        if hooked is not None:
            result = hooked
    return result
