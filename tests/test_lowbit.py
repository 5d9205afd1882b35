"""The low-bit rules' contract (lowbit.py) and reference (reference_lowbit.py) against independent
statements: brute-force nearest codes, exact-arithmetic Adam, the scalar hash, bitsandbytes' maps."""
from __future__ import annotations

import math

import pytest
import torch

from mps_fused_adam.numerics import contract, lowbit
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference_lowbit import (block_absmax, dequantize, quantize, reference_adam8bit_, reference_adam_sr_)

from conftest import require_bitsandbytes


def bnb_functional():
    """bitsandbytes.functional, or a skip saying why (conftest.require_bitsandbytes)."""
    return require_bitsandbytes().functional


# ---- maps and quantization --------------------------------------------------------------------

@pytest.mark.parametrize("signed", [True, False])
def test_maps_equal_bitsandbytes(signed):
    F = bnb_functional()
    ours = lowbit.dynamic_map(signed)
    theirs = F.create_dynamic_map(signed=signed)
    assert torch.equal(ours.view(torch.int32), theirs.float().view(torch.int32))


def test_map_facts():
    s, u = lowbit.dynamic_map(True), lowbit.dynamic_map(False)
    for m in (s, u):
        assert m.shape == (256,) and m.dtype == torch.float32 and bool((m[1:] > m[:-1]).all())
        assert m[-1].item() == 1.0
    assert s[lowbit.SIGNED_ZERO_CODE].item() == 0.0 and s[0].item() == pytest.approx(-0.99297, abs=1e-5)
    assert u[lowbit.UNSIGNED_ZERO_CODE].item() == 0.0 and u[1].item() == pytest.approx(3.25e-7, rel=1e-6)


def brute_force_codes(xn: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Nearest code by exhaustive search in float64; at an exact tie the lower code."""
    d = (xn.double().unsqueeze(1) - qmap.double().unsqueeze(0)).abs()
    best = d.min(dim=1, keepdim=True).values
    return (d == best).double().argmax(dim=1)  # first (lowest) index among the minima


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_is_nearest_code_with_lower_ties(signed):
    """Exhaustive nearest-code search agrees with the contract's midpoint thresholds."""
    gen = torch.Generator().manual_seed(3)
    qmap = lowbit.dynamic_map(signed)
    n = 256 * 40
    # Values spread over 8 decades, exact codes and exact midpoints, in blocks with scale 1.
    x = torch.rand(n, generator=gen) * 10.0 ** (-8 * torch.rand(n, generator=gen))
    if signed:
        x = x * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    x[:256] = qmap
    x[256:511] = lowbit.code_midpoints(signed)
    x[511] = 1.0  # every block's absmax is 1, so x * (1 / 1) == x exactly
    x.view(-1, 256)[:, -1] = 1.0
    absmax = block_absmax(x)
    assert torch.equal(absmax, torch.ones(n // 256))
    codes = quantize(x, absmax, signed).long()
    want = brute_force_codes(x, qmap)
    # On a threshold itself (the fp32-rounded midpoint, which may sit an ulp off the exact one)
    # the contract says: the lower code.
    mids = lowbit.code_midpoints(signed)
    on_mid = (x.unsqueeze(1) == mids.unsqueeze(0))
    want = torch.where(on_mid.any(dim=1), on_mid.double().argmax(dim=1), want)
    if not signed:  # a positive second moment never becomes zero
        want = torch.where((want == 0) & (x > 0), torch.ones_like(want), want)
    assert torch.equal(codes, want)
    assert torch.equal(codes[:256], torch.arange(256))


def test_quantize_special_values():
    # Block 0 holds a NaN: its scale is NaN and every code of it 0 (dequantizing to NaN: NaN
    # propagates to the whole block, never silently dropped). Block 1 is ordinary.
    x = torch.tensor([float("nan")] + [0.5] * 255 + [1.0, -0.0, 0.0] + [0.5] * 253)
    a = block_absmax(x)
    codes = quantize(x, a, signed=True)
    assert torch.isnan(a[0]) and a[1] == 1.0
    assert (codes[:256] == 0).all() and dequantize(codes, a, True)[:256].isnan().all()
    assert codes[256] == 255 and codes[257] == codes[258] == lowbit.SIGNED_ZERO_CODE
    z = torch.zeros(300)
    assert torch.equal(quantize(z, block_absmax(z), signed=False), torch.zeros(300, dtype=torch.uint8))
    assert torch.equal(block_absmax(z), torch.zeros(2))
    tiny = torch.tensor([1e-12] + [1.0] * 255)  # 1e-12 is nearest to 0 but is positive
    assert quantize(tiny, block_absmax(tiny), signed=False)[0] == 1


def test_dequantize_round_trip_error_is_within_half_a_code_gap():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5000, generator=gen) * 10.0 ** (-3 * torch.rand(5000, generator=gen))
    a = block_absmax(x)
    y = dequantize(quantize(x, a, True), a, True)
    qmap = lowbit.dynamic_map(True)
    gaps = (qmap[1:] - qmap[:-1]).max().item()  # largest relative gap, times the block scale
    blockwise = (x - y).abs().view(-1)[:4864].view(-1, 256).amax(dim=1) / a[:19]
    assert blockwise.max().item() <= gaps / 2 + 1e-6


# ---- the clamp ---------------------------------------------------------------------------------

@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95), (0.5, 0.9), (0.0, 0.99), (0.95, 0.5)])
def test_clip_bounds_exact_adam(betas):
    """In float64, Adam on any gradient sequence (random, spiky, and the Cauchy-Schwarz extremal
    one) stays within the bound; the extremal sequence reaches it."""
    b1, b2 = betas
    T = 60
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randn(T, generator=gen, dtype=torch.float64),
            torch.where(torch.rand(T, generator=gen, dtype=torch.float64) < 0.1, 100.0, 1e-3)]
    r = b1 * b1 / b2
    # g_k proportional to (b1/b2)^(t-k) makes Cauchy-Schwarz tight at step t = T.
    seqs.append(torch.tensor([(b1 / b2) ** (T - k) if b1 > 0 else float(k == T) for k in range(1, T + 1)],
                             dtype=torch.float64))
    reached = 0.0
    for g in seqs:
        m = v = 0.0
        for t in range(1, T + 1):
            m = b1 * m + (1 - b1) * g[t - 1].item()
            v = b2 * v + (1 - b2) * g[t - 1].item() ** 2
            bc2 = 1 - b2 ** t
            ratio = abs(m) * math.sqrt(bc2) / math.sqrt(v) if v > 0 else 0.0
            bound = lowbit.normalized_step_bound(b1, b2, t, True)
            assert ratio <= bound * (1 + 1e-12), (t, ratio, bound)
            reached = max(reached, ratio / bound)
    assert reached == pytest.approx(1.0, rel=1e-9) or r >= 1.0


