"""Checks run on a whole step before any tensor is written, so a rejected step changes nothing."""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from ..backends import SUPPORTED_DTYPES

_SUPPORTED_NAMES = "float32, float16 or bfloat16"


def _at_least(low: float, value: Any, what: str, suffix: str) -> bool:
    """``low <= value``, torch's comparison on the value as given: a str (or None) raises torch's
    TypeError, where float() would have taken "1e-3". In a step's check of a group (``suffix``
    names it: a loaded state dict or a hand-edited group may hold anything) the TypeError says
    which hyperparameter of which group it is."""
    try:
        return low <= value
    except TypeError:
        if not suffix:
            raise
        raise TypeError(f"Invalid {what}: {value!r} is a {type(value).__name__}, not a number{suffix}") from None


def _nonnegative(value: Any, what: str, suffix: str) -> None:
    """torch's check of a hyperparameter that must be >= 0, with its message ("Invalid <what>: ...")."""
    if not _at_least(0.0, value, what, suffix):
        raise ValueError(f"Invalid {what}: {float(value)}{suffix}")


def _lr(lr: Any, suffix: str) -> None:
    """The learning rate: a number or a one-element tensor, non-negative (every rule's first check)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element{suffix}")
    _nonnegative(lr, "learning rate", suffix)


def _betas(betas: Any, suffix: str) -> tuple[Any, Any]:
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}{suffix}") from None
    return beta1, beta2


def check_hyperparameters(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str = "") -> None:
    """The checks of ``torch.optim.AdamW``, with the same messages, plus the group they concern."""
    suffix = f" (in {where})" if where else ""
    _lr(lr, suffix)
    _nonnegative(eps, "epsilon value", suffix)
    for i, beta in enumerate(_betas(betas, suffix)):
        if not (_at_least(0.0, beta, f"beta parameter at index {i}", suffix) and beta < 1.0):
            raise ValueError(f"Invalid beta parameter at index {i}: {float(beta)}{suffix}")
    _nonnegative(weight_decay, "weight_decay value", suffix)


def check_lion_hyperparameters(lr: Any, betas: Any, weight_decay: Any, where: str = "") -> None:
    """Lion's hyperparameters: lr and weight decay non-negative, both betas in [0, 1] (lion_pytorch's range)."""
    suffix = f" (in {where})" if where else ""
    _lr(lr, suffix)
    for i, beta in enumerate(_betas(betas, suffix)):
        if not (_at_least(0.0, beta, f"beta parameter at index {i}", suffix) and beta <= 1.0):
            raise ValueError(f"Invalid beta parameter at index {i}: {float(beta)}{suffix}")
    _nonnegative(weight_decay, "weight_decay value", suffix)


def check_adagrad_hyperparameters(lr: Any, lr_decay: Any, weight_decay: Any, initial_accumulator_value: Any,
                                  eps: Any, where: str = "") -> None:
    """The checks of ``torch.optim.Adagrad``, with the same messages, plus the group they concern."""
    suffix = f" (in {where})" if where else ""
    _lr(lr, suffix)
    for value, what in ((lr_decay, "lr_decay value"), (weight_decay, "weight_decay value"),
                        (initial_accumulator_value, "initial_accumulator_value value"), (eps, "epsilon value")):
        _nonnegative(value, what, suffix)


def describe(p: torch.Tensor, name: str) -> str:
    return f"{name} (shape {tuple(p.shape)}, {str(p.dtype).replace('torch.', '')}, {p.device})"


def check_param_dtype(p: torch.Tensor, name: str) -> None:
    """A parameter's dtype must be one the kernels have; checked when the parameter is added
    (construction, ``add_param_group``) and again at each step (``p.data`` may be replaced)."""
    if p.dtype not in SUPPORTED_DTYPES:
        hint = " (for float64 parameters use torch.optim.Adam/AdamW)" if p.dtype is torch.float64 else ""
        raise ValueError(f"{describe(p, name)}: dtype {p.dtype} is not supported; expected {_SUPPORTED_NAMES}{hint}")


def check_param(p: torch.Tensor, g: torch.Tensor, name: str, device_type: str | None) -> None:
    """Raise a ValueError naming the parameter, what was expected and what was found."""
    # One cheap test first: the per-step cost of 1,000 tensors must stay small. A ZeroTensor grad
    # passes (the step materialises it, as torch's optimizers take it for zeros).
    if (p.dtype in SUPPORTED_DTYPES and g.dtype is p.dtype and g.layout is torch.strided
            and g.device == p.device and g.shape == p.shape
            and (device_type is None or p.device.type == device_type)):
        return
    check_param_dtype(p, name)
    who = describe(p, name)
    if device_type is not None and p.device.type != device_type:
        raise ValueError(f"{who}: expected a {device_type} tensor, found one on {p.device}")
    if g.layout is not torch.strided:
        raise ValueError(f"{who}: sparse gradients are not supported (grad layout {g.layout}); "
                         "expected a dense gradient")
    if g.dtype is not p.dtype:
        raise ValueError(f"{who}: grad dtype {g.dtype} does not match; expected {p.dtype}")
    if g.device != p.device:
        raise ValueError(f"{who}: grad is on {g.device}; expected {p.device}")
    raise ValueError(f"{who}: grad shape {tuple(g.shape)} does not match; expected {tuple(p.shape)}")


def check_memory(p: torch.Tensor, name: str, t: torch.Tensor, what: str) -> None:
    """``t`` (``p`` itself, its grad or a state, ``what`` says which) has address 0: refused when it
    has elements but no memory (its storage freed, ``untyped_storage().resize_(0)``), which a
    kernel would be handed as a null pointer. Meta tensors, ZeroTensors and empty tensors have
    address 0 legitimately."""
    if t.numel() > 0 and not t.is_meta and not t._is_zerotensor() and t.data_ptr() == 0:
        raise ValueError(f"{describe(p, name)}: {what} has no memory (address 0: its storage was freed, as "
                         f"untyped_storage().resize_(0) frees it); expected {t.numel() * t.element_size()} "
                         f"bytes of storage, found {t.untyped_storage().nbytes()}")


def check_state(p: torch.Tensor, state: Mapping[str, Any], name: str, state_dtype: torch.dtype,
                keys: Sequence[str] = ("exp_avg", "exp_avg_sq")) -> None:
    """Existing optimizer state ``keys`` (perhaps loaded from a checkpoint) must fit its parameter."""
    for key in keys:
        t = state.get(key)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{describe(p, name)}: optimizer state '{key}' is missing or not a tensor "
                             f"(found {type(t).__name__})")
        if t.shape != p.shape or t.device != p.device or t.dtype is not state_dtype:
            raise ValueError(f"{describe(p, name)}: optimizer state '{key}' is {describe(t, key)}; expected "
                             f"shape {tuple(p.shape)}, {str(state_dtype).replace('torch.', '')}, {p.device}")
    check_step(p, state, name)


def check_step(p: torch.Tensor, state: dict[str, Any], name: str) -> None:
    """A state's ``step`` (0 when absent) must be a non-negative int: the optimizers keep it a
    Python int, ``load_state_dict`` too. A one-element tensor holding a whole non-negative count,
    torch's form, is taken as that int in place: states written without our ``load_state_dict``
    carry it (``torch.distributed.optim.ZeroRedundancyOptimizer``'s load copies them in as saved)."""
    step = state.get("step", 0)
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_complex():
        value = step.item()
        if not isinstance(value, bool) and math.isfinite(value) and value >= 0 and value == int(value):
            state["step"] = int(value)
            return
    if type(step) is not int or step < 0:
        raise ValueError(f"{describe(p, name)}: optimizer state 'step' is {step!r} ({type(step).__name__}); "
                         f"expected the number of steps taken, a non-negative int")


def check_saved_step(p: torch.Tensor, step: Any, name: str) -> None:
    """A state dict's ``step``: a count of steps taken, as ours (an int) or torch's (a one-element
    tensor) save it; rejected at load, not at the next step, when it is none."""
    value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or value != int(value):
        shown = f"tensor({value!r})" if isinstance(step, torch.Tensor) and step.numel() == 1 else repr(step)
        raise ValueError(f"{describe(p, name)}: the state dict's 'step' is {shown}; expected the number of steps "
                         f"taken, a non-negative whole number")


def appearance_rounds(params: Sequence[torch.Tensor]) -> list[list[int]] | None:
    """None when every tensor of ``params`` appears once (the common case: one set of ids);
    otherwise the indices of each tensor's first appearance, then of each second appearance, and
    so on: the rounds in which torch's one-after-the-other updates of a duplicated param can be
    made without one call holding a tensor twice."""
    if len(set(map(id, params))) == len(params):
        return None
    seen: dict[int, int] = {}
    rounds: list[list[int]] = []
    for pi, p in enumerate(params):
        r = seen[id(p)] = seen.get(id(p), -1) + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(pi)
    return rounds


def duplicate_param(params: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The indices of the first tensor of ``params`` seen twice, or None."""
    if len(set(map(id, params))) == len(params):
        return None
    first: dict[int, int] = {}
    for pi, p in enumerate(params):
        if id(p) in first:
            return first[id(p)], pi
        first[id(p)] = pi
    return None


def check_group_param_dtypes(group: Mapping[str, Any], gi: int) -> None:
    """Every parameter of ``param_groups[gi]`` must have a dtype the kernels have (the check made
    when a group is added)."""
    names = group.get("param_names")
    for pi, p in enumerate(group["params"]):
        if p.dtype not in SUPPORTED_DTYPES:
            check_param_dtype(p, names[pi] if names else f"param_groups[{gi}]['params'][{pi}]")


# What marks a state dict as Adam's: every group has these hyperparameters (torch.optim.Adam/AdamW,
# ours, DeepSpeed's FusedAdam and DeepSpeedCPUAdam all do; SGD, Adagrad, RMSprop... do not).
class StateDictKind(NamedTuple):
    """What a state dict of one optimizer family looks like: the group hyperparameters it must
    have, those it must not have (another family's), and its per-parameter state tensors."""

    family: str
    required: tuple[str, ...]
    foreign: tuple[str, ...]
    states: tuple[str, ...]
    # Whether a param's saved state must hold its step count (lion_pytorch's Lion keeps none).
    has_steps: bool = True


ADAM_STATE_DICT = StateDictKind("Adam-family", ("betas", "eps"), ("lr_decay",), ("exp_avg", "exp_avg_sq"))


def check_state_dict(state_dict: Mapping[str, Any], param_groups: list[dict[str, Any]],
                     kind: StateDictKind = ADAM_STATE_DICT,
                     check_saved_state: Callable[[torch.Tensor, Mapping[str, Any], str], None] | None = None) -> None:
    """Reject, before anything is loaded, a state dict that is not of this optimizer's family
    (``kind``) or whose state tensors do not fit this optimizer's parameters (``kind.states`` of
    the param's shape, and ``check_saved_state(param, saved state, name)`` where given).
    Structural mismatches (group or parameter counts) are left to torch's own checks, which follow."""
    if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict or "state" not in state_dict:
        found = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise ValueError(f"not an optimizer state dict: expected keys 'state' and 'param_groups', found {found}")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    a = "an" if kind.family[0] in "AEIOU" else "a"
    for gi, saved in enumerate(saved_groups):
        missing = [k for k in kind.required if k not in saved]
        foreign = [k for k in kind.foreign if k in saved]
        if missing or foreign:
            keys = sorted(k for k in saved if k != "params")
            what = (f"has no {' or '.join(map(repr, missing))}" if missing
                    else f"has {' and '.join(map(repr, foreign))}")
            raise ValueError(f"not {a} {kind.family} state dict: param_groups[{gi}] {what} (its hyperparameters "
                             f"are {keys}); expected one saved by {a} {kind.family} optimizer")
        if saved.get("amsgrad"):
            raise ValueError(f"param_groups[{gi}] of the state dict has amsgrad=True, which mps_fused_adam does not "
                             "implement (use torch.optim.Adam/AdamW with amsgrad)")
    if len(saved_groups) != len(param_groups):
        return
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            return
        names = group.get("param_names")
        for pi, (key, p) in enumerate(zip(saved["params"], group["params"])):
            st = saved_state.get(key)
            if not st:
                continue
            name = names[pi] if names else f"param_groups[{gi}]['params'][{pi}]"
            if not all(isinstance(st.get(k), torch.Tensor) for k in kind.states):
                raise ValueError(f"not {a} {kind.family} state dict: the state of {describe(p, name)} has keys "
                                 f"{sorted(st)}; expected tensors {' and '.join(map(repr, kind.states))}")
            for k in kind.states:
                if st[k].shape != p.shape:
                    raise ValueError(f"{describe(p, name)}: the state dict's '{k}' has shape {tuple(st[k].shape)}; "
                                     f"expected {tuple(p.shape)}")
            if "step" in st:
                check_saved_step(p, st["step"], name)
            elif kind.has_steps:
                # torch raises KeyError: 'step' at the next step; loading it as step 0 would restart
                # the bias correction on moments that are far from 0.
                old = " (its group has 'step': an older DeepSpeed FusedAdam checkpoint; set each param's 'step' " \
                      "to it)" if "step" in saved else ""
                raise ValueError(f"{describe(p, name)}: the state dict's state has {sorted(map(str, st))} but no "
                                 f"'step'; expected the number of steps its moments were made over{old}")
            if check_saved_state is not None:
                check_saved_state(p, st, name)
