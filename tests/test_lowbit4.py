"""The 4-bit contract (numerics/lowbit4.py) and its reference (reference_lowbit.reference_adam4bit_)
against independent statements: the maps as literal fp32 bit patterns, brute-force nearest codes,
byte-level packing, and one step re-stated in float64."""
from __future__ import annotations

import math

import pytest
import torch

from mps_fused_adam.numerics import lowbit, lowbit4
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference_lowbit import (block_absmax, dequantize4, quantize4, reference_adam4bit_,
                                                      reference_adam_sr_)

from conftest import require_torchao

# create_dynamic_map(True, 3, 4) in fp32 as bitsandbytes/torchao compute it: the decimal values
# -0.8875 ... 1.0, two of them (0.2125, 0.0325) one ulp below their nearest fp32 (the fp32
# linspace and midpoint arithmetic), stated as bits so a change of arithmetic shows.
SIGNED_BITS = [0xBF633333, 0xBF29999A, 0xBEE00000, 0xBE599999, 0xBD9EB852, 0xBD051EB9, 0xBBB43958, 0x00000000,
               0x3BB43958, 0x3D051EB9, 0x3D9EB852, 0x3E599999, 0x3EE00000, 0x3F29999A, 0x3F633333, 0x3F800000]
SIGNED_DECIMAL = [-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
                  0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0]


def _bits(t: torch.Tensor) -> list[int]:
    return [b & 0xFFFFFFFF for b in t.view(torch.int32).tolist()]


# ---- maps ------------------------------------------------------------------------------------

def test_signed_map_values():
    m = lowbit4.map4(True)
    assert m.dtype == torch.float32 and m.shape == (16,)
    assert _bits(m) == SIGNED_BITS
    for got, want in zip(m.tolist(), SIGNED_DECIMAL):
        assert got == pytest.approx(want, rel=1e-6, abs=0)
    assert m[lowbit4.SIGNED_ZERO_CODE4].item() == 0.0 and m[15].item() == 1.0 and m[0].item() > -1.0


def test_unsigned_map_is_sixteenths_without_zero():
    m = lowbit4.map4(False)
    assert m.tolist() == [k / 16 for k in range(1, 17)]
    assert (m > 0).all()  # zero-free: code 0 is absmax / 16


@pytest.mark.parametrize("signed", [True, False])
def test_midpoints_and_kernel_table(signed):
    m = lowbit4.map4(signed).double()
    mids = lowbit4.midpoints4(signed)
    # The exact mean of two fp32 values, rounded once to fp32, equals the fp32 sum halved.
    assert torch.equal(mids, ((m[:-1] + m[1:]) / 2).float())
    assert mids.shape == (15,) and bool((mids[1:] > mids[:-1]).all())
    kt = lowbit4.kernel_table4(signed)
    assert kt.dtype == torch.float32 and kt.shape == (lowbit4.KT4_SIZE,) and kt.is_contiguous()
    assert torch.equal(kt[lowbit4.KT4_VALUES:16], lowbit4.map4(signed))
    assert torch.equal(kt[lowbit4.KT4_MIDS:31], mids) and kt[31].item() == 0.0


@pytest.mark.parametrize("signed", [True, False])
def test_maps_equal_torchao(signed):
    require_torchao()
    from torchao.optim.subclass_4bit import OptimState4bit
    theirs = OptimState4bit.zeros((256,), signed=signed, block_size=128).qmap
    assert _bits(theirs) == _bits(lowbit4.map4(signed))


# ---- quantization ------------------------------------------------------------------------------

