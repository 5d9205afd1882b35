"""The numeric contract's host side, version 2 (DESIGN.md section 2), and the list of update rules.

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

element::

    if maximize: g = -g
    if L2 mode:  g = g + wd * p
    m = beta1 * m + omb1 * g
    v = beta2 * v + omb2 * (g * g)
    denom = sqrt(v) * d2 + eps
    if AdamW mode: p = p * decay
    p = p - step_size * (m / denom)

How to add an update rule (Lion, Adagrad, ...): a local change in five places, each one entry.

1. Here: a frozen hyperparameter dataclass, a ``NamedTuple`` of the fp32 scalars in the order of
   the kernels' struct, a function computing them (double on the host, rounded once) and a
   :class:`Rule` entry in :data:`RULES` (its state names, its struct format, that function).
2. ``reference.py``: ``reference_<rule>_`` in plain separate fp32 torch ops, listed in
   ``REFERENCES``; the docstring above it is the rule's element contract.
3. ``src/cpu/rules.h``: a functor with ``kStates``, its ``Scalars`` struct and
   ``operator()(F& p, F g, F* s)``, added to ``MFA_RULES`` (the span loop, the thread pool and
   the tables are generic: every ISA x dtype pair is instantiated from that list).
4. ``metal/fused_adam.metal``: a ``struct <Rule>Rule`` with ``kStates``, ``Params`` and an
   inline ``apply``, and its lines in the instantiation lists (host names ``fused_<rule>_<P>_<S>``).
   The ``.mm`` and the tests' emulator take kernel names and buffers, nothing rule-specific.
5. ``backends.ForeachBackend``: the rule's foreach form (or leave it to the reference-checked
   kernels and let the foreach tier raise for it).

The backends take ``(rule name, params, grads, [state lists], hyper)``; the optimizer classes
name their rule. The tests loop over :data:`RULES`, so a new rule is checked everywhere at once.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple


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


# The name the rest of the package has used for Adam's scalars.
KernelScalars = AdamScalars


def adam_scalars(hp: AdamHyper) -> AdamScalars:
    """Adam's host scalars: computed in double once per call, each rounded once to fp32.
    (beta**step in fp32 on a device would drift for large step counts.)"""
    if hp.bias_correction:
        bc1 = 1.0 - hp.beta1 ** hp.step
        bc2 = 1.0 - hp.beta2 ** hp.step
    else:
        bc1 = bc2 = 1.0
    decay = 1.0 - hp.lr * hp.weight_decay if hp.adam_w_mode else 1.0
    return AdamScalars(
        _f32(hp.beta1), _f32(hp.beta2), _f32(1.0 - hp.beta1), _f32(1.0 - hp.beta2), _f32(hp.eps),
        _f32(hp.weight_decay), _f32(hp.lr / bc1), _f32(1.0 / math.sqrt(bc2)), _f32(decay),
        int(bool(hp.adam_w_mode)), int(bool(hp.maximize)),
    )


kernel_scalars = adam_scalars


@dataclass(frozen=True)
class Rule:
    """One update rule: what every backend needs to know about it.

    ``states``: the state tensors' names, in kernel order (also the state dict keys);
    ``hyper``: its hyperparameter dataclass; ``scalars``: hyper -> the fp32 scalar tuple;
    ``struct_format``: :mod:`struct` format of the kernels' scalar struct (little-endian, as on
    every Apple GPU and every CPU we build for).
    """

    name: str
    states: tuple[str, ...]
    hyper: type
    scalars: Callable[[Any], tuple]
    struct_format: str

    def pack(self, hp: Any) -> bytes:
        """The rule's scalar struct as the C++ and Metal kernels read it."""
        return struct.pack(self.struct_format, *self.scalars(hp))


RULES: dict[str, Rule] = {
    "adam": Rule("adam", ("exp_avg", "exp_avg_sq"), AdamHyper, adam_scalars, "<9f2I"),
}


def rule(name: str) -> Rule:
    """The rule called ``name``; a KeyError names the known ones."""
    try:
        return RULES[name]
    except KeyError:
        raise KeyError(f"unknown update rule {name!r}; known: {', '.join(RULES)}") from None
