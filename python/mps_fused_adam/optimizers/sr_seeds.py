"""Each parameter's stochastic-rounding seed, independent of the order in which params are stepped.

A seed is a hash of one 64-bit base seed per optimizer (drawn from torch's RNG when the optimizer
first needs a seed, so ``torch.manual_seed`` makes runs reproducible) and the param's place in the
param groups. A grouped step and hooks that step one param at a time during backward
(``step_in_backward=True``, in backward's order) thus give each param the same seed, and the same
random bits. (Drawn when first needed: the plain step draws it after backward, the hooks during
it; the two agree unless backward itself draws from torch's RNG.) The base seed is not a key of the
state dict: a load recovers it from a loaded seed and that param's place (the hash is a bijection),
so a param first stepped after a resume gets the seed it would have got without the interruption.
"""
from __future__ import annotations

import torch

from ..numerics.lowbit import new_sr_seed

_M64 = (1 << 64) - 1
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's multipliers
_C1_INV, _C2_INV = pow(_C1, -1, 1 << 64), pow(_C2, -1, 1 << 64)


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit words that spreads every input bit."""
    x = (x ^ (x >> 30)) * _C1 & _M64
    x = (x ^ (x >> 27)) * _C2 & _M64
    return x ^ (x >> 31)


def _unmix64(y: int) -> int:
    """The inverse of :func:`_mix64` (each xor-shift and odd multiply undone in reverse order)."""
    y = y ^ (y >> 31) ^ (y >> 62)
    y = y * _C2_INV & _M64
    y = y ^ (y >> 27) ^ (y >> 54)
    y = y * _C1_INV & _M64
    return y ^ (y >> 30) ^ (y >> 60)


def _place_hash(gi: int, pi: int) -> int:
    return _mix64(((gi & 0xFFFFFFFF) << 32) | (pi & 0xFFFFFFFF))


def recover_base_seed(opt: torch.optim.Optimizer, seed_key: str) -> None:
    """After a load: the base seed that gave the first loaded ``seed_key`` state of ``opt`` (in
    param-group order) its value, so that params without a seed yet draw theirs as in the run that
    saved the state dict. Nothing changes where no state holds a seed."""
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            seed = opt.state.get(p, {}).get(seed_key)
            if type(seed) is int:
                opt.__dict__["_sr_base_seed"] = _unmix64(seed & _M64) ^ _place_hash(gi, pi)
                return


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
    return _mix64(base ^ _place_hash(gi, pi))
