"""fp32 inputs for the 8-bit nearest-code search's exhaustive-ish tests: every midpoint of a map and
its fp32 neighbours, both signs, and the special classes (zeros, subnormals, the normal range's
ends, infinities, NaNs of both signs and several payloads), plus values over nine decades."""
from __future__ import annotations

import torch

from mps_fused_adam.numerics import lowbit

NEIGHBOURS = 4  # fp32 steps each way around every midpoint


def _from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)


def near_midpoints(signed: bool) -> torch.Tensor:
    """Every midpoint +-k ulps (k <= NEIGHBOURS) with both signs, the code values, the specials."""
    mids = lowbit.code_midpoints(signed)
    both = torch.cat([mids, -mids])
    cols = [both]
    up = down = both
    for _ in range(NEIGHBOURS):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        cols += [up, down]
    values = lowbit.dynamic_map(signed)
    specials = _from_bits([
        0x00000000, 0x80000000,  # zeros
        0x00000001, 0x80000001, 0x00000002, 0x007FFFFF, 0x807FFFFF,  # subnormals
        0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF,  # the normal range's ends
        0x3F800000, 0x3F800001, 0x3F7FFFFF, 0xBF800000, 0xBF800001, 0x40000000, 0xC0000000,  # around 1
        0x7F800000, 0xFF800000,  # infinities
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000,  # NaNs
    ])
    gen = torch.Generator().manual_seed(36)
    spread = torch.rand(20000, generator=gen) * 10.0 ** (-9 * torch.rand(20000, generator=gen))
    spread = spread * torch.where(torch.rand(20000, generator=gen) < 0.5, -1.0, 1.0)
    return torch.cat(cols + [values, -values, specials, spread]).contiguous()


def midpoint_count(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """The contract's search without the floor: midpoints strictly below x, NaN -> 0 (int64)."""
    codes = torch.searchsorted(lowbit.code_midpoints(signed), x, right=False)
    return torch.where(torch.isnan(x), torch.zeros_like(codes), codes)
