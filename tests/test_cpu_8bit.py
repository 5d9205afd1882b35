"""The CPU 8-bit Adam kernel (src/cpu/adam8bit.cpp) against the plain-torch reference
(reference_lowbit.py): bit-identical codes, scales and params, for every param dtype, with and
without bf16 stochastic rounding, on every SIMD path and thread count."""
from __future__ import annotations

import pytest
import torch

from mps_fused_adam import _cpu, lowbit
from mps_fused_adam.contract import AdamHyper
from mps_fused_adam.optim8bit import _cpu_adam8bit
from mps_fused_adam.reference_lowbit import reference_adam8bit_

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def fresh_state(n):
    nb = lowbit.num_blocks(n)
    return {"exp_avg_codes": torch.full((n,), lowbit.SIGNED_ZERO_CODE, dtype=torch.uint8),
            "exp_avg_absmax": torch.zeros(nb), "exp_avg_sq_codes": torch.zeros(n, dtype=torch.uint8),
            "exp_avg_sq_absmax": torch.zeros(nb)}


def run_both(n, dtype, steps=3, sr=False, specials=False, **mode):
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen).to(dtype)
    ours, ref = p0.clone(), p0.clone()
    so, sref = fresh_state(n), fresh_state(n)
    for step in range(1, steps + 1):
        # Magnitudes over 6 decades inside each block, and exact zeros: the hazard's territory.
        g = (torch.randn(n, generator=gen) * 10.0 ** (-6 * torch.rand(n, generator=gen))).to(dtype)
        g[5::11] = 0
        if specials and step == 2:
            g[3] = float("nan")
            if n > 600:
                g[600] = float("inf")
        hp = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step, **mode)
        key = lowbit.sr_key(12345, step) if sr else None
        _cpu_adam8bit(ours, g, so, hp, key)
        reference_adam8bit_(ref, g, sref["exp_avg_codes"], sref["exp_avg_absmax"], sref["exp_avg_sq_codes"],
                            sref["exp_avg_sq_absmax"], hp, key)
    return (ours, so), (ref, sref), p0


def assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert torch.equal(pa.view(torch.uint8), pb.view(torch.uint8)), "param differs"
    for k in sa:
        assert torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)), f"{k} differs"


@pytest.fixture(params=_cpu.simd_paths())
def simd(request):
    before = _cpu.simd_path()
    _cpu.set_simd_path(request.param)
    yield request.param
    _cpu.set_simd_path(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 255, 256, 257, 4097])
@pytest.mark.parametrize("mode", [dict(), dict(adam_w_mode=False, maximize=True), dict(bias_correction=False)],
                         ids=["adamw", "l2-max", "nobc"])
def test_matches_reference_bitwise(simd, dtype, n, mode):
    ours, ref, p0 = run_both(n, dtype, **mode)
    assert_same(ours, ref)
    assert (ours[1]["exp_avg_sq_absmax"] > 0).all()  # the kernel really ran (bf16 params may not move)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_and_large_tensor(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours, ref, _ = run_both(256 * 300 + 7, torch.bfloat16, steps=2, sr=True)
    finally:
        torch.set_num_threads(old)
    assert_same(ours, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stochastic_rounding_and_specials(dtype):
    ours, ref, _ = run_both(1000, dtype, sr=True, specials=True)
    assert_same(ours, ref)
    assert torch.isnan(ours[0][3].float())  # NaN propagates into its block
    assert torch.isnan(ours[1]["exp_avg_absmax"][0])


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="48-byte scalar struct"):
        _cpu.adam8bit_step(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, b"x", 0, False, 1)
    with pytest.raises(ValueError, match="param dtype code"):
        _cpu.adam8bit_step(0, 0, 0, 0, 0, 0, 0, 7, 0, 0, b"\0" * 48, 0, False, 1)


# ---- bf16 stochastic rounding in the Adam span loop -------------------------------------------

@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 7, 33, 4097, 100_003])
def test_adam_stochastic_rounding_kernel_matches_reference(simd, sdtype, n):
    from mps_fused_adam.backends import CPUBackend
    from mps_fused_adam.reference_lowbit import reference_adam_sr_
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen).bfloat16()
    m, v = torch.zeros(n, dtype=sdtype), torch.zeros(n, dtype=sdtype)
    ours, ref = [p.clone(), m.clone(), v.clone()], [p.clone(), m.clone(), v.clone()]
    for step in (1, 2, 3):
        g = torch.randn(n, generator=gen).bfloat16()
        if step == 2:
            g[0] = float("nan")
        hp = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, step)
        key = lowbit.sr_key(99, step)
        CPUBackend().update("adam", [ours[0]], [g], [[ours[1]], [ours[2]]], hp, sr_keys=[key])
        reference_adam_sr_(ref[0], g, ref[1], ref[2], hp, key)
    assert torch.equal(ours[0].view(torch.int16), ref[0].view(torch.int16))  # NaN param: 0x7FC0 in both
    # Moments: bit for bit, except that a NaN's sign and payload are not part of the contract.
    for a, b in zip(ours[1:], ref[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(ours[0][0].float())


def test_stochastic_rounding_needs_bf16_params():
    with pytest.raises(ValueError, match="needs bfloat16 params"):
        _cpu.step("adam", [0], [0], [[0], [0]], [0], 0, 0, b"\0" * 44, 1, [1])
