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
3. Its scalar structs, C++ ``<Rule>Scalars`` and Metal ``<Rule>Params``, written from the
   ``NamedTuple``: one line in ``ci/scalar_structs.py``'s ``STRUCTS``, then ``python
   ci/scalar_structs.py`` (tests/test_scalar_layouts.py fails on a stale or a wrong struct); its
   lines in ``MFA_RULES`` (``src/cpu/adam_types.h``) and ``FUSED_RULES`` (the .metal file); and its parity examples (``tests/support/native/isa_parity.cpp``,
   ``examples(Tag<RuleId::X>)``: without them the NEON/x86 parity run does not compile).
4. Its public class (``optimizers/fused.py``: ``_rule``, the constructor, ``_check_group``,
   ``_hyper``, ``_new_state`` when a state does not start at 0; its name in
   ``__init__._PUBLIC``), its ``validate.check_<rule>_hyperparameters``, and its entry in
   ``tests/optim_db.py`` with the hand-written test against its independent implementation.

A new *state format* (how a rule's states are stored: 8-bit codes, say) is a class of
``optimizers/state_formats.py`` and a rule every backend runs, not a change of the step path.

How to add a block-quantized form of Adam (like ``adam8bit``; ``adam4bit``): the backends,
the self-check and the benchmarks read it from its entry alone, with no branch of their own.

a. Its entry in :data:`RULES`, beside ``"adam8bit"``: ``Rule(name, <Metal buffers: the states in
   kernel order, then the tables>, Adam8bitTensorHyper, adam8bit_tensor_scalars, "<10f4I",
   base="adam", sr_rule=name, state_dtypes=("uint8",), reference="reference_lowbit:<fn>",
   blocks=Blocks(<state names in the backends' order>, "<cpu entry>", "lowbit:<tables fn>",
   "lowbit:<new states fn>"))``. Its Metal kernels are then ``fused_<name>_{float,half,bfloat}_uchar``.
b. Its math: the reference ``(param, grad, *states, AdamHyper, sr_key)`` in ``reference_lowbit.py``
   (calling ``reference.adam_elements`` with the clamp), the tables ``(device) -> (t1, t2)`` and
   the fresh states ``(shape, device) -> [tensors]`` in ``lowbit.py``.
c. Its kernels: the ``_cpu`` entry with ``adam8bit_step_many``'s arguments (``src/cpu/``, calling
   ``AdamRule``), and the Metal kernels with ``Adam8bitRule``'s buffers and struct (calling
   ``AdamRule::apply``), instantiated for the three param dtypes; a scalar struct of its own (if
   its scalars differ from the 8-bit ones) is a line of ``ci/scalar_structs.py``'s ``STRUCTS``.
d. Its state format (``optimizers/state_formats.py``: ``rule``/``sr_rule`` the entry's name,
   ``names`` its ``Blocks.names``) and the class or option that picks it; its tests against its
   reference (the test harnesses' own low-bit cases: tests/support/metal_harness.py, test_scalar_layouts'
   ``TUPLE_FIELDS``).

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

import importlib
import math
import struct
from dataclasses import dataclass, field
from functools import lru_cache
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
    step_size: float  # lr / bc1, bc1 = 1 - beta1^step (1 without bias correction)
    d2: float  # 1 / sqrt(bc2), bc2 = 1 - beta2^step (1 without bias correction)
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
    decay: float  # 1 - lr * weight_decay
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

    clr: float  # lr / (1 + (step - 1) * lr_decay)
    eps: float
    weight_decay: float
    l2: int  # weight_decay != 0
    maximize: int


def adagrad_scalars(hp: AdagradHyper) -> AdagradScalars:
    clr = hp.lr / (1.0 + (hp.step - 1) * hp.lr_decay)
    return AdagradScalars(_f32(clr), _f32(hp.eps), _f32(hp.weight_decay), int(hp.weight_decay != 0),
                          int(bool(hp.maximize)))


