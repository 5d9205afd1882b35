"""The optimizer classes driving the Metal tiers: each tier of mps_backends, its Apple pieces
replaced by stand-ins that run the shipped kernel source (tests/support/emulated_mps.py), is installed as
the backend for CPU tensors, so optimizer -> validation -> bucketing -> Metal dispatch runs end to
end with real numbers. Bad input must be rejected before anything is encoded."""
from __future__ import annotations

import pytest
import torch

import mps_fused_adam as mfa
from emulated_mps import FakeMetalExt, make_backend
from mps_fused_adam import backends
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference import reference_adam_


@pytest.fixture(params=[1, 2, 3], ids=["tier1-_metal", "tier2-load_metallib", "tier3-compile_shader"])
def metal_backend(request, monkeypatch, emu, pkg):
    ext = FakeMetalExt(emu)
    backend = make_backend(request.param, pkg, emu, ext=ext)
    monkeypatch.setitem(backends._chosen, "cpu", backend)
    return backend, ext


def mixed_params():
    gen = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float32]
    sizes = [(33, 7), (4097,), (5,), (1,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in zip(sizes, dtypes)]


@pytest.mark.parametrize("cls,kwargs,mode", [
    (mfa.AdamW, dict(lr=1e-2, weight_decay=0.1), dict()),
    (mfa.Adam, dict(lr=1e-2, weight_decay=0.1, maximize=True), dict(adam_w_mode=False, maximize=True)),
    (mfa.FusedAdam, dict(lr=1e-2, bias_correction=False, weight_decay=0.1), dict(bias_correction=False)),
])
def test_optimizer_through_metal_tier_matches_reference(metal_backend, cls, kwargs, mode):
    backend, ext = metal_backend
    params = mixed_params()
    refs = [[p.detach().clone(), None, torch.zeros_like(p), torch.zeros_like(p)] for p in params]
    opt = cls([{"params": params[:2]}, {"params": params[2:], "lr": 3e-2}], **kwargs)
    gen = torch.Generator().manual_seed(4)
    for step in (1, 2, 3):
        for p, r in zip(params, refs):
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            r[1] = p.grad.clone()
        opt.step()
        for i, r in enumerate(refs):
            lr = 3e-2 if i >= 2 else kwargs["lr"]
            reference_adam_(*r, AdamHyper(lr, 0.9, 0.999, 1e-8, 0.1, step, **mode))
    for p, r in zip(params, refs):
        assert torch.equal(p.detach().view(torch.uint8), r[0].view(torch.uint8)), p.dtype
        assert torch.equal(opt.state[p]["exp_avg_sq"], r[3])
    if backend.name == "metal":
        # One _metal call per group and dtype pair (4 buckets), never one per tensor.
        assert len(ext.calls) == 3 * 4


def test_l2_mode_without_weight_decay_keeps_infinite_params_finite_moments(metal_backend):
    """Adam's L2 term is skipped at weight_decay=0 (torch does so), through every Metal tier."""
    p = torch.nn.Parameter(torch.tensor([float("inf"), -float("inf"), 1.5, -2.0]))
    ref = [p.detach().clone(), None, torch.zeros(4), torch.zeros(4)]
    opt = mfa.Adam([p], lr=1e-2, weight_decay=0.0)
    for step in (1, 2):
        p.grad = torch.tensor([0.25, -0.5, 0.125, 1.0])
        ref[1] = p.grad.clone()
        opt.step()
        reference_adam_(*ref, AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, step, adam_w_mode=False))
    st = opt.state[p]
    assert torch.equal(p.detach(), ref[0]) and torch.equal(st["exp_avg"], ref[2])
    assert p[0] == float("inf") and torch.isfinite(st["exp_avg"]).all() and torch.isfinite(st["exp_avg_sq"]).all()


def test_bad_input_rejected_before_anything_is_encoded(metal_backend):
    backend, ext = metal_backend
    params = mixed_params()
    opt = mfa.AdamW(params)
    for p in params:
        p.grad = torch.randn(p.shape).to(p.dtype)
    opt.step()
    calls_before = len(ext.calls)
    before = [p.detach().clone() for p in params]
    params[3].grad_dtype = None
    params[3].grad = torch.randn(1).half()  # the last tensor is bad: the others must not move
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[3\].*grad dtype torch.float16"):
        opt.step()
    assert len(ext.calls) == calls_before
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(opt.state[p]["step"] == 1 for p in params)


