"""The CPU 8-bit Adam kernel (src/cpu/adam8bit.cpp) against the plain-torch reference
(reference_lowbit.py): bit-identical codes, scales and params, for every param dtype, with and
without bf16 stochastic rounding, on every SIMD path and thread count."""
from __future__ import annotations

import pytest
import torch

from mps_fused_adam import _cpu
from mps_fused_adam.numerics import lowbit
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.backends import get_backend
from mps_fused_adam.numerics.reference_lowbit import reference_adam8bit_

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cpu_adam8bit(p, g, st, hp, key):
    """The CPU backend's 8-bit rule on one tensor (what the optimizers call)."""
    get_backend("cpu").update("adam8bit", [p], [g], [[st[k]] for k in (
        "exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")], hp,
        sr_keys=None if key is None else [key])


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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 255, 256, 257, 4097])
@pytest.mark.parametrize("mode", [dict(), dict(adam_w_mode=False, maximize=True), dict(bias_correction=False)],
                         ids=["adamw", "l2-max", "nobc"])
def test_matches_reference_bitwise(simd, dtype, n, mode):
    ours, ref, p0 = run_both(n, dtype, **mode)
    assert_same(ours, ref)
    assert (ours[1]["exp_avg_sq_absmax"] > 0).all()  # the kernel really ran (bf16 params may not move)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_permute_dequantization_changes_speed_only(simd, dtype):
    """Dequantizing a block by byte permutes (AVX512_VBMI builds) or by a gather per vector moves no
    bit: both match the reference, for whole blocks, a short last block, and stochastic rounding."""
    assert _cpu.q8_permute_dequant()  # the default
    try:
        for on in (False, True):
            _cpu.set_q8_permute_dequant(on)
            for n in (256 * 3, 256 * 2 + 77):
                ours, ref, _ = run_both(n, dtype, sr=dtype == torch.bfloat16)
                assert_same(ours, ref)
    finally:
        _cpu.set_q8_permute_dequant(True)


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
def test_stochastic_rounding_and_specials(simd, dtype):
    """A NaN and an Inf gradient, on every SIMD path: a NaN moment takes code 0, as the reference's."""
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
    from mps_fused_adam.numerics.reference_lowbit import reference_adam_sr_
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


# ---- many tensors in one call ------------------------------------------------------------------

def _batch_args(tensors):
    """adam8bit_step_many's columns for [(param, grad, state, hyper, key)]."""
    cols = [[] for _ in range(11)]
    for p, g, st, hp, key in tensors:
        for col, v in zip(cols, (p.data_ptr(), g.data_ptr(), st["exp_avg_codes"].data_ptr(),
                                 st["exp_avg_absmax"].data_ptr(), st["exp_avg_sq_codes"].data_ptr(),
                                 st["exp_avg_sq_absmax"].data_ptr(), p.numel(), {torch.float32: 0, torch.float16: 1,
                                                                                  torch.bfloat16: 2}[p.dtype],
                                 lowbit.pack_adam8bit(hp), 0 if key is None else key, int(key is not None))):
            col.append(v)
    return cols


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_tensors_in_one_call_match_the_reference(threads):
    """Blocks of several tensors shared among threads as one range: every tensor bit for bit as
    the reference, whatever the split (sizes under, at and across block and thread boundaries)."""
    gen = torch.Generator().manual_seed(3)
    specs = [(0, torch.float32), (1, torch.bfloat16), (255, torch.float16), (257, torch.float32),
             (256 * 130 + 3, torch.bfloat16), (256 * 140, torch.float32), (4097, torch.bfloat16)]
    ours, refs = [], []
    for i, (n, dtype) in enumerate(specs):
        p = torch.randn(n, generator=gen).to(dtype)
        ours.append([p.clone(), fresh_state(n)])
        refs.append([p.clone(), fresh_state(n)])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in (1, 2, 3):
            grads = [(torch.randn(n, generator=gen) * 1e-2).to(d) for n, d in specs]
            hp = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step)
            keys = [lowbit.sr_key(7 + i, step) if d is torch.bfloat16 and i % 2 else None
                    for i, (_, d) in enumerate(specs)]
            cols = _batch_args([(o[0], g, o[1], hp, k) for o, g, k in zip(ours, grads, keys)])
            _cpu.adam8bit_step_many(*cols[:8], lowbit.kernel_table(True).data_ptr(),
                                    lowbit.kernel_table(False).data_ptr(), *cols[8:], threads)
            for r, g, k in zip(refs, grads, keys):
                st = r[1]
                reference_adam8bit_(r[0], g, st["exp_avg_codes"], st["exp_avg_absmax"], st["exp_avg_sq_codes"],
                                    st["exp_avg_sq_absmax"], hp, k)
    finally:
        torch.set_num_threads(old)
    for (p, so), (pr, sr) in zip(ours, refs):
        assert_same((p, so), (pr, sr))
    assert (ours[-2][1]["exp_avg_sq_absmax"] > 0).all()


