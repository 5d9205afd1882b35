"""The numeric contract's host side, version 2 (docs/numerics.md), and the list of update rules.

Two rules bind every implementation (C++ CPU kernel on every SIMD path, Metal kernel, Python
reference, foreach tier, DeepSpeed facades):

- **Host scalars**: whatever depends only on the hyperparameters and the step is computed once
  per call, on the host, in double, and rounded once to fp32 (:func:`adam_scalars`).
- **Element math**: fp32, every multiply and add rounded separately (no FMA), correctly rounded
  square root and division, at most one of each per element, in the order of the rule's
  reference function (``reference.py``). That order, not any formula, makes the
  implementations agree bit for bit.

Adam (v2), host::

    bc1 = 1 - beta1**step, bc2 = 1 - beta2**step       (both 1 without bias correction)
    step_size = lr / bc1          d2 = 1 / sqrt(bc2)
    decay = 1 - lr * wd           (AdamW mode; 1 in L2 mode)
    omb1 = 1 - beta1, omb2 = 1 - beta2; beta1, beta2, eps, wd as given
    L2 mode with wd == 0 adds no term (as torch.optim.Adam and DeepSpeed skip it: 0 * inf is
    NaN): the host hands the kernels the decoupled form with decay 1, and p * 1 is p, bit for bit.

The element math is stated once, in ``reference.adam_elements`` (the 8-bit rule's clamp a parameter of it).

How to add an update rule (Lion, Adagrad, ...): only what must differ between rules, once each.

1. Its numbers, here: a frozen hyperparameter dataclass (``weight_decay`` and ``maximize``
   fields), a ``NamedTuple`` of its fp32 scalars in struct order with the function computing
   them (double, rounded once), an example function ``(step, maximize=False, weight_decay=0.1,
   lr=1e-2) -> hyper``, and its :class:`Rule` in :data:`RULES` (states, struct format, scalars,
   :class:`Example`).
2. Its element math, once per language: ``reference.reference_<rule>_`` (listed in
   ``REFERENCES``; its docstring is the element contract), a functor in ``src/cpu/rules.h``
   (``kStates``, ``Scalars``, ``operator()(F& p, F g, F* s)``), a ``<Rule>Rule`` with an inline
   ``apply`` in ``metal/fused_adam.metal``, and its ``torch._foreach_*`` form
   (``backends.ForeachBackend.RULES``).
3. Its scalar struct in C++ (``src/cpu/adam_types.h``, with its line in ``MFA_RULES``) and
   Metal (``<Rule>Params`` and its ``FUSED_RULES`` line), fields as the ``NamedTuple``
   (tests/test_scalar_layouts.py), and its parity examples (``tests/native/isa_parity.cpp``,
   ``examples(Tag<RuleId::X>)``: without them the NEON/x86 parity run does not compile).
4. Its public class (``optimizers/fused.py``: ``_rule``, the constructor, ``_check_group``,
   ``_hyper``, ``_new_state`` when a state does not start at 0; its name in
   ``__init__._PUBLIC``), its ``validate.check_<rule>_hyperparameters``, and its entry in
   ``tests/optim_db.py`` with the hand-written test against its independent implementation.

A new *state format* (how a rule's states are stored: 8-bit codes, say) is a class of
``optimizers/state_formats.py`` and a rule every backend runs, not a change of the step path.

Everything else follows from :data:`RULES` and the rule's :class:`Example`: the CPU kernel on
every SIMD path, the foreach tier, the Metal kernels (emulated) and Metal tiers 1-3, and the
class through those tiers (tests/test_rules_kernels.py, every rule but Adam, whose deeper tests are
test_cpu_kernel.py and test_metal_emulator.py), the kernel-name and struct-size checks
(test_metal_emulator.py), the self-check (``python -m mps_fused_adam --check``, selfcheck.py) and
its counts (test_cli.py), the scalar layouts (test_scalar_layouts.py), and the benchmarks (bench_mps.py; bench_rules.py for one-state rules).
A forgotten piece of 1-4 fails loudly: tests/test_rules_contract.test_rule_is_registered_everywhere
checks each rule of :data:`RULES` for its reference, foreach form, CPU kernel (``_cpu.rules()``),
Metal instantiations in all five dtype pairs, example, public class, self-check case and
counterpart; tests/test_optim_db.py checks that every public class has its entry. (Still by hand: the counterpart test itself and the class's parity tests.)

The backends take ``(rule name, params, grads, [state lists], hyper)``; the optimizer classes
name their rule.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional


def _f32(x: float) -> float:
    """Round a Python float (double) to the nearest fp32 value, ties to even."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class AdamHyper:
    """Hyperparameters of one Adam step for one list of tensors (one group, one step count)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # the step being taken, 1 for the first update
    adam_w_mode: bool = True
    bias_correction: bool = True
    maximize: bool = False


class AdamScalars(NamedTuple):
    """The fp32 values an Adam kernel sees; order matches the C++ and Metal ``AdamParams`` structs."""

    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    step_size: float  # lr / bc1
    d2: float  # 1 / sqrt(bc2)
    decay: float  # 1 - lr * wd in AdamW mode, 1 in L2 mode
    adam_w_mode: int
    maximize: int



def adam_scalars(hp: AdamHyper) -> AdamScalars:
    """Adam's host scalars: computed in double once per call, each rounded once to fp32.
    (beta**step in fp32 on a device would drift for large step counts.)"""
    if hp.bias_correction:
        bc1 = 1.0 - hp.beta1 ** hp.step
        bc2 = 1.0 - hp.beta2 ** hp.step
        if not (bc1 != 0.0 and bc2 > 0.0):
            # The optimizer classes never get here (their betas lie in [0, 1), steps count from 1);
            # DeepSpeed's ops pass whatever their caller holds, and its kernels then write NaN.
            raise ValueError(f"Adam's bias correction at step {hp.step} with betas ({hp.beta1}, {hp.beta2}): "
                             f"1 - beta1**step = {bc1!r} and 1 - beta2**step = {bc2!r}; the first must be "
                             f"nonzero and the second positive (steps count from 1, betas lie in [0, 1))")
    else:
        bc1 = bc2 = 1.0
    # L2 mode without weight decay: g + 0 * p would turn an infinite param's moments into NaN,
    # so no term is added; p * (decay = 1) leaves p as it is, so the decoupled form says exactly that.
    decoupled = bool(hp.adam_w_mode) or hp.weight_decay == 0
    decay = 1.0 - hp.lr * hp.weight_decay if decoupled else 1.0
    return AdamScalars(
        _f32(hp.beta1), _f32(hp.beta2), _f32(1.0 - hp.beta1), _f32(1.0 - hp.beta2), _f32(hp.eps),
        _f32(hp.weight_decay), _f32(hp.lr / bc1), _f32(1.0 / math.sqrt(bc2)), _f32(decay),
        int(decoupled), int(bool(hp.maximize)),
    )


# --- Lion -------------------------------------------------------------------------------------
# Host, once per call, in double, each result rounded to fp32 once:
#   beta1, beta2, lr;  omb1 = 1 - beta1;  omb2 = 1 - beta2;  decay = 1 - lr * weight_decay
# Element, fp32, every operation rounded separately (no FMA); no sqrt, no division:
#   if maximize: g = -g
#   c = beta1 * m + omb1 * g
#   p = p * decay
#   p = p - lr * sign(c)
#   m = beta2 * m + omb2 * g
# sign(c) is 1 for c > 0, -1 for c < 0, +0 for c = +-0 (so the parameter keeps its bits, as with
# lion_pytorch's torch.sign) and NaN for NaN: a NaN momentum or gradient makes the parameter NaN
# instead of being silently skipped (torch.sign(NaN) is 0). Every implementation writes it as
#   s = c > 0 ? 1 : (c < 0 ? -1 : c - c)
# (c - c is +0 for both zeros and NaN for NaN). lr * s is exact, so the parameter update rounds once.


@dataclass(frozen=True)
class LionHyper:
    """Hyperparameters of one Lion step for one list of tensors (Lion does not use the step count)."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    maximize: bool = False


