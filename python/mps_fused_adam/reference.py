"""The numeric contract of DESIGN.md section 2 in plain torch, one tensor at a time.

This is the independent reference: the tests, the self-check and nothing on the hot path use it.
Every operation is a separate fp32 torch op, in the order the kernels use, so an fp32 kernel that
follows the contract matches it bit for bit; half-precision storage is rounded once per store.
"""
from __future__ import annotations

import torch

from .contract import AdamHyper, kernel_scalars


def reference_adam_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, hp: AdamHyper) -> None:
    """Apply one Adam step in place, math in fp32, results rounded to each tensor's own dtype."""
    s = kernel_scalars(hp)

    def f32(x: float) -> torch.Tensor:
        # A full tensor, not a 0-dim one: torch turns division by a scalar into multiplication
        # by its reciprocal, which rounds differently from the contract's division.
        return torch.full(param.shape, x, dtype=torch.float32, device=param.device)

    p = param.detach().float()
    g = grad.detach().float()
    m = exp_avg.float()
    v = exp_avg_sq.float()
    if s.maximize:
        g = -g
    if not s.adam_w_mode:
        g = g + f32(s.weight_decay) * p
    m = f32(s.beta1) * m + f32(s.one_minus_beta1) * g
    v = f32(s.beta2) * v + f32(s.one_minus_beta2) * g * g
    # sqrt through float64: torch's fp32 CPU sqrt is not always correctly rounded, IEEE sqrt (and
    # so every kernel) is; a float64 sqrt rounded to fp32 is exact (53 >= 2 * 24 + 2 bits).
    denom = torch.sqrt((v / f32(s.bc2)).double()).float() + f32(s.eps)
    update = (m / f32(s.bc1)) / denom
    if s.adam_w_mode:
        update = update + f32(s.weight_decay) * p
    p = p - f32(s.lr) * update
    with torch.no_grad():
        param.copy_(p)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