def test_many_rejects_bad_entries_before_writing_anything():
    n = 600
    tensors = [(torch.randn(n), torch.randn(n), fresh_state(n), AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, 1), None)
               for _ in range(3)]
    before = [(t[0].clone(), {k: v.clone() for k, v in t[2].items()}) for t in tensors]
    cols = _batch_args(tensors)
    maps = (lowbit.kernel_table(True).data_ptr(), lowbit.kernel_table(False).data_ptr())
    bad = [list(c) for c in cols]
    bad[7][2] = 9  # tensor 2: no such param dtype
    with pytest.raises(ValueError, match="tensor 2: param dtype code must be 0"):
        _cpu.adam8bit_step_many(*bad[:8], *maps, *bad[8:], 2)
    bad = [list(c) for c in cols]
    bad[8][1] = b"short"
    with pytest.raises(ValueError, match="tensor 1: adam8bit takes a 48-byte scalar struct; got 5"):
        _cpu.adam8bit_step_many(*bad[:8], *maps, *bad[8:], 2)
    with pytest.raises(ValueError, match="one entry per tensor \\(3\\); got one of 2"):
        _cpu.adam8bit_step_many(*cols[:6], cols[6][:2], cols[7], *maps, *cols[8:], 2)
    for (p, _, st, _, _), (p0, st0) in zip(tensors, before):
        assert torch.equal(p, p0) and all(torch.equal(st[k], st0[k]) for k in st)


def test_optimizer_steps_its_cpu_8bit_tensors_in_one_call(monkeypatch):
    """AdamW8bit on CPU: one adam8bit_step_many call per step for all its contiguous 8-bit tensors,
    one backend call for the fp32-moment ones of a group, and the reference's numbers."""
    import mps_fused_adam as mfa
    calls = []

    class Counting:
        def __getattr__(self, name):
            fn = getattr(_cpu, name)
            return lambda *a, **k: (calls.append((name, len(a[0]) if name.endswith("_many") else 1)), fn(*a, **k))[1]

    monkeypatch.setattr(get_backend("cpu"), "_cpu", Counting())
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (300, 5000, 70000, 10, 20)]
    opt = mfa.AdamW8bit(params, lr=1e-2, min_8bit_size=256)
    refs = [[p.detach().clone(), fresh_state(p.numel())] for p in params[:3]]
    for step in (1, 2):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        calls.clear()
        opt.step()
        assert calls == [("adam8bit_step_many", 3), ("step", 1)]
        hp = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 1e-2, step)
        for r, g in zip(refs, grads):
            st = r[1]
            reference_adam8bit_(r[0], g, st["exp_avg_codes"], st["exp_avg_absmax"], st["exp_avg_sq_codes"],
                                st["exp_avg_sq_absmax"], hp, None)
    for p, r in zip(params, refs):
        assert torch.equal(p.detach(), r[0])
        assert torch.equal(opt.state[p]["exp_avg_codes"], r[1]["exp_avg_codes"])


def test_selfcheck_of_lowbit_rules_catches_a_wrong_kernel():
    """The low-bit self-check passes the CPU kernel bit for bit and fails a kernel that is off:
    an 8-bit step with another beta1 changes codes (no bound can pass that), a stochastic-rounding
    step rounding to nearest instead misses the bits."""
    from mps_fused_adam.backends import CPUBackend
    from mps_fused_adam.numerics.reference_lowbit import reference_adam8bit_
    from mps_fused_adam.tools.selfcheck import _lowbit, check_lowbit
    from mps_fused_adam.numerics.reference_lowbit import reference_adam4bit_
    good = list(check_lowbit(*_lowbit(CPUBackend()), "cpu", "_cpu", n=600))
    # 8-bit and 4-bit Adam per param dtype, then stochastic rounding per state dtype
    assert [r.dtypes.split(" ")[0] for r in good] == ["adam8bit"] * 3 + ["adam4bit"] * 3 + ["adam-sr"] * 2
    assert all(r.passed and r.bit_exact for r in good)

    def off_8bit(rule, p, g, st, hp, key):
        import dataclasses
        step = reference_adam8bit_ if rule == "adam8bit" else reference_adam4bit_
        suffix = "" if rule == "adam8bit" else "4"
        step(p, g, *(st[k + suffix] for k in ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes",
                                              "exp_avg_sq_absmax")), dataclasses.replace(hp, beta1=0.5), key)

    def nearest(p, g, m, v, hp, key):
        CPUBackend().update("adam", [p], [g], [[m], [v]], hp)

    bad = list(check_lowbit(off_8bit, nearest, "cpu", "wrong", n=600))
    assert len(bad) == 8
    assert not any(r.passed or r.bit_exact for r in bad[:6]), bad[:6]
    assert not any(r.bit_exact for r in bad[6:]), bad[6:]