class LionScalars(NamedTuple):
    """The fp32 values a Lion kernel sees; order matches the C++ and Metal parameter structs."""

    lr: float
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    decay: float
    maximize: int


def lion_scalars(hp: LionHyper) -> LionScalars:
    return LionScalars(
        _f32(hp.lr), _f32(hp.beta1), _f32(hp.beta2), _f32(1.0 - hp.beta1), _f32(1.0 - hp.beta2),
        _f32(1.0 - hp.lr * hp.weight_decay), int(bool(hp.maximize)),
    )


# --- Adagrad (torch.optim.Adagrad's algorithm) ------------------------------------------------
# Host, once per call, in double, each result rounded to fp32 once:
#   clr = lr / (1 + (step - 1) * lr_decay);  eps;  weight_decay;  l2 = (weight_decay != 0)
# Element, fp32, every operation rounded separately; one sqrt, one division:
#   if maximize: g = -g
#   if l2:       g = g + weight_decay * p      (skipped at 0, as torch does: 0 * inf would be NaN)
#   s = s + g * g
#   p = p - clr * (g / (sqrt(s) + eps))
# The quotient g / (sqrt(s) + eps) lies in [-1, 1] (s >= g * g), so clr * quotient can neither
# overflow nor lose precision to underflow, and the first step moves every parameter by about clr.
# (torch's addcdiv computes (clr * g) / denominator; the two orders differ by an ulp at most.)
# The state ``sum`` starts at ``initial_accumulator_value`` (the optimizer's job, not the kernel's).


@dataclass(frozen=True)
class AdagradHyper:
    """Hyperparameters of one Adagrad step for one list of tensors (one group, one step count)."""

    lr: float
    eps: float
    weight_decay: float
    step: int  # the step being taken, 1 for the first update
    lr_decay: float = 0.0
    maximize: bool = False