@pytest.mark.parametrize("cls", [mfa.AdamW, mfa.FusedAdam])
def test_bf16_stochastic_rounding_through_metal_tier_matches_reference(metal_backend, emu, cls):
    """bf16_stochastic_round on a Metal tier: fused_adam_sr_bfloat_* once per bf16 tensor (each
    has its own key), bit for bit the reference; other dtypes of the group keep the Adam kernel."""
    from mps_fused_adam.numerics import lowbit
    from mps_fused_adam.numerics.reference_lowbit import reference_adam_sr_
    backend, ext = metal_backend
    gen = torch.Generator().manual_seed(8)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d))
              for s, d in (((33, 7), torch.bfloat16), ((4097,), torch.bfloat16), ((5,), torch.float32))]
    params.append(torch.nn.Parameter(torch.randn(40, 6, generator=gen).bfloat16().t()))  # non-contiguous
    refs = [[p.detach().clone(), None, torch.zeros_like(p), torch.zeros_like(p)] for p in params]
    opt = cls(params, lr=1e-2, weight_decay=0.1, bf16_stochastic_round=True)
    before = len(emu.dispatches)
    for step in (1, 2, 3):
        for p, r in zip(params, refs):
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            r[1] = p.grad.clone()
        opt.step()
        for p, r in zip(params, refs):
            hp = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, step, adam_w_mode=True)
            key = lowbit.sr_key(opt.state[p]["sr_seed"], step) if p.dtype is torch.bfloat16 else None
            reference_adam_sr_(*r, hp, key)
    for p, r in zip(params, refs):
        assert torch.equal(p.detach().contiguous().view(torch.uint8), r[0].contiguous().view(torch.uint8)), p.dtype
        assert torch.equal(opt.state[p]["exp_avg_sq"], r[3])
    # Every tier ran the stochastic-rounding kernel for the three bf16 tensors at each step.
    assert sum(d["name"] == "fused_adam_sr_bfloat_bfloat" for d in emu.dispatches[before:]) == 3 * 3
    if backend.name == "metal":
        names = [c[0] for c in ext.calls]
        assert names.count("fused_adam_sr_bfloat_bfloat") == 3 * 3 and "fused_adam_float_float" in names


@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
def test_adamw8bit_through_metal_tier_matches_reference(metal_backend, emu, sr):
    """AdamW8bit on a Metal tier: fused_adam8bit_*_uchar per 8-bit tensor (one dispatch each),
    the Adam kernels for a tensor under min_8bit_size; bit for bit the references."""
    from mps_fused_adam.numerics import lowbit
    from mps_fused_adam.numerics.reference_lowbit import reference_adam8bit_, reference_adam_sr_
    gen = torch.Generator().manual_seed(9)
    shapes = (((64, 80), torch.bfloat16), ((4097,), torch.float32), ((300,), torch.float16), ((7,), torch.bfloat16))
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in shapes]
    params.append(torch.nn.Parameter(torch.randn(90, 50, generator=gen).bfloat16().t()))  # non-contiguous
    opt = mfa.AdamW8bit(params, lr=1e-2, weight_decay=0.1, min_8bit_size=256, bf16_stochastic_round=sr)
    before = len(emu.dispatches)
    refs = None
    for step in (1, 2, 3):
        grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
        if refs is None:  # the reference states are made after the first step, in the states' layout
            refs = [[p.detach().clone()] for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        hp = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, step, adam_w_mode=True)
        for p, g, r in zip(params, grads, refs):
            st = opt.state[p]
            key = lowbit.sr_key(st["sr_seed"], step) if sr and p.dtype is torch.bfloat16 else None
            if step == 1:  # the states a first step starts from
                if "exp_avg_codes" in st:
                    r += [torch.full_like(st["exp_avg_codes"], lowbit.SIGNED_ZERO_CODE),
                          torch.zeros_like(st["exp_avg_absmax"]),
                          torch.full_like(st["exp_avg_sq_codes"], lowbit.UNSIGNED_ZERO_CODE),
                          torch.zeros_like(st["exp_avg_sq_absmax"])]
                else:
                    r += [torch.zeros(p.shape), torch.zeros(p.shape)]
            if len(r) == 5:
                reference_adam8bit_(r[0], g, *r[1:], hp, key)
            else:
                reference_adam_sr_(r[0], g, r[1], r[2], hp, key)
    for p, r in zip(params, refs):
        st = opt.state[p]
        assert torch.equal(p.detach().contiguous().view(torch.uint8), r[0].contiguous().view(torch.uint8)), p.shape
        if "exp_avg_codes" in st:
            assert torch.equal(st["exp_avg_codes"], r[1]) and torch.equal(st["exp_avg_sq_absmax"], r[4])
    names = [d["name"] for d in emu.dispatches[before:]]
    assert sum(n.startswith("fused_adam8bit_") for n in names) == 3 * 4
    if sr:
        assert names.count("fused_adam_sr_bfloat_float") == 3  # the small bf16 tensor