# --- The low-bit forms of Adam (lowbit.py: their contract; reference_lowbit.py: their math) ------
# Host scalars of the 8-bit rule and of Adam storing bf16 params by stochastic rounding, torch-free
# like the rest of this module so that their RULES entries stand beside the others.

_M32 = 0xFFFFFFFF
# The clamp sits this factor above the exact bound, so fp32 rounding of exact Adam (a few ulps)
# never reaches it.
CLIP_MARGIN = 1.0 + 2.0 ** -12


def _f32_up(x: float) -> float:
    """The smallest fp32 value >= x (x finite and positive)."""
    r = _f32(x)
    if r < x:
        bits = struct.unpack("<I", struct.pack("<f", r))[0]
        r = struct.unpack("<f", struct.pack("<I", bits + 1))[0]
    return r


class Adam8bitScalars(NamedTuple):
    """Contract v2's Adam scalars (``contract.AdamScalars``, same order) plus the 8-bit rule's
    clamp, all fp32; the kernels' ``Adam8bitParams`` struct in this order (10 floats, 2 uints)."""

    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    step_size: float  # lr / bc1
    d2: float  # 1 / sqrt(bc2)
    decay: float  # 1 - lr * wd in AdamW mode, 1 in L2 mode
    clip: float  # bound of |m / denom| (normalized_step_bound, rounded up)
    adam_w_mode: int
    maximize: int


def normalized_step_bound(beta1: float, beta2: float, step: int, bias_correction: bool) -> float:
    """The largest ``|m| * sqrt(bc2) / sqrt(v)`` exact Adam can reach at ``step`` (Cauchy-Schwarz
    over the gradient history), in double."""
    r = beta1 * beta1 / beta2 if beta2 > 0 else math.inf
    if beta1 == 0.0:
        s = 1.0
    elif r == 1.0:
        s = float(step)
    elif math.isinf(r):  # beta2 == 0 and beta1 > 0: v is the last g^2 alone, m is unbounded by it
        return math.inf
    else:
        # (1 - r^t) / (1 - r), written to stay finite for r > 1 and accurate for r near 1; past
        # double's range (r > 1 at a large step: betas (0.9, 0.8) from step 57,140) no bound.
        try:
            s = math.expm1(step * math.log(r)) / (r - 1.0) if r > 0 else 1.0
        except OverflowError:
            return math.inf
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    return (1.0 - beta1) * math.sqrt(bc2 * s / (1.0 - beta2))


def adam8bit_scalars(hp: AdamHyper) -> Adam8bitScalars:
    """The fp32 scalars of one 8-bit Adam call for :class:`~.contract.AdamHyper` ``hp``:
    ``contract.adam_scalars(hp)`` with the clamp inserted after ``decay``."""
    a = adam_scalars(hp)
    bound = normalized_step_bound(hp.beta1, hp.beta2, hp.step, hp.bias_correction) * CLIP_MARGIN
    clip = math.inf if bound > 3.4e38 else _f32_up(bound)
    return Adam8bitScalars(*a[:9], clip, *a[9:])


ADAM8BIT_STRUCT = "<10f2I"  # the kernels' Adam8bitScalars: 48 bytes, little-endian


def pack_adam8bit(hp: AdamHyper) -> bytes:
    """:func:`adam8bit_scalars` as the C++ and Metal kernels read them."""
    return struct.pack(ADAM8BIT_STRUCT, *adam8bit_scalars(hp))


@dataclass(frozen=True)
class AdamSRHyper:
    """One Adam step of one tensor whose bf16 parameter is stored by stochastic rounding: the
    Adam hyperparameters and the tensor's :func:`lowbit.sr_key` for this step."""

    adam: AdamHyper
    sr_key: int


def adam_sr_scalars(hp: AdamSRHyper) -> tuple:
    """Adam's host scalars (contract v2), then the 32-bit key."""
    return (*adam_scalars(hp.adam), hp.sr_key & _M32)


