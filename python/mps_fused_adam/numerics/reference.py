"""The numeric contract (version 2, docs/numerics.md) in plain torch: one function per update rule.

This is the independent reference: the tests, the self-check and nothing on the hot path use it.
Every operation is a separate fp32 torch op, in the order the kernels use, so an fp32 kernel that
follows the contract matches it bit for bit; half-precision storage is rounded once per store.
The host scalars come from ``contract.py`` (double, rounded once to fp32).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .contract import AdagradHyper, AdamHyper, LionHyper, adagrad_scalars, adam_scalars, lion_scalars


def _full(like: torch.Tensor, x: float) -> torch.Tensor:
    # A full tensor, not a 0-dim one: torch turns division by a scalar into multiplication by its
    # reciprocal, which rounds differently; a full operand also keeps every op a plain fp32 op.
    return torch.full(like.shape, x, dtype=torch.float32, device=like.device)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    # sqrt through float64: torch's fp32 CPU sqrt is not always correctly rounded, IEEE sqrt (and
    # so every kernel) is; a float64 sqrt rounded to fp32 is exact (53 >= 2 * 24 + 2 bits).
    return torch.sqrt(x.double()).float()


def adam_elements(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: Any,
                  clip: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adam's element math (contract v2), the one statement of it in Python: fp32 tensors and the
    host scalars ``s`` (``contract.adam_scalars``) in, the new (p, m, v) out. ``clip``: the 8-bit
    rule's clamp of the normalized step ``u = m / denom`` to ``[-clip, clip]`` (lowbit.py; NaN
    stays NaN). Every op rounded separately::

        if maximize: g = -g
        if L2 mode:  g = g + wd * p     (not when wd == 0: adam_scalars then passes AdamW
                                         mode with decay 1, as torch skips the term)
        m = beta1 * m + omb1 * g
        v = beta2 * v + omb2 * (g * g)
        denom = sqrt(v) * d2 + eps
        u = m / denom
        (8-bit rule) u = clip if u > clip; u = -clip if u < -clip
        if AdamW mode: p = p * decay
        p = p - step_size * u
    """
    if s.maximize:
        g = -g
    if not s.adam_w_mode:
        g = g + _full(p, s.weight_decay) * p
    m = _full(p, s.beta1) * m + _full(p, s.one_minus_beta1) * g
    v = _full(p, s.beta2) * v + _full(p, s.one_minus_beta2) * (g * g)
    u = m / (_sqrt(v) * _full(p, s.d2) + _full(p, s.eps))
    if clip is not None:
        c = _full(p, clip)
        u = torch.where(u > c, c, u)
        u = torch.where(u < -c, -c, u)
    if s.adam_w_mode:
        p = p * _full(p, s.decay)
    p = p - _full(p, s.step_size) * u
    return p, m, v


def reference_adam_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, hp: AdamHyper) -> None:
    """Apply one Adam step in place (:func:`adam_elements`, scalars from ``contract.adam_scalars``),
    math in fp32, results rounded to each tensor's own dtype."""
    p, m, v = adam_elements(param.detach().float(), grad.detach().float(), exp_avg.float(), exp_avg_sq.float(),
                            adam_scalars(hp))
    with torch.no_grad():
        param.copy_(p)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)


def lion_sign(c: torch.Tensor) -> torch.Tensor:
    """The contract's sign: 1, -1, +0 for both zeros, NaN for NaN (torch.sign gives 0 for NaN)."""
    one = torch.ones_like(c)
    return torch.where(c > 0, one, torch.where(c < 0, -one, c - c))


def reference_lion_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, hp: LionHyper) -> None:
    """Apply one Lion step (contract.py) in place, math in fp32, results rounded to each tensor's dtype."""
    s = lion_scalars(hp)
    p = param.detach().float()
    g = grad.detach().float()
    m = exp_avg.float()
    if s.maximize:
        g = -g
    c = _full(p, s.beta1) * m + _full(p, s.one_minus_beta1) * g
    p = p * _full(p, s.decay)
    p = p - _full(p, s.lr) * lion_sign(c)
    m = _full(p, s.beta2) * m + _full(p, s.one_minus_beta2) * g
    with torch.no_grad():
        param.copy_(p)
        exp_avg.copy_(m)


def reference_adagrad_(param: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, hp: AdagradHyper) -> None:
    """Apply one Adagrad step (contract.py) in place, math in fp32, results rounded to each tensor's dtype."""
    s = adagrad_scalars(hp)
    p = param.detach().float()
    g = grad.detach().float()
    acc = state_sum.float()
    if s.maximize:
        g = -g
    if s.l2:
        g = g + _full(p, s.weight_decay) * p
    acc = acc + g * g
    denom = _sqrt(acc) + _full(p, s.eps)
    p = p - _full(p, s.clr) * (g / denom)
    with torch.no_grad():
        param.copy_(p)
        state_sum.copy_(acc)


# One reference per rule of contract.RULES: (param, grad, states, hyper) -> None, in place.
REFERENCES: dict[str, Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor], Any], None]] = {
    "adam": lambda p, g, states, hp: reference_adam_(p, g, *states, hp),
    "lion": lambda p, g, states, hp: reference_lion_(p, g, *states, hp),
    "adagrad": lambda p, g, states, hp: reference_adagrad_(p, g, *states, hp),
}


def reference_step_(rule: str, param: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor],
                    hp: Any) -> None:
    """One step of update rule ``rule`` on one tensor, in place."""
    REFERENCES[rule](param, grad, states, hp)
