"""What happens to the gradients ``step_in_backward=True`` consumed: what a caller may still ask
of them after backward, and what it may not.

By the end of backward every hooked parameter has been stepped and its gradient freed. A caller
that then clips (Hugging Face ``Trainer`` with ``max_grad_norm > 0``, Lightning's
``gradient_clip_val``, a hand-written ``clip_grad_norm_``) would find no gradient and clip
nothing: torch returns a norm of 0 and the step has already run unclipped. Exact global-norm
clipping needs the norm of every gradient before the first update, which a step taken inside
backward cannot have. So, as a behaviour stated once:

- each hook records the L2 norm of the gradient it consumed (before the step, as torch's
  ``clip_grad_norm_`` computes a gradient's norm: in its dtype); :func:`grad_norm` gives the
  global norm of the last backward's consumed gradients;
- ``torch.nn.utils.clip_grad_norm_`` (and ``clip_grad_value_``) over parameters whose gradient the
  hooks consumed raises a RuntimeError saying so, except ``max_norm=inf`` with the 2-norm (no
  clipping: what Trainer calls only to log the norm), which returns the true global norm of the
  step, the consumed gradients' recorded norms together with any gradient still held, combined
  by torch's own total-norm function in the parameters' order, so that it equals bit for bit what
  torch returns for the same gradients without ``step_in_backward``;
- accelerate's gradient accumulation (``Accelerator(gradient_accumulation_steps=N)``, ``Trainer``'s
  ``gradient_accumulation_steps``) is refused from the hook: on a micro-batch that accelerate will
  not step, the hooks would step anyway.

Torch's two functions are wrapped (once, when the first ``step_in_backward`` optimizer is built),
because they are where every one of those callers ends; the wrapper only acts on parameters a
live optimizer's hooks consumed in its last backward, and otherwise calls torch's own function.
"""
from __future__ import annotations

import functools
import math
import sys
import weakref
from typing import Iterable, Optional, Union

import torch

from . import validate

_RECORD = "_consumed_grads"  # where an optimizer keeps its _Record
_live: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_WRAPPED = "_mps_fused_adam_wrapped"


class _Record:
    """One optimizer's consumed gradients of its last backward: param id -> (param, grad norm)."""

    def __init__(self) -> None:
        self.norms: dict[int, tuple["weakref.ref[torch.Tensor]", torch.Tensor]] = {}
        self.in_backward = False  # a backward of this optimizer's hooks is running

    def ended(self) -> None:
        self.in_backward = False


def track(opt: torch.optim.Optimizer) -> None:
    """Called when ``opt`` gets ``step_in_backward`` hooks: its record, and torch's clipping
    functions wrapped (idempotent)."""
    if _RECORD not in opt.__dict__:
        opt.__dict__[_RECORD] = _Record()
        _live.add(opt)
    _wrap_torch()


def before_step(opt: torch.optim.Optimizer, p: torch.Tensor, name: str) -> None:
    """In ``p``'s hook, before it is stepped: refuse accelerate's accumulation micro-batches,
    start a new record at the first hook of a backward, and record the gradient's norm."""
    _refuse_accumulation(opt, p, name)
    rec = opt.__dict__.get(_RECORD)
    if rec is None:
        return
    if not rec.in_backward:
        rec.norms.clear()
        rec.in_backward = True
        # Runs when this backward is done: the next hook to fire is then a new backward's.
        torch.autograd.Variable._execution_engine.queue_callback(rec.ended)
    # torch's own per-tensor norm of this gradient (torch.nn.utils.get_total_norm), so the totals
    # below are the ones torch computes for the same gradients.
    rec.norms[id(p)] = (weakref.ref(p), _tensor_norm(p.grad.detach()))


def _tensor_norm(g: torch.Tensor) -> torch.Tensor:
    return torch.nn.utils.get_total_norm([g.reshape(-1)], 2.0) if g.numel() else torch.zeros((), dtype=g.dtype,
                                                                                        device=g.device)


def _total_norm(items: list[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]],
                error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
    """torch's total 2-norm of a list, in order, of (live gradient, None) and (None, recorded norm of a
    consumed one): each recorded norm stands in as the one-element tensor holding it, whose norm
    torch computes as that value exactly (sqrt of an exact square, in fp32 or wider); torch's grouping
    by device and dtype, its foreach choice and its final reduction are then its own. A norm whose
    square would overflow fp32 cannot stand in that way: the norms are then reduced in order."""
    stand_ins = []
    for live, norm in items:
        if live is not None:
            stand_ins.append(live)
        elif bool(torch.isfinite(norm)) and float(norm) < 1e18:
            stand_ins.append(norm.reshape(1))
        else:
            return _ordered_total(items, error_if_nonfinite, foreach)
    return torch.nn.utils.get_total_norm(stand_ins, 2.0, error_if_nonfinite, foreach)