class AdagradScalars(NamedTuple):
    """The fp32 values an Adagrad kernel sees; order matches the C++ and Metal parameter structs."""

    clr: float
    eps: float
    weight_decay: float
    l2: int
    maximize: int


def adagrad_scalars(hp: AdagradHyper) -> AdagradScalars:
    clr = hp.lr / (1.0 + (hp.step - 1) * hp.lr_decay)
    return AdagradScalars(_f32(clr), _f32(hp.eps), _f32(hp.weight_decay), int(hp.weight_decay != 0),
                          int(bool(hp.maximize)))


# --- Examples: each rule's hyperparameters and inputs for the tests, the self-check, the benchmarks ---
# One function per rule; ``weight_decay`` and ``maximize`` are the switches every rule has, ``lr``
# the benchmarks' knob, ``mode`` a rule's own switches (Adam's ``adam_w_mode``).


def _adam_example(step: int = 1, maximize: bool = False, weight_decay: float = 0.1, lr: float = 1e-2,
                  **mode: Any) -> AdamHyper:
    return AdamHyper(lr, 0.9, 0.999, 1e-8, weight_decay, step, maximize=maximize, **mode)


def _lion_example(step: int = 1, maximize: bool = False, weight_decay: float = 0.1, lr: float = 1e-2) -> LionHyper:
    return LionHyper(lr, 0.9, 0.99, weight_decay, maximize=maximize)


def _adagrad_example(step: int = 1, maximize: bool = False, weight_decay: float = 0.1,
                     lr: float = 1e-2) -> AdagradHyper:
    return AdagradHyper(lr, 1e-10, weight_decay, step, lr_decay=0.01, maximize=maximize)


@dataclass(frozen=True)
class Example:
    """A rule's example: what the tests, the self-check (selfcheck.py) and the benchmarks run it with.

    ``hyper(step, maximize=False, weight_decay=0.1, lr=1e-2, **mode)``: the rule's hyperparameters
    for the step ``step``; ``modes``: the self-check's two modes of each case, as keyword arguments
    of ``hyper`` (by default with and without weight decay); ``nonnegative``: the states that are
    never negative (Adam's ``exp_avg_sq``, Adagrad's ``sum``), which the tests draw from
    ``0.01 * U[0, 1)`` (the others from ``0.1 * N(0, 1)``); ``optimizer``: the public class
    (``mps_fused_adam.<optimizer>``) that runs the rule (the benchmarks time it; the arguments that
    give ``hyper(step)`` are the tests', in tests/optim_db.py).
    """

    hyper: Callable[..., Any]
    optimizer: str
    modes: tuple = field(default=({}, {"weight_decay": 0.0}), compare=False)
    nonnegative: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rule:
    """One update rule: what every backend needs to know about it.

    ``states``: the state tensors' names, in kernel order (also the state dict keys);
    ``hyper``: its hyperparameter dataclass; ``scalars``: hyper -> the fp32 scalar tuple;
    ``struct_format``: :mod:`struct` format of the kernels' scalar struct (little-endian, as on
    every Apple GPU and every CPU we build for); ``example``: its :class:`Example` (every rule of
    :data:`RULES` has one; the variants in lowbit.py, run by their own tests, do not).
    """

    name: str
    states: tuple[str, ...]
    hyper: type
    scalars: Callable[[Any], tuple]
    struct_format: str
    example: Optional[Example] = None

    def pack(self, hp: Any) -> bytes:
        """The rule's scalar struct as the C++ and Metal kernels read it."""
        return struct.pack(self.struct_format, *self.scalars(hp))


RULES: dict[str, Rule] = {
    "adam": Rule("adam", ("exp_avg", "exp_avg_sq"), AdamHyper, adam_scalars, "<9f2I",
                 Example(_adam_example, "AdamW",
                         modes=({"adam_w_mode": True}, {"adam_w_mode": False}), nonnegative=("exp_avg_sq",))),
    # State names are those of the optimizers Lion and Adagrad stand in for (lion_pytorch, torch).
    "lion": Rule("lion", ("exp_avg",), LionHyper, lion_scalars, "<6fI",
                 Example(_lion_example, "Lion")),
    "adagrad": Rule("adagrad", ("sum",), AdagradHyper, adagrad_scalars, "<3f2I",
                    Example(_adagrad_example, "Adagrad", nonnegative=("sum",))),
}


def example(name: str) -> Example:
    """The :class:`Example` of rule ``name`` (a KeyError names the known rules)."""
    ex = rule(name).example
    if ex is None:
        raise KeyError(f"update rule {name!r} has no example (contract.RULES)")
    return ex


def rule(name: str) -> Rule:
    """The rule called ``name``; a KeyError names the known ones."""
    try:
        return RULES[name]
    except KeyError:
        raise KeyError(f"unknown update rule {name!r}; known: {', '.join(RULES)}") from None