@dataclass(frozen=True)
class Adam8bitTensorHyper:
    """One 8-bit Adam step of one tensor on the Metal kernels: the Adam hyperparameters and, for
    a bf16 param stored by stochastic rounding, its :func:`lowbit.sr_key` for this step (else None)."""

    adam: AdamHyper
    sr_key: int | None = None


def adam8bit_tensor_scalars(hp: Adam8bitTensorHyper) -> tuple:
    """:func:`adam8bit_scalars`, then the stochastic-rounding switch and key."""
    key = hp.sr_key
    return (*adam8bit_scalars(hp.adam), int(key is not None), 0 if key is None else key & _M32)


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
class Blocks:
    """How a block-quantized form of Adam (8-bit; 4-bit) stores its moments: what the backends
    need beyond its :class:`Rule`. Such rules share the rest: the CPU entry's arguments (those of
    ``_cpu.adam8bit_step_many``), the host scalars (:func:`adam8bit_scalars`), the per-tensor Metal
    call (``Rule.hyper(adam_hyper, sr_key)``) and its buffers (``Rule.states``: these states by name,
    then the tables).

    ``names``: the states in the backends' order (``Backend.update``'s state lists, the state
    dict's keys); ``cpu_entry``: the ``_cpu`` function; ``tables``: ``"module:function"`` under
    ``mps_fused_adam.numerics`` (:func:`resolve`), ``(device) -> (table, table)``, the read-only
    tables the kernels take after the states; ``new_states``: ``"module:function"``, ``(shape,
    device) -> [tensor per name]``, a param's fresh states (the optimizers' format, the probes,
    the self-check, the benchmarks)."""

    names: tuple[str, ...]
    cpu_entry: str
    tables: str
    new_states: str
    host_scalars: Callable[[Any], tuple] = adam8bit_scalars
    host_struct: str = ADAM8BIT_STRUCT


@dataclass(frozen=True)
class Rule:
    """One update rule: what every backend needs to know about it.

    ``states``: the state tensors' names, in kernel order (also the state dict keys; a
    block-quantized rule's Metal buffers);
    ``hyper``: its hyperparameter dataclass; ``scalars``: hyper -> the fp32 scalar tuple;
    ``struct_format``: :mod:`struct` format of the kernels' scalar struct (little-endian, as on
    every Apple GPU and every CPU we build for); ``example``: its :class:`Example` (every rule
    with its own element math has one, the storage forms of Adam do not).

    The storage forms of another rule (``base``: Adam's stochastic rounding, 8-bit states) run
    one tensor a kernel call: ``hyper`` is then ``(base's hyper, sr_key)`` (``AdamSRHyper``,
    ``Adam8bitTensorHyper``), the backends take them with ``base``'s hyperparameters and one key
    per param (``backends``' docstring), and ``reference`` (``"module:function"``, :func:`resolve`)
    is their math one tensor at a time, ``(param, grad, *states, base hyper, sr_key)``, which the
    foreach tier runs. ``sr_rule``: the rule that stores this one's bf16 params by stochastic
    rounding (itself where that is a switch of its kernel). ``param_dtypes``/``state_dtypes``:
    torch dtype names the kernels take (None: fp32, fp16, bf16 params; fp32 or the param's dtype
    for the states). ``blocks``: a block-quantized rule's :class:`Blocks`. ``run()`` names how
    the CPU runs it.
    """

    name: str
    states: tuple[str, ...]
    hyper: type
    scalars: Callable[[Any], tuple]
    struct_format: str
    example: Optional[Example] = None
    base: Optional[str] = None
    sr_rule: Optional[str] = None
    param_dtypes: Optional[tuple[str, ...]] = None
    state_dtypes: Optional[tuple[str, ...]] = None
    reference: Optional[str] = None
    blocks: Optional[Blocks] = None

    def pack(self, hp: Any) -> bytes:
        """The rule's scalar struct as the Metal kernels (and the C++ kernels of rules without
        ``blocks``) read it."""
        return struct.pack(self.struct_format, *self.scalars(hp))

    def host_pack(self, hp: Any) -> bytes:
        """The scalar struct the CPU kernel reads: a block-quantized rule's ``Blocks.host_scalars``
        of its ``base`` hyperparameters (the key travels beside it), else :meth:`pack`."""
        b = self.blocks
        return self.pack(hp) if b is None else struct.pack(b.host_struct, *b.host_scalars(hp))