def _ordered_total(items, error_if_nonfinite, foreach) -> torch.Tensor:
    norms = [norm if live is None else _tensor_norm(live) for live, norm in items]
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2.0)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError("The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
                           "cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")
    return total


def grad_norm(opt: torch.optim.Optimizer) -> Optional[torch.Tensor]:
    """The global L2 norm (fp32, 0-dim, on the gradients' device) of the gradients ``opt``'s
    ``step_in_backward`` hooks consumed in its last backward, each taken before its step: the
    norm ``clip_grad_norm_`` would have reported for that step. None when ``opt`` has no
    ``step_in_backward`` hooks or no backward has run them yet."""
    rec = opt.__dict__.get(_RECORD)
    if rec is None or not rec.norms:
        return None
    order = [id(p) for group in opt.param_groups for p in group["params"]]
    items = [(None, rec.norms[k][1]) for k in order if k in rec.norms]
    return _total_norm(items)


def _consumed() -> dict[int, tuple[torch.Tensor, torch.optim.Optimizer]]:
    """id -> (recorded norm, optimizer) of every param a live optimizer's hooks consumed in its
    last backward and whose gradient is still gone."""
    found = {}
    for opt in list(_live):
        rec = opt.__dict__.get(_RECORD)
        for key, (ref, norm) in (rec.norms.items() if rec else ()):
            p = ref()
            if p is not None and p.grad is None:
                found[key] = (norm, opt)
    return found


def _params_list(parameters: Union[torch.Tensor, Iterable[torch.Tensor]]) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _refusal(what: str, hit: list[tuple[torch.Tensor, torch.optim.Optimizer]]) -> RuntimeError:
    p, opt = hit[0]
    return RuntimeError(
        f"{what}: the gradients of {len(hit)} parameter(s) (the first: {validate.describe(p, 'a param')}) were "
        f"already stepped and freed by {type(opt).__name__}(step_in_backward=True)'s hooks during backward, so "
        f"they cannot be clipped: the step ran unclipped. Global-norm clipping needs every gradient before the "
        f"first update, which stepping in backward cannot have. Either build the optimizer with "
        f"step_in_backward=False, or turn clipping off (Trainer: max_grad_norm=0; Lightning: "
        f"gradient_clip_val=None). The true gradient norm of each step is "
        f"mps_fused_adam.optimizers.consumed_grads.grad_norm(opt), and clip_grad_norm_(params, float('inf')) "
        f"returns it.")


def _clip_grad_norm(orig, parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    params = _params_list(parameters)
    consumed = _consumed()
    hit = [(p, consumed[id(p)][1]) for p in params if id(p) in consumed]
    if not hit:
        return orig(params, max_norm, norm_type, error_if_nonfinite, foreach)
    if not (float(max_norm) == math.inf and float(norm_type) == 2.0):
        raise _refusal(f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type})", hit)
    # No clipping asked: the norm alone, the consumed gradients' recorded norms and the live ones'
    # in the parameters' order, as torch would have combined them.
    items = [(None, consumed[id(p)][0]) if id(p) in consumed else (p.grad, None)
             for p in params if id(p) in consumed or p.grad is not None]
    return _total_norm(items, error_if_nonfinite, foreach)


def _clip_grad_value(orig, parameters, clip_value, foreach=None):
    params = _params_list(parameters)
    consumed = _consumed()
    hit = [(p, consumed[id(p)][1]) for p in params if id(p) in consumed]
    if hit:
        raise _refusal(f"clip_grad_value_(clip_value={clip_value})", hit)
    return orig(params, clip_value, foreach)


def _wrap_torch() -> None:
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_mod
    for name, impl in (("clip_grad_norm_", _clip_grad_norm), ("clip_grad_value_", _clip_grad_value)):
        orig = getattr(clip_mod, name)
        if getattr(orig, _WRAPPED, False):
            continue
        wrapper = functools.wraps(orig)(functools.partial(impl, orig))
        setattr(wrapper, _WRAPPED, True)
        for module in (clip_mod, nn_utils):
            if getattr(module, name, None) is orig:
                setattr(module, name, wrapper)


def _refuse_accumulation(opt: torch.optim.Optimizer, p: torch.Tensor, name: str) -> None:
    """accelerate (and Trainer, through it) marks a micro-batch it will not step by
    ``GradientState.sync_gradients = False``; its wrapped ``step()`` then does nothing, but the
    hooks would step. Read only when accelerate is already imported."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    if isinstance(shared, dict) and shared.get("sync_gradients", True) is False:
        raise RuntimeError(
            f"{validate.describe(p, name)}: {type(opt).__name__}(step_in_backward=True) under accelerate's "
            f"gradient accumulation (this backward is a micro-batch accelerate will not step): the hooks step at "
            f"every backward, so the accumulated step cannot be had. Use gradient_accumulation_steps=1 (a larger "
            f"batch) or step_in_backward=False.")

