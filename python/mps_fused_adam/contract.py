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
