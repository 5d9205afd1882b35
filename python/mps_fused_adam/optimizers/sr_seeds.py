"""Each parameter's stochastic-rounding seed, independent of the order in which params are stepped.

A seed is a hash of one 64-bit base seed per optimizer (drawn from torch's RNG when the optimizer
first needs a seed, so ``torch.manual_seed`` makes runs reproducible) and the param's place in the
param groups. A grouped step and hooks that step one param at a time during backward
(``step_in_backward=True``, in backward's order) thus give each param the same seed, and the same
random bits. (Drawn when first needed: the plain step draws it after backward, the hooks during
it; the two agree unless backward itself draws from torch's RNG.)
"""
from __future__ import annotations

import torch

from ..numerics.lowbit import new_sr_seed

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit words that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def _position(opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple[int, int]:
    cache = opt.__dict__.setdefault("_sr_positions", {})
    where = cache.get(id(p))
    groups = opt.param_groups
    if where is not None:
        gi, pi = where
        if gi < len(groups) and pi < len(groups[gi]["params"]) and groups[gi]["params"][pi] is p:
            return where
    cache.clear()
    for gi, group in enumerate(groups):
        for pi, q in enumerate(group["params"]):
            cache[id(q)] = (gi, pi)
    where = cache.get(id(p))
    if where is None:
        raise ValueError(f"a param of shape {tuple(p.shape)} is not in this optimizer's param_groups")
    return where


def param_seed(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
    """The 64-bit stochastic-rounding seed of ``p`` (a param of ``opt``) for its new state."""
    base = opt.__dict__.get("_sr_base_seed")
    if base is None:
        base = opt.__dict__["_sr_base_seed"] = new_sr_seed()
    gi, pi = _position(opt, p)
    return _mix64(base ^ _mix64(((gi & 0xFFFFFFFF) << 32) | (pi & 0xFFFFFFFF)))