def test_selfcheck_of_lowbit_rules_on_each_tier(metal_backend):
    """``python -m mps_fused_adam``'s low-bit self-check on a Metal tier (here its emulation):
    8-bit Adam, bf16 stochastic rounding and 4-bit Adam, bit for bit the references."""
    from mps_fused_adam.tools.selfcheck import _lowbit, check_lowbit
    backend, _ = metal_backend
    results = list(check_lowbit(*_lowbit(backend), "cpu", "tier", n=600))
    assert [r.dtypes for r in results] == ["adam8bit float32/uint8", "adam8bit float16/uint8", "adam8bit bfloat16/uint8",
                                           "adam4bit float32/uint8", "adam4bit float16/uint8", "adam4bit bfloat16/uint8",
                                           "adam-sr bfloat16/float32", "adam-sr bfloat16/bfloat16"]
    assert all(r.passed and r.bit_exact for r in results), results


@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
def test_adamw4bit_through_metal_tier_matches_reference(metal_backend, emu, sr):
    """AdamW4bit on a Metal tier: fused_adam4bit_*_uchar per 4-bit tensor (one dispatch each; odd
    sizes, a non-contiguous param), the Adam kernels for a tensor under min_4bit_size; bit for bit
    the references."""
    from mps_fused_adam.numerics import lowbit, lowbit4
    from mps_fused_adam.numerics.reference_lowbit import reference_adam4bit_, reference_adam_sr_
    gen = torch.Generator().manual_seed(10)
    shapes = (((63, 81), torch.bfloat16), ((4097,), torch.float32), ((301,), torch.float16), ((7,), torch.bfloat16))
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in shapes]
    params.append(torch.nn.Parameter(torch.randn(90, 51, generator=gen).bfloat16().t()))  # non-contiguous
    opt = mfa.AdamW4bit(params, lr=1e-2, weight_decay=0.1, min_4bit_size=256, bf16_stochastic_round=sr)
    names4 = ("exp_avg_codes4", "exp_avg_absmax4", "exp_avg_sq_codes4", "exp_avg_sq_absmax4")
    before = len(emu.dispatches)
    refs = [[p.detach().clone()] for p in params]
    for p, r in zip(params, refs):  # the states a first step starts from
        n = p.numel()
        if n >= 256:
            nb = lowbit4.num_blocks4(n)
            r += [lowbit4.fresh_codes4(n, True), torch.zeros(nb), lowbit4.fresh_codes4(n, False), torch.zeros(nb)]
        else:
            r += [torch.zeros(p.shape), torch.zeros(p.shape)]
    for step in (1, 2, 3):
        grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        hp = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, step, adam_w_mode=True)
        for p, g, r in zip(params, grads, refs):
            key = lowbit.sr_key(opt.state[p]["sr_seed"], step) if sr and p.dtype is torch.bfloat16 else None
            if len(r) == 5:
                reference_adam4bit_(r[0], g, *r[1:], hp, key)
            else:
                reference_adam_sr_(r[0], g, r[1], r[2], hp, key)
    for p, r in zip(params, refs):
        st = opt.state[p]
        assert torch.equal(p.detach().contiguous().view(torch.uint8), r[0].contiguous().view(torch.uint8)), p.shape
        if len(r) == 5:
            for name, want in zip(names4, r[1:]):
                assert torch.equal(st[name], want), (p.shape, name)
    names = [d["name"] for d in emu.dispatches[before:]]
    assert sum(n.startswith("fused_adam4bit_") for n in names) == 3 * 4
    if sr:
        assert names.count("fused_adam_sr_bfloat_float") == 3  # the small bf16 tensor