_ADAM_STATES = ("exp_avg", "exp_avg_sq")
_BLOCKS_8BIT = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")
_BLOCKS_4BIT = ("exp_avg_codes4", "exp_avg_absmax4", "exp_avg_sq_codes4", "exp_avg_sq_absmax4")

# Every rule the backends run (CPU, Metal, foreach): each registered once, here.
RULES: dict[str, Rule] = {
    "adam": Rule("adam", _ADAM_STATES, AdamHyper, adam_scalars, "<9f2I",
                 Example(_adam_example, "AdamW",
                         modes=({"adam_w_mode": True}, {"adam_w_mode": False}), nonnegative=("exp_avg_sq",)),
                 sr_rule="adam_sr"),
    # State names are those of the optimizers Lion and Adagrad stand in for (lion_pytorch, torch).
    "lion": Rule("lion", ("exp_avg",), LionHyper, lion_scalars, "<6fI",
                 Example(_lion_example, "Lion")),
    "adagrad": Rule("adagrad", ("sum",), AdagradHyper, adagrad_scalars, "<3f2I",
                    Example(_adagrad_example, "Adagrad", nonnegative=("sum",))),
    # Adam storing a bf16 param by stochastic rounding: Adam's states and struct plus the key
    # (Metal: fused_adam_sr_bfloat_*; the CPU runs Adam's kernel with the keys).
    "adam_sr": Rule("adam_sr", _ADAM_STATES, AdamSRHyper, adam_sr_scalars, "<9f3I", base="adam",
                    sr_rule="adam_sr", param_dtypes=("bfloat16",), reference="reference_lowbit:reference_adam_sr_"),
    # 8-bit block-wise moments (lowbit.py). Metal buffers param, grad, then these six (codes and
    # block scales of both moments, then the two lowbit.kernel_table maps).
    "adam8bit": Rule("adam8bit", ("exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax",
                                  "map1", "map2"), Adam8bitTensorHyper, adam8bit_tensor_scalars, "<10f4I",
                     base="adam", sr_rule="adam8bit", state_dtypes=("uint8",),
                     reference="reference_lowbit:reference_adam8bit_",
                     blocks=Blocks(_BLOCKS_8BIT, "adam8bit_step_many", "lowbit:adam8bit_tables",
                                   "lowbit:new_adam8bit_states")),
    # 4-bit block-wise moments (lowbit4.py): the 8-bit rule's buffers, struct and CPU arguments,
    # its codes packed two a byte (1-D), blocks of 128 and the 4-bit maps (lowbit4.kernel_table4).
    "adam4bit": Rule("adam4bit", ("exp_avg_codes4", "exp_avg_sq_codes4", "exp_avg_absmax4", "exp_avg_sq_absmax4",
                                  "map1", "map2"), Adam8bitTensorHyper, adam8bit_tensor_scalars, "<10f4I",
                     base="adam", sr_rule="adam4bit", state_dtypes=("uint8",),
                     reference="reference_lowbit:reference_adam4bit_",
                     blocks=Blocks(_BLOCKS_4BIT, "adam4bit_step_many", "lowbit4:adam4bit_tables",
                                   "lowbit4:new_adam4bit_states")),
}


def element_rules() -> list[str]:
    """The rules with their own element math (each with its :class:`Example`, public class, C++
    functor and Metal ``<Rule>Rule``), in :data:`RULES` order: every rule but the storage forms."""
    return [name for name, r in RULES.items() if r.base is None]


@lru_cache(maxsize=None)
def resolve(ref: str) -> Any:
    """``"module:attribute"`` of a :class:`Rule` or :class:`Blocks` entry, under this package
    (``mps_fused_adam.numerics``), imported on first use (the entries stay torch-free)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), attr)


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