def test_clip_scalar():
    s = lowbit.adam8bit_scalars(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1))
    assert s.clip == pytest.approx(0.1 * lowbit.CLIP_MARGIN, rel=1e-7) and s.clip >= 0.1
    late = lowbit.adam8bit_scalars(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 10 ** 6))
    limit = 0.1 / math.sqrt(0.001) / math.sqrt(1 - 0.81 / 0.999) * lowbit.CLIP_MARGIN
    assert late.clip == pytest.approx(limit, rel=1e-6)


def hyper(step, **kw):
    base = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=step)
    base.update(kw)
    return AdamHyper(**base)


def fp32_adam_run(p0, grads, **kw):
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(grads, 1):
        reference_adam_sr_(p, g, m, v, hyper(t, **kw), None)
    return p


def adam8bit_run(p0, grads, **kw):
    n = p0.numel()
    p = p0.clone()
    c1 = torch.full((n,), lowbit.SIGNED_ZERO_CODE, dtype=torch.uint8)
    c2 = torch.zeros(n, dtype=torch.uint8)
    a1, a2 = torch.zeros(lowbit.num_blocks(n)), torch.zeros(lowbit.num_blocks(n))
    for t, g in enumerate(grads, 1):
        reference_adam8bit_(p, g, c1, a1, c2, a2, hyper(t, **kw))
    return p


def test_8bit_reference_tracks_fp32_adam():
    gen = torch.Generator().manual_seed(5)
    n = 256 * 16 + 17
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(30)]
    exact = fp32_adam_run(p0, grads)
    q = adam8bit_run(p0, grads)
    moved = (exact - p0).abs().mean().item()
    err = (q - exact).abs().mean().item()
    assert moved > 0.05 and err < 0.05 * moved, (moved, err)


def test_clamp_contains_the_known_hazard(monkeypatch):
    """Blocks whose gradients span 8 decades (and hold zeros) push small second moments to the
    zero code; without the clamp the next steps move those parameters by about m / eps."""
    gen = torch.Generator().manual_seed(9)
    n = 256 * 8
    scale = 10.0 ** (-8 * torch.rand(n, generator=gen))
    scale[::7] = 0.0
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * scale for _ in range(20)]
    grads += [torch.zeros(n)] * 3  # zero gradients: m decays, v is whatever the code says
    exact = fp32_adam_run(p0, grads)
    q = adam8bit_run(p0, grads)
    lr, steps = 1e-2, len(grads)
    # Every parameter change is bounded by step_size * clip per step (sum over the steps).
    bound = sum(lowbit.adam8bit_scalars(hyper(t)).step_size * lowbit.adam8bit_scalars(hyper(t)).clip
                for t in range(1, steps + 1))
    assert (q - p0).abs().max().item() <= bound * (1 + 1e-5)
    assert (q - exact).abs().max().item() < 10 * lr * steps
    # The CUDA rule of bitsandbytes (plain nearest code, so small second moments become zero, and
    # no clamp) on the same run shows the hazard both defenses are there for.
    from mps_fused_adam.numerics import reference_lowbit
    original = reference_lowbit.quantize

    def nearest_code_only(x, absmax, signed):
        codes = original(x, absmax, signed)
        if not signed:
            xn = x / absmax.repeat_interleave(lowbit.BLOCK)[: x.numel()]
            codes = torch.where(xn <= lowbit.code_midpoints(False)[0], torch.zeros_like(codes), codes)
        return codes

    monkeypatch.setattr(reference_lowbit, "quantize", nearest_code_only)
    monkeypatch.setattr(contract, "normalized_step_bound", lambda *a: math.inf)  # adam8bit_scalars' (contract.py)
    unclamped = adam8bit_run(p0, grads)
    print(f"\nmax |8-bit - fp32|: contract {(q - exact).abs().max().item():.3g}, "
          f"nearest code without clamp {(unclamped - exact).abs().max().item():.3g}")
    assert (unclamped - exact).abs().max().item() > 100 * lr * steps
