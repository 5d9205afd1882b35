"""``step_in_backward=True``: each parameter is stepped from its post-accumulate-grad hook and its
gradient freed at once, so a full set of gradients never lives from backward to ``step()``.

PyTorch documents the pattern (``Tensor.register_post_accumulate_grad_hook``, "How to save memory
by fusing the optimizer step into the backward pass"). Here it runs inside one ordinary optimizer:
its ``param_groups``, schedulers, ``add_param_group`` and state dict are the plain class's, and each
hook hands its one parameter to the class's own single-parameter step (``_step_one``), which runs
the same validation and the same kernel as a grouped step (the SIMD kernel on CPU, one Metal
dispatch for an MPS tensor). Every update rule is elementwise (8-bit: per block of one tensor), so a
parameter stepped alone is bit for bit what a grouped step makes of it.

What the hooks cannot do, and so is refused here or left to ``step()``:

- a parameter that appears twice in a group is refused (the plain step updates it once per
  appearance, as torch's does; a hook steps once per backward);
- a parameter that does not require grad gets no hook (torch cannot hook it); a hand-set ``.grad``
  of any parameter is stepped by ``step()``, which steps whatever still has a grad;
- DTensor params (FSDP2, tensor parallel) are refused: unverified (their grads are reduced by
  FSDP's own hooks, whose order against ours was not checked);
- DeepSpeed owns the step: ZeRO-3 params are refused, and a hook whose param DeepSpeed's ZeRO has
  taken out of the param groups raises;
- ``step(closure)`` is refused (:func:`refuse_closure`);
- clipping the gradients the hooks consumed, and accelerate's gradient accumulation, are refused
  (``consumed_grads.py``, which also keeps each backward's true gradient norm);
- a backward run inside another one's backward (reentrant checkpointing,
  ``torch.utils.checkpoint(..., use_reentrant=True)``, DeepSpeed's activation checkpointing, any
  autograd Function whose backward calls ``backward()``) raises from the first hook it reaches
  (:func:`refuse_nested_backward`): its params' gradients arrive in parts, one per inner backward
  plus the outer one, where a plain step sees their sum once, and a later segment's recomputation
  would read params already stepped.

A param stepped in its hook and then read again by the same backward through a tensor autograd
saved (itself, or a ``.detach()`` view, which shares its version counter) makes that backward raise
torch's "modified by an inplace operation" error, as torch's own per-parameter hook recipe does:
every step bumps the version counters of the params it writes (``backends/versions.py``).
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Optional

import torch

from . import consumed_grads, dtensor, validate

ATTRIBUTE = "_in_backward"  # where an optimizer keeps its InBackward (absent or None: plain)
_STATE_KEY = "mps_fused_adam_step_in_backward"  # in __getstate__'s dict, for pickling and deepcopy


def enabled(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` steps its parameters from their post-accumulate-grad hooks."""
    return opt.__dict__.get(ATTRIBUTE) is not None


def setup(opt: torch.optim.Optimizer, on: bool) -> None:
    """Called by a constructor before torch's ``__init__`` adds the param groups (each group's
    hooks are registered by :func:`group_added`)."""
    opt.__dict__[ATTRIBUTE] = InBackward(opt) if on else None


def group_added(opt: torch.optim.Optimizer, gi: int, device_type: Optional[str] = None) -> None:
    """Check ``param_groups[gi]`` for what the hooks cannot step and register its hooks; raises
    ValueError (naming the param) before any hook is registered. No-op when the option is off."""
    hooks = opt.__dict__.get(ATTRIBUTE)
    if hooks is not None:
        hooks.attach(opt, gi, device_type)


def refuse_closure(opt: torch.optim.Optimizer, closure: Any) -> None:
    """``step(closure)`` with ``step_in_backward=True``: refused, with why."""
    if closure is not None and enabled(opt):
        raise RuntimeError(
            f"{type(opt).__name__}(step_in_backward=True).step(closure): refused. With step_in_backward every "
            "backward is the step: the closure's backward would update each parameter inside step(), once per "
            "call of the closure, and step() would then find no gradient left. Call loss.backward() and then "
            "step() without a closure, or use step_in_backward=False for closure-based training.")