def brute_force_codes(xn: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Nearest code by exhaustive float64 search; at an exact tie the lower code."""
    d = (xn.double().unsqueeze(1) - qmap.double().unsqueeze(0)).abs()
    return (d == d.min(dim=1, keepdim=True).values).double().argmax(dim=1)


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_is_nearest_code_ties_low(signed):
    gen = torch.Generator().manual_seed(3)
    qmap, mids = lowbit4.map4(signed), lowbit4.midpoints4(signed)
    n = 128 * 40
    x = torch.rand(n, generator=gen) * 10.0 ** (-4 * torch.rand(n, generator=gen))
    if signed:
        x = x * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    x[:16] = qmap
    x[16:31] = mids  # exact thresholds: the lower code
    x.view(-1, 128)[:, -1] = 1.0  # every block's absmax is 1: xn == x exactly
    a = block_absmax(x, lowbit4.BLOCK4)
    assert torch.equal(a, torch.ones(n // 128))
    codes = lowbit4.unpack_codes4(quantize4(x, a, signed), n).long()
    want = brute_force_codes(x, qmap)
    on_mid = x.unsqueeze(1) == mids.unsqueeze(0)
    want = torch.where(on_mid.any(dim=1), on_mid.double().argmax(dim=1), want)
    assert torch.equal(codes, want)
    assert codes[:16].tolist() == list(range(16)) and codes[16:31].tolist() == list(range(15))


def test_quantize_nan_zero_and_zero_free():
    nan = float("nan")
    # Block 0 holds a NaN: scale NaN, every code 0, the block dequantizes to NaN. Block 1: zeros.
    # Block 2 (short, 5 elements): scale 2.
    x = torch.cat([torch.tensor([nan] + [0.5] * 127), torch.zeros(128), torch.tensor([2.0, -0.0, 1e-9, -2.0, 0.9])])
    a = block_absmax(x, 128)
    assert torch.isnan(a[0]) and a[1].item() == 0.0 and a[2].item() == 2.0 and a.shape == (3,)
    s = lowbit4.unpack_codes4(quantize4(x, a, True), x.numel())
    assert (s[:128] == 0).all() and dequantize4(quantize4(x, a, True), a, True, x.numel())[:128].isnan().all()
    assert (s[128:256] == lowbit4.SIGNED_ZERO_CODE4).all()
    # xn = 1, -0, 5e-10, -1, 0.45: codes of 1.0, 0.0, 0.0, -0.8875 (the map has no -1), 0.4375.
    assert s[256:].tolist() == [15, 7, 7, 0, 12]
    u = lowbit4.unpack_codes4(quantize4(x.abs(), a, False), x.numel())
    assert (u[:128] == 0).all()
    assert (u[128:256] == 0).all()  # zero scale: code 0 (1/16 of 0)
    assert u[256:].tolist() == [15, 0, 0, 15, 6]  # 0.45 -> 7/16 (code 6), 5e-10 -> code 0 (1/16)
    back = dequantize4(quantize4(x.abs(), a, False), a, False, x.numel())
    assert back[128:256].eq(0).all() and back[258].item() == 2.0 / 16  # never dequantized to zero


def test_quantize_inf_block():
    # An infinite element: scale inf, inv 0, so the finite elements get xn = 0 and the inf NaN (code 0).
    x = torch.tensor([float("inf"), 1.0, -3.0] + [0.0] * 125)
    a = block_absmax(x, 128)
    c = lowbit4.unpack_codes4(quantize4(x, a, True), 128)
    assert math.isinf(a[0].item()) and c[0] == 0 and c[1] == c[2] == lowbit4.SIGNED_ZERO_CODE4


# ---- packing -------------------------------------------------------------------------------------

def test_packing_is_high_nibble_first():
    assert lowbit4.pack_codes4(torch.tensor([1, 2, 3, 4])).tolist() == [0x12, 0x34]
    assert lowbit4.pack_codes4(torch.tensor([15, 0, 9])).tolist() == [0xF0, 0x90]  # padding nibble 0
    assert lowbit4.unpack_codes4(torch.tensor([0xAB, 0xC0], dtype=torch.uint8), 3).tolist() == [0xA, 0xB, 0xC]
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 127, 128, 129, 1001):
        c = torch.randint(0, 16, (n,), generator=gen, dtype=torch.uint8)
        packed = lowbit4.pack_codes4(c)
        assert packed.dtype == torch.uint8 and packed.shape == (lowbit4.packed_size(n),) == ((n + 1) // 2,)
        assert torch.equal(lowbit4.unpack_codes4(packed, n), c)
        if n % 2 == 0:  # torchao's own expression
            assert torch.equal(packed, (c[::2] << 4) | c[1::2])
        else:
            assert packed[-1].item() & 0x0F == 0


def test_fresh_state():
    for n in (4, 5):
        s, u = lowbit4.fresh_codes4(n, True), lowbit4.fresh_codes4(n, False)
        assert s.tolist() == [0x77] * (n // 2) + ([0x70] if n % 2 else [])
        assert u.tolist() == [0] * ((n + 1) // 2)
        z = torch.zeros(lowbit4.num_blocks4(n))
        assert dequantize4(s, z, True, n).eq(0).all() and dequantize4(u, z, False, n).eq(0).all()
    assert lowbit4.num_blocks4(128) == 1 and lowbit4.num_blocks4(129) == 2


@pytest.mark.parametrize("signed", [True, False])
def test_round_trips(signed):
    gen = torch.Generator().manual_seed(1)
    n = 128 * 30 + 77
    x = torch.randn(n, generator=gen) * 10.0 ** (-3 * torch.rand(n, generator=gen))
    if not signed:
        x = x * x
    a = block_absmax(x, 128)
    packed = quantize4(x, a, signed)
    y = dequantize4(packed, a, signed, n)
    qmap = lowbit4.map4(signed)
    # Every value lands on its nearest code: error at most half the widest gap (times the scale),
    # and below the smallest code (unsigned) at most that code.
    half_gap = max(((qmap[1:] - qmap[:-1]).max() / 2).item(), qmap[0].item() if not signed else 0.0)
    err = (x - y).abs() / torch.repeat_interleave(a, 128)[:n]
    assert err.max().item() <= half_gap * (1 + 1e-6)
    # Codes survive dequantize -> quantize under the same scales.
    assert torch.equal(quantize4(y, a, signed), packed)


# ---- one step ---------------------------------------------------------------------------------

def hyper(step, **kw):
    base = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=step)
    base.update(kw)
    return AdamHyper(**base)


def _float64_step(p, g, c1, a1, c2, a2, hp):
    """One 4-bit step re-stated in float64 from the contract's words (no shared code with the
    reference): dequantize, Adam with the clamp, block absmax, nearest code by exhaustive search."""
    n = p.numel()
    s = lowbit.adam8bit_scalars(hp)  # the contract's fp32 scalars
    m1, m2 = lowbit4.map4(True).double(), lowbit4.map4(False).double()
    codes1 = torch.tensor([(b >> sh) & 15 for b in c1.tolist() for sh in (4, 0)])[:n]
    codes2 = torch.tensor([(b >> sh) & 15 for b in c2.tolist() for sh in (4, 0)])[:n]
    blk = torch.arange(n) // 128
    m = m1[codes1] * a1.double()[blk]
    v = m2[codes2] * a2.double()[blk]
    p, g = p.double(), g.double()
    if not s.adam_w_mode:
        g = g + s.weight_decay * p
    m = s.beta1 * m + s.one_minus_beta1 * g
    v = s.beta2 * v + s.one_minus_beta2 * g * g
    u = (m / (v.sqrt() * s.d2 + s.eps)).clamp(-s.clip, s.clip)
    p = p * (s.decay if s.adam_w_mode else 1.0) - s.step_size * u
    nb = lowbit4.num_blocks4(n)
    new_a1 = torch.tensor([m[blk == b].abs().max().item() for b in range(nb)], dtype=torch.float64)
    new_a2 = torch.tensor([v[blk == b].abs().max().item() for b in range(nb)], dtype=torch.float64)
    q1 = brute_force_codes(m / new_a1[blk], m1)
    q2 = brute_force_codes(v / new_a2[blk], m2)
    return p, q1, new_a1, q2, new_a2, m / new_a1[blk], v / new_a2[blk]


@pytest.mark.parametrize("wd, adam_w", [(0.0, True), (0.1, True), (0.1, False)])
def test_step_matches_a_float64_statement(wd, adam_w):
    gen = torch.Generator().manual_seed(7)
    n = 128 * 12 + 45
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 10.0 ** (-2 * torch.rand(n, generator=gen))
    nb = lowbit4.num_blocks4(n)
    # A state of the past: random codes (padding nibble 0) and scales.
    c1 = lowbit4.pack_codes4(torch.randint(0, 16, (n,), generator=gen))
    c2 = lowbit4.pack_codes4(torch.randint(0, 16, (n,), generator=gen))
    a1, a2 = torch.rand(nb, generator=gen) * 0.1, torch.rand(nb, generator=gen) * 0.01
    hp = hyper(5, weight_decay=wd, adam_w_mode=adam_w)
    want_p, q1, w1, q2, w2, xn1, xn2 = _float64_step(p, g, c1, a1, c2, a2, hp)
    reference_adam4bit_(p, g, c1, a1, c2, a2, hp)
    assert torch.allclose(p.double(), want_p, rtol=1e-6, atol=1e-6)
    assert torch.allclose(a1.double(), w1, rtol=1e-5) and torch.allclose(a2.double(), w2, rtol=1e-5)
    got1, got2 = lowbit4.unpack_codes4(c1, n).long(), lowbit4.unpack_codes4(c2, n).long()
    # Codes agree except where fp32 rounding puts a value within a hair of a threshold.
    for got, want, xn, signed in ((got1, q1, xn1, True), (got2, q2, xn2, False)):
        differ = got != want
        near = (xn.unsqueeze(1) - lowbit4.midpoints4(signed).double().unsqueeze(0)).abs().min(dim=1).values < 1e-5
        assert bool((~differ | near).all()) and differ.sum().item() <= 3
        assert (got - want).abs().max().item() <= 1
    if n % 2:
        assert c1[-1].item() & 15 == 0 and c2[-1].item() & 15 == 0


def test_bf16_param_stochastic_rounding():
    gen = torch.Generator().manual_seed(2)
    n = 128 * 4 + 3
    p0 = torch.randn(n, generator=gen).bfloat16()
    g = torch.randn(n, generator=gen)
    states = lambda: (lowbit4.fresh_codes4(n, True), torch.zeros(lowbit4.num_blocks4(n)),  # noqa: E731
                      lowbit4.fresh_codes4(n, False), torch.zeros(lowbit4.num_blocks4(n)))
    p32 = p0.float()
    s32 = states()
    reference_adam4bit_(p32, g, *s32, hyper(1))
    pb = p0.clone()
    sb = states()
    key = lowbit.sr_key(12345, 1)
    reference_adam4bit_(pb, g, *sb, hyper(1), key)
    assert torch.equal(pb.view(torch.int16), lowbit.stochastic_round_bf16(p32, key).view(torch.int16))
    assert all(torch.equal(a, b) for a, b in zip(s32, sb))
    pr = p0.clone()
    reference_adam4bit_(pr, g, *states(), hyper(1))
    assert torch.equal(pr, p32.bfloat16())  # without a key: round to nearest even


def test_shapes_and_in_place():
    p = torch.randn(33, 17)  # 561 elements, odd, 5 blocks
    g = torch.randn(33, 17)
    c1, c2 = lowbit4.fresh_codes4(561, True), lowbit4.fresh_codes4(561, False)
    a1, a2 = torch.zeros(5), torch.zeros(5)
    ptrs = [t.data_ptr() for t in (p, c1, a1, c2, a2)]
    reference_adam4bit_(p, g, c1, a1, c2, a2, hyper(1))
    assert [t.data_ptr() for t in (p, c1, a1, c2, a2)] == ptrs
    assert c1.shape == c2.shape == (281,) and p.shape == (33, 17)
    # Step 1 from zero: m = 0.1 g, v = 0.001 g^2; each block's largest |g| gets code 15 in both.
    flat = g.reshape(-1)
    omb1 = lowbit.adam8bit_scalars(hyper(1)).one_minus_beta1
    assert torch.equal(a1, block_absmax(torch.full_like(flat, omb1) * flat, 128))
    top = flat[:512].view(4, 128).abs().argmax(dim=1) + torch.arange(4) * 128
    assert (lowbit4.unpack_codes4(c2, 561)[top] == 15).all()


def fp32_adam_run(p0, grads, **kw):
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(grads, 1):
        reference_adam_sr_(p, g, m, v, hyper(t, **kw), None)
    return p


def adam4bit_run(p0, grads, **kw):
    n = p0.numel()
    p = p0.clone()
    c1, c2 = lowbit4.fresh_codes4(n, True), lowbit4.fresh_codes4(n, False)
    a1, a2 = torch.zeros(lowbit4.num_blocks4(n)), torch.zeros(lowbit4.num_blocks4(n))
    for t, g in enumerate(grads, 1):
        reference_adam4bit_(p, g, c1, a1, c2, a2, hyper(t, **kw))
    return p


def test_4bit_reference_tracks_fp32_adam():
    gen = torch.Generator().manual_seed(5)
    n = 128 * 32 + 17
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(30)]
    exact = fp32_adam_run(p0, grads)
    q = adam4bit_run(p0, grads)
    moved = (exact - p0).abs().mean().item()
    err = (q - exact).abs().mean().item()
    # 4-bit moments are coarser than 8-bit: on these i.i.d. unit gradients (the hardest case for
    # block scales) the mean deviation is 0.234 of the mean move (8-bit: 0.018); bound 0.3.
    assert moved > 0.05 and err < 0.3 * moved, (moved, err)


def test_agrees_with_torchao_codes():
    """torchao's quantizer (division by the scale, ties up) gives our codes except within an ulp
    of a threshold, and its dequantization of our codes is ours."""
    require_torchao()
    from torchao.optim.subclass_4bit import OptimState4bit
    gen = torch.Generator().manual_seed(4)
    n = 128 * 64
    for signed in (True, False):
        x = torch.randn(n, generator=gen) * 10.0 ** (-3 * torch.rand(n, generator=gen))
        x = x if signed else x * x
        st = OptimState4bit.zeros((n,), signed=signed, block_size=128)
        st.copy_(x)
        a = block_absmax(x, 128)
        ours = quantize4(x, a, signed)
        assert torch.equal(st.scale, a.clamp(min=1e-12))
        differ = (lowbit4.unpack_codes4(ours, n) != lowbit4.unpack_codes4(st.codes, n)).sum().item()
        assert differ <= n // 1000, differ
        assert torch.equal(st.dequantize(), dequantize4(st.codes, st.scale, signed, n))
