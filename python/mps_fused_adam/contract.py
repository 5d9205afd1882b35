"""The numeric contract's host side: one group's hyperparameters and the fp32 scalars every kernel receives.

All implementations (C++ CPU kernel, Metal kernel, Python reference, foreach tier) take their
scalars from :func:`kernel_scalars`, so they agree on every rounding of the hyperparameters.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple


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


class KernelScalars(NamedTuple):
    """The fp32 values a kernel sees; order matches the C++ and Metal parameter structs."""

    lr: float
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    bc1: float
    bc2: float
    adam_w_mode: int
    maximize: int


def kernel_scalars(hp: AdamHyper) -> KernelScalars:
    # Bias corrections in double on the host, once per group and step (DESIGN.md section 2):
    # computing beta**step in fp32 on the device would drift for large step counts.
    if hp.bias_correction:
        bc1 = 1.0 - hp.beta1 ** hp.step
        bc2 = 1.0 - hp.beta2 ** hp.step
    else:
        bc1 = bc2 = 1.0
    return KernelScalars(
        _f32(hp.lr), _f32(hp.beta1), _f32(hp.beta2), _f32(1.0 - hp.beta1), _f32(1.0 - hp.beta2),
        _f32(hp.eps), _f32(hp.weight_decay), _f32(bc1), _f32(bc2),
        int(bool(hp.adam_w_mode)), int(bool(hp.maximize)),
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