def getstate(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``__getstate__``'s dict with the option (the hooks themselves are not picklable)."""
    state[_STATE_KEY] = enabled(opt)
    return state


def take_state(state: dict[str, Any]) -> Optional[bool]:
    """The option, taken out of ``state`` before torch's ``__setstate__`` sees it: None when
    ``state`` does not carry it (torch's ``load_state_dict`` calls ``__setstate__`` too, and the
    hooks then stay as they are)."""
    return state.pop(_STATE_KEY, None)


def restore(opt: torch.optim.Optimizer, on: Optional[bool]) -> None:
    """After ``__setstate__`` of a pickled or deep-copied optimizer: hooks on its own params."""
    if on is None:
        return
    setup(opt, on)
    for gi in range(len(opt.param_groups)):
        group_added(opt, gi, getattr(opt, "_device_type", None))


def _remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _hook(ref: "weakref.ref[torch.optim.Optimizer]", p: torch.Tensor) -> None:
    # Registered on the param, this holds the optimizer only weakly: a dropped optimizer steps nothing
    # (and its finalizer removes the hooks).
    opt = ref()
    if opt is None or p.grad is None:
        return
    hooks = opt.__dict__.get(ATTRIBUTE)
    if hooks is None:
        return
    gi, pi, group = hooks.locate(opt, p)
    refuse_nested_backward(opt, p, gi, pi, group)
    names = group.get("param_names")
    consumed_grads.before_step(opt, p, names[pi] if names else f"param_groups[{gi}]['params'][{pi}]")
    # Autograd runs hooks with grad mode off unless backward(create_graph=True): no context then.
    if torch.is_grad_enabled():
        with torch.no_grad():
            opt._step_one(gi, group, pi, p)  # raises naming the param; the grad is then left in place
    else:
        opt._step_one(gi, group, pi, p)
    p.grad = None


# BackwardCFunction.apply runs the backward of every Python autograd Function (torch.autograd.function),
# so a hook with its frame below it on the stack runs in a backward started from inside another one.
_FUNCTION_BACKWARD = getattr(getattr(torch.autograd.function, "BackwardCFunction", None), "apply", None)
_NESTED_CODES = {_FUNCTION_BACKWARD.__code__} if _FUNCTION_BACKWARD is not None else set()
_nested_by_task: dict[int, bool] = {}  # graph task id -> whether it runs inside another backward


def in_nested_backward() -> bool:
    """Whether the backward running this hook was started from inside another backward's node (a
    reentrant checkpoint's recomputation and inner backward). Read from the Python stack once per
    graph task (``torch._C._current_graph_task_id``): the engine runs a nested backward on the thread
    that runs the enclosing node, so that node's frame is below the hook's."""
    task = torch._C._current_graph_task_id()
    nested = _nested_by_task.get(task)
    if nested is None:
        frame, nested = sys._getframe(1), False
        while frame is not None and not nested:
            nested = frame.f_code in _NESTED_CODES
            frame = frame.f_back
        if task >= 0:  # -1: no graph task (a hook called by hand), nothing to key on
            if len(_nested_by_task) > 64:
                _nested_by_task.clear()
            _nested_by_task[task] = nested
    return nested


def refuse_nested_backward(opt: torch.optim.Optimizer, p: torch.Tensor, gi: int, pi: int,
                           group: dict[str, Any]) -> None:
    """Raise, before ``p`` is stepped, when its hook runs in a nested backward (module docstring)."""
    if not in_nested_backward():
        return
    names = group.get("param_names")
    who = validate.describe(p, names[pi] if names else f"param_groups[{gi}]['params'][{pi}]")
    raise RuntimeError(
        f"{who}: {type(opt).__name__}(step_in_backward=True) cannot step from a backward run inside another "
        f"backward (reentrant checkpointing: torch.utils.checkpoint(..., use_reentrant=True), DeepSpeed's "
        f"activation checkpointing, or an autograd Function whose backward calls backward()). Each inner "
        f"backward hands its params a part of their gradient (a param shared by several segments, or used "
        f"inside and outside one, would be stepped once per part), and later segments would be recomputed "
        f"from params already stepped. Use torch.utils.checkpoint(..., use_reentrant=False), or "
        f"step_in_backward=False. Params whose hooks ran earlier in this backward have been stepped.")


class InBackward:
    """One optimizer's hooks: their handles, and where each hooked param sits in the param groups."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self._ref = weakref.ref(opt)
        self._handles: list = []
        self._where: dict[int, tuple[int, int]] = {}
        weakref.finalize(opt, _remove_all, self._handles)
        consumed_grads.track(opt)  # clipping what the hooks consumed raises; their norms are kept

    def attach(self, opt: torch.optim.Optimizer, gi: int, device_type: Optional[str]) -> None:
        group = opt.param_groups[gi]
        names = group.get("param_names")
        dt_cls = dtensor.dtensor_type()
        cls = type(opt).__name__
        # Everything checked first: a refused group registers no hook.
        dup = validate.duplicate_param(group["params"])
        if dup is not None:
            at = [names[i] if names else f"param_groups[{gi}]['params'][{i}]" for i in dup]
            raise ValueError(f"{validate.describe(group['params'][dup[1]], at[1])} is the same tensor as {at[0]}: "
                             f"the plain step (as torch's) updates such a param once per appearance, its one hook "
                             f"once per backward; {cls}(step_in_backward=True) takes each param once")
        for pi, p in enumerate(group["params"]):
            name = names[pi] if names else f"param_groups[{gi}]['params'][{pi}]"
            who = validate.describe(p, name)
            if dt_cls is not None and isinstance(p, dt_cls):
                raise ValueError(f"{who}: {cls}(step_in_backward=True) does not step DTensor params (FSDP2, tensor "
                                 f"parallel): their gradients are reduced by FSDP's own hooks, and stepping them "
                                 f"from ours is unverified; use step_in_backward=False")
            if hasattr(p, "ds_id"):
                raise ValueError(f"{who}: a DeepSpeed ZeRO-3 param; DeepSpeed owns the step (it reduces and "
                                 f"partitions gradients after backward), so step_in_backward=True cannot run "
                                 f"under it; use step_in_backward=False")
            if p.layout is not torch.strided:
                raise ValueError(f"{who}: layout {p.layout}; step_in_backward=True steps dense (strided) params")
            if device_type is not None and p.device.type != device_type:
                raise ValueError(f"{who}: expected a {device_type} tensor, found one on {p.device}")
        for pi, p in enumerate(group["params"]):
            self._where[id(p)] = (gi, pi)
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(_hook, self._ref)))

    def locate(self, opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple[int, int, dict[str, Any]]:
        """``(group index, index in the group, group)`` of ``p``, found again if the groups moved."""
        where = self._where.get(id(p))
        groups = opt.param_groups
        if where is not None:
            gi, pi = where
            if gi < len(groups):
                params = groups[gi]["params"]
                if pi < len(params) and params[pi] is p:
                    return gi, pi, groups[gi]
        for gi, group in enumerate(groups):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    self._where[id(p)] = (gi, pi)
                    return gi, pi, group
        raise RuntimeError(
            f"{validate.describe(p, 'a param')} has a {type(opt).__name__}(step_in_backward=True) hook but is no "
            f"longer in its param_groups: something replaced them (DeepSpeed's ZeRO replaces a client optimizer's "
            f"params with its flat partitions; DeepSpeed owns the step, so step_in_backward=True cannot run "
            f"under it). Build the optimizer with step_in_backward=False, or remove_hooks() before regrouping.")

    def remove(self) -> None:
        _remove_all(self._handles)
        self._where.clear()


def remove_hooks(opt: torch.optim.Optimizer) -> None:
    """Remove ``opt``'s hooks: from then on it is a plain optimizer (``step()`` steps every grad)."""
    hooks = opt.__dict__.get(ATTRIBUTE)
    if hooks is not None:
        hooks.remove()
        opt.__dict__[ATTRIBUTE] = None
        opt.__dict__.pop("_one_plans", None)  # the hooks' per-param plans (_step_one) hold params and states

