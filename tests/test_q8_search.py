"""The CPU 8-bit kernel's nearest-code search (src/cpu/q8_search.h and each SIMD path's
quantize in adam8bit_kernel.h) against the reference (reference_lowbit.quantize, a searchsorted
over the midpoints), on every fp32 near every midpoint of both maps and on the special classes
(tests/support/q8_cases.py); the Metal source's search is held to the same cases in test_metal_emulator.py."""
from __future__ import annotations

import pytest
import torch

from mps_fused_adam import _cpu
from mps_fused_adam.numerics import lowbit
from mps_fused_adam.numerics.reference_lowbit import quantize
from q8_cases import midpoint_count, near_midpoints


def kernel_codes(x: torch.Tensor, signed: bool, positive_floor: bool) -> torch.Tensor:
    table = lowbit.kernel_table(signed)
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _cpu.q8_quantize(x.data_ptr(), x.numel(), table.data_ptr(), positive_floor, out.data_ptr())
    return out


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_search_matches_reference_near_every_midpoint(simd, signed):
    x = near_midpoints(signed)
    # Blocks of scale 1: the reference's x * (1 / 1) is x itself, NaN, inf and -0 included.
    want = quantize(x, torch.ones(lowbit.num_blocks(x.numel())), signed)
    got = kernel_codes(x, signed, positive_floor=not signed)  # the step's own use of each map
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(x[i]), hex(int(x[i:i + 1].view(torch.int32)) & 0xFFFFFFFF), int(want[i]),
                               int(got[i])) for i in bad[:8]]


def test_unsigned_search_without_floor(simd):
    x = near_midpoints(False)
    assert torch.equal(kernel_codes(x, False, positive_floor=False).long(), midpoint_count(x, False))


def test_search_cases_cover_every_midpoint_from_both_sides():
    """The case list itself: each midpoint, the fp32 just above and just below it, both signs."""
    for signed in (True, False):
        x = near_midpoints(signed)
        mids = lowbit.code_midpoints(signed)
        for m in (mids, -mids):
            for probe in (m, torch.nextafter(m, torch.full_like(m, 2.0)), torch.nextafter(m, torch.full_like(m, -2.0))):
                assert torch.isin(probe, x).all()
        assert torch.isnan(x).sum() >= 6 and torch.isinf(x).sum() >= 2


def test_table_that_breaks_the_structure_is_refused():
    table = lowbit.kernel_table(True).clone()
    table[lowbit.KT_A + 6] *= 1.05  # one decade's slope 5% off: its estimates stray by codes
    x = torch.zeros(4)
    out = torch.empty(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="8-bit map table"):
        _cpu.q8_quantize(x.data_ptr(), 4, table.data_ptr(), False, out.data_ptr())
