"""Kernel by kernel on the MPS tiers (backends/chain.py, backends/mps.py), end to end on CPU
tensors through the stand-ins of tests/support/emulated_mps.py (the shipped kernel source, emulated):

- a kernel whose pipeline cannot be built (a device without bfloat; any Metal error) is
  unavailable at that tier with the reason, and only the tensors that need it go to the next tier;
- every kernel is probed against the reference before its first real dispatch: one that raises,
  computes wrong values or NaN is refused there, before any real tensor reaches it, and its
  tensors get the next tier's result.
"""
from __future__ import annotations

import struct
import warnings

import pytest
import torch

import mps_fused_adam as mfa
from emulated_mps import FakeMetalExt, FakeMpsApi, make_backend, make_chain
from mps_fused_adam import backends
from mps_fused_adam.backends import Kernel
from mps_fused_adam.backends.chain import CHOSEN, FAILED, LOADED, NOT_TRIED
from mps_fused_adam.backends.mps import BASE_KERNEL, KERNELS, METALLIB_NAME, PROBE_ELEMENTS, kernel_name
from mps_fused_adam.numerics.contract import RULES, element_rules

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.dtype is not torch.uint8 else t


def params_of_each_dtype(seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(d))
            for s, d in (((33, 7), F32), ((4097,), F16), ((5,), BF16), ((300,), BF16))]


def train(backend, monkeypatch, params, steps=3, cls=mfa.AdamW, **kw):
    """``steps`` steps of ``cls`` over ``params`` with ``backend`` serving CPU tensors."""
    monkeypatch.setitem(backends._chosen, "cpu", backend)
    torch.manual_seed(0)  # the stochastic-rounding seeds come from torch's generator
    opt = cls(params, lr=1e-2, weight_decay=0.1, **kw)
    gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
    return opt


def train_8bit(backend, params, steps=3, sr=False, rule="adam8bit"):
    """``steps`` 8-bit AdamW steps of each param straight through ``backend.update`` (rule
    ``adam8bit``: codes and block scales of both moments; ``sr_keys`` for bf16 stochastic
    rounding), from zero states; returns the states. ``rule="adam4bit"``: the same with 4-bit
    states (codes packed two a byte, blocks of 128)."""
    from mps_fused_adam.numerics import lowbit, lowbit4
    from mps_fused_adam.numerics.contract import AdamHyper
    gen = torch.Generator().manual_seed(4)
    states = []
    for p in params:
        n = p.numel()
        if rule == "adam8bit":
            nb = lowbit.num_blocks(n)
            codes = [torch.full((n,), lowbit.SIGNED_ZERO_CODE, dtype=torch.uint8),
                     torch.full((n,), lowbit.UNSIGNED_ZERO_CODE, dtype=torch.uint8)]
        else:
            nb, codes = lowbit4.num_blocks4(n), [lowbit4.fresh_codes4(n, True), lowbit4.fresh_codes4(n, False)]
        states.append([codes[0], torch.zeros(nb), codes[1], torch.zeros(nb)])
    for step in range(1, steps + 1):
        hp = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, step)
        for i, (p, st) in enumerate(zip(params, states)):
            keys = [lowbit.sr_key(1000 + i, step)] if sr and p.dtype is BF16 else None
            g = torch.randn(p.shape, generator=gen).to(p.dtype)
            backend.update(rule, [p.data.view(-1)], [g.view(-1)], [[t] for t in st], hp, sr_keys=keys)
    return states


def same_training(a, b):
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def fresh(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def reference_result(emu, pkg, monkeypatch, params, **kw):
    """The same training through the plain foreach tier (bit-exact with the reference on CPU)."""
    out = fresh(params)
    train(backends.ForeachBackend(), monkeypatch, out, **kw)
    return out


def test_device_without_bfloat_keeps_fp32_and_fp16_on_tier1(emu, pkg, monkeypatch):
    """A device whose bfloat pipelines do not build: the fp32 and fp16 tensors still run on
    tier 1, the bf16 ones on tier 2, every result is the reference's, and backend_info() says
    which kernels tier 1 refuses and why."""
    ext = FakeMetalExt(emu, bfloat=False)
    chain = make_chain(pkg, emu, ext=ext)
    assert chain.name == "metal"
    start = params_of_each_dtype()
    params = fresh(start)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monkeypatch.setitem(backends._chosen, "cpu", chain)
        opt = mfa.AdamW(params, lr=1e-2, weight_decay=0.1)
        for _ in range(2):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
    routes = chain.routes()
    assert routes == {"adam float32/float32": "metal", "adam float16/float16": "metal",
                      "adam bfloat16/bfloat16": "load_metallib"}, routes
    assert not any("bfloat" in c[0] for c in ext.calls), "a bfloat kernel reached the device without bfloat"
    moved = [m for m in map(str, (w.message for w in caught)) if "runs on torch.mps.load_metallib" in m]
    assert len(moved) == 1 and "adam bfloat16/bfloat16" in moved[0] and "does not support bfloat" in moved[0]
    want = fresh(start)
    opt2 = train(backends.ForeachBackend(), monkeypatch, want, steps=0)
    for _ in range(2):
        for p in want:
            p.grad = torch.ones_like(p)
        opt2.step()
    assert same_training(params, want)

    monkeypatch.setitem(backends._chosen, "mps", chain)
    info = backends.backend_info()["mps"]
    assert info["backend"] == "metal" and info["unavailable"] == []
    assert [(t["tier"], t["state"]) for t in info["tiers"]] == [
        ("_metal extension", CHOSEN), ("torch.mps.load_metallib", LOADED),
        ("torch.mps.compile_shader", NOT_TRIED), ("foreach tier", NOT_TRIED)]
    refused = info["kernels_unavailable"]["_metal extension"]
    bf16_kernels = sorted(f"{k.rule} {str(k.param_dtype)[6:]}/{str(k.state_dtype)[6:]}"
                          for k in KERNELS if k.param_dtype is BF16)
    assert sorted(refused) == bf16_kernels
    assert all("its pipeline was not built" in why and "does not support bfloat" in why for why in refused.values())
    assert "torch.mps.load_metallib" not in info["kernels_unavailable"]
    assert info["routes"] == routes


def test_failing_pipeline_costs_only_its_kernel(emu, pkg, monkeypatch):
    """Any Metal error building one pipeline: that kernel runs on the next tier, with Metal's
    text as the reason; everything else stays on tier 1."""
    name = kernel_name("adam", F16, F16)
    ext = FakeMetalExt(emu, failing={name: "Compiler encountered an internal error"})
    chain = make_chain(pkg, emu, ext=ext)
    start = params_of_each_dtype()
    params = fresh(start)
    train(chain, monkeypatch, params)
    assert chain.tier_of(Kernel("adam", F16, F16)) == "load_metallib"
    assert chain.tier_of(Kernel("adam", F32, F32)) == chain.tier_of(Kernel("adam", BF16, BF16)) == "metal"
    assert chain.unavailable(Kernel("adam", F16, F16)) is None  # tier 2 runs it
    why = chain.tiers_info()[0]["kernels_unavailable"]["adam float16/float16"]
    assert f"cannot build the pipeline of {name}: Compiler encountered an internal error" in why
    assert not any(c[0] == name for c in ext.calls)
    assert same_training(params, reference_result(emu, pkg, monkeypatch, start))


class Sabotaged(FakeMetalExt):
    """A ``_metal`` stand-in whose one kernel ``target`` misbehaves: raises, writes values that
    are off (a scalar struct with beta1 scaled) or NaN (beta1 NaN); every call is recorded."""

    def __init__(self, emu, target: str, how: str) -> None:
        super().__init__(emu)
        self.target, self.how = target, how

    def step(self, kernel_name, tensors, scalars):
        if kernel_name == self.target:
            if self.how == "raise":
                self.calls.append((kernel_name, tensors, scalars))
                raise RuntimeError("stand-in: the command buffer failed (kIOGPUCommandBufferCallbackErrorTimeout)")
            beta1 = struct.unpack_from("<f", scalars)[0]
            scalars = struct.pack("<f", float("nan") if self.how == "nan" else beta1 * 0.5) + scalars[4:]
        super().step(kernel_name, tensors, scalars)


@pytest.mark.parametrize("how,reason", [("raise", "failed: RuntimeError('stand-in: the command buffer failed"),
                                        ("wrong", "away from the reference (the contract's bound"),
                                        ("nan", "NaN at")])
@pytest.mark.parametrize("target", [Kernel("adam", BF16, BF16), Kernel("adam8bit", F32, torch.uint8),
                                    Kernel("adam4bit", F32, torch.uint8)],
                         ids=["adam-bf16", "adam8bit-fp32", "adam4bit-fp32"])
def test_kernel_failing_its_probe_is_refused_before_any_param_moves(emu, pkg, monkeypatch, how, reason, target):
    """A kernel that raises, computes wrong values or NaN on tier 1 is refused by its probe
    before its first real dispatch: no real tensor is ever handed to it, and its tensors get
    tier 2's result (which is the reference's); the other kernels stay on tier 1."""
    name = kernel_name(*target)
    ext = Sabotaged(emu, name, how)
    chain = make_chain(pkg, emu, ext=ext)
    gen = torch.Generator().manual_seed(7)
    start = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d))
             for s, d in (((64, 80), target.param_dtype), ((300,), F32), ((301,), BF16))]
    params = fresh(start)
    eight = target.rule in ("adam8bit", "adam4bit")  # the block-wise rules, stepped directly
    if eight:
        got = train_8bit(chain, params, rule=target.rule)
    else:
        train(chain, monkeypatch, params)
    assert chain.tier_of(target) == "load_metallib"
    why = chain.tiers_info()[0]["kernels_unavailable"][f"{target.rule} {str(target.param_dtype)[6:]}/" +
                                                       str(target.state_dtype)[6:]]
    assert "first-use probe" in why and reason in why, why
    # A real dispatch carries its param, alive from before the first step (a state may reuse the
    # memory of a probe's freed tensors: the optimizers prepare their kernels before making states).
    real = {p.untyped_storage().data_ptr() for p in params}
    touched = [c for c in ext.calls if c[0] == name and any(h in real for lst in c[1] for h, _, _ in lst)]
    assert touched == [] and any(c[0] == name for c in ext.calls)  # probed, never used for real
    assert any(c[0] != name for c in ext.calls)  # the rest stayed on tier 1
    # The result is the next tier's: tier 2 alone, from the same start.
    other, ref = fresh(start), fresh(start)
    if eight:
        assert all(same_training(a, b) for a, b in zip(got, train_8bit(make_backend(2, pkg, emu), other,
                                                                        rule=target.rule)))
        assert all(same_training(a, b) for a, b in zip(got, train_8bit(backends.ForeachBackend(), ref,
                                                                        rule=target.rule)))
    else:
        train(make_backend(2, pkg, emu), monkeypatch, other)
        train(backends.ForeachBackend(), monkeypatch, ref)
    assert same_training(params, other) and same_training(params, ref)


def test_prepare_routes_a_refused_kernel_before_anything_is_encoded(emu, pkg):
    """prepare() of a step's kernels (what the optimizers call before the first update) probes
    and routes every one of them first: after it the step's updates run, none of them fails, and
    the refused kernel's tensors go to the next tier."""
    ext = Sabotaged(emu, kernel_name("adam", F16, F16), "wrong")
    chain = make_chain(pkg, emu, ext=ext)
    keys = [Kernel("adam", F32, F32), Kernel("adam", F16, F16), Kernel("lion", BF16, F32)]
    chain.prepare(keys)
    assert [chain.tier_of(k) for k in keys] == ["metal", "load_metallib", "metal"]
    before = len(emu.dispatches)
    chain.prepare(keys)  # fixed once: no more probes
    assert len(emu.dispatches) == before


def test_raw_tier_refuses_in_prepare_and_leaves_tensors_alone(emu, pkg):
    """A tier on its own (the Backend protocol): prepare() probes, refuses the failing kernel
    with its reason in unavailable(), and raises naming it, before any of the caller's tensors is
    written."""
    ext = Sabotaged(emu, kernel_name("adagrad", F32, F32), "nan")
    tier = make_backend(1, pkg, emu, ext=ext, probe_all=False)
    k = Kernel("adagrad", F32, F32)
    assert tier.unavailable(k) is None  # not yet probed
    with pytest.raises(RuntimeError, match=r"adagrad float32/float32: its first-use probe .* gave a param NaN"):
        tier.prepare([Kernel("lion", F32, F32), k])
    assert "NaN" in tier.unavailable(k) and tier.unavailable(Kernel("lion", F32, F32)) is None
    assert tier.unavailable(Kernel("adam", F32, torch.float64)) == "the Metal kernels have no adam float32/torch.float64 form"


def test_base_kernel_failing_its_probe_refuses_the_tier(emu, pkg):
    """Tier 1 whose fp32 Adam kernel fails its probe is refused as a whole (a tier that cannot
    run its first kernel is not used at all), with the reason in backend_info's ``unavailable``."""
    ext = Sabotaged(emu, KERNELS[BASE_KERNEL], "wrong")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chain = make_chain(pkg, emu, ext=ext, device_type="mps-test")
    backends._reasons.pop("mps-test", None)
    assert chain.name == "load_metallib"
    assert chain.tiers_info()[0]["state"] == FAILED
    assert "first-use probe" in chain.tiers_info()[0]["reason"] and len(caught) == 1


def test_library_without_bfloat_kernels_serves_the_rest(emu, pkg, monkeypatch):
    """A library compiled without Metal 3.1 (no bfloat kernels): tier 3 runs everything else,
    each bfloat kernel is unavailable there with the reason, and bf16 tensors run on foreach."""
    src = pkg / "metal" / "fused_adam.metal"
    src.write_text(src.read_text().replace("#if __METAL_VERSION__ >= 310\nFUSED_KERNELS_BFLOAT(",
                                           "#if 0\nFUSED_KERNELS_BFLOAT("))
    (pkg / METALLIB_NAME).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chain = make_chain(pkg, emu, device_type="mps-test")
    backends._reasons.pop("mps-test", None)
    assert chain.name == "compile_shader"
    refused = chain.tiers_info()[2]["kernels_unavailable"]
    missing = sorted([f"{rule} bfloat16/{s}" for rule in [*element_rules(), "adam_sr"] for s in ("bfloat16", "float32")]
                     + ["adam8bit bfloat16/uint8", "adam4bit bfloat16/uint8"])
    assert sorted(refused) == missing
    assert refused["adam bfloat16/float32"] == "the library lacks kernel fused_adam_bfloat_float"
    start = params_of_each_dtype()
    params = fresh(start)
    train(chain, monkeypatch, params)
    assert chain.routes() == {"adam float32/float32": "compile_shader", "adam float16/float16": "compile_shader",
                              "adam bfloat16/bfloat16": "foreach"}
    assert same_training(params, reference_result(emu, pkg, monkeypatch, start))


def test_every_kernel_passes_its_probe_on_every_emulated_tier(emu, pkg):
    """The probes themselves: each kernel of KERNELS (every rule, dtype pair, 8-bit and stochastic
    rounding) passes on the emulated tiers, so a refusal means the kernel, not the probe."""
    for tier in (1, 2, 3):
        backend = make_backend(tier, pkg, emu, probe_all=False)
        backend.prepare(KERNELS)
        assert backend.kernels_unavailable() == {}


@pytest.mark.parametrize("rule", ["adam8bit", "adam4bit"])
def test_lowbit_through_the_chain_matches_the_references(emu, pkg, rule):
    """8-bit and 4-bit Adam with bf16 stochastic rounding through the chain on a device without
    bfloat: the fp32 kernel on tier 1, the bf16 one on tier 2; results those of the plain tier 2
    and of the references (the foreach tier)."""
    chain = make_chain(pkg, emu, ext=FakeMetalExt(emu, bfloat=False))
    gen = torch.Generator().manual_seed(9)
    start = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d))
             for s, d in (((64, 80), BF16), ((4097,), F32), ((7,), BF16))]
    params, other, ref = fresh(start), fresh(start), fresh(start)
    got = train_8bit(chain, params, sr=True, rule=rule)
    assert all(same_training(a, b) for a, b in zip(got, train_8bit(make_backend(2, pkg, emu), other, sr=True,
                                                                    rule=rule)))
    assert all(same_training(a, b) for a, b in zip(got, train_8bit(backends.ForeachBackend(), ref, sr=True,
                                                                    rule=rule)))
    assert same_training(params, other) and same_training(params, ref)
    assert chain.tier_of(Kernel(rule, F32, torch.uint8)) == "metal"
    assert chain.tier_of(Kernel(rule, BF16, torch.uint8)) == "load_metallib"


def test_selfcheck_prints_every_tier_with_its_state(emu, pkg):
    """The self-check's tier lines: one per tier, loaded or not and why, with the kernels it
    refuses; its cases skip the refused kernels (their line reports them) and pass on the rest."""
    from mps_fused_adam.backends.mps import mps_tiers
    from mps_fused_adam.tools.selfcheck import check_backend, mps_tier_states, tier_lines
    api = FakeMpsApi(emu)
    api.load_metallib = None  # a torch without it
    tiers = mps_tiers(load_ext=lambda: FakeMetalExt(emu, bfloat=False), mps_api=api, package_dir=pkg,
                      probe_device="cpu")
    lines = tier_lines(tiers)
    total, bf16 = len(KERNELS), sum(k.param_dtype is BF16 for k in KERNELS)
    assert len(lines) == 3, lines
    assert lines[0].startswith(f"  tier 1 _metal extension: loaded, runs {total - bf16} of {total} kernels; "
                               f"refuses adagrad bfloat16/bfloat16 and {bf16 - 1} more: its pipeline was not built")
    assert lines[1].startswith("  tier 2 torch.mps.load_metallib: not loaded: RuntimeError: torch ")
    assert "has no torch.mps.load_metallib" in lines[1]
    assert lines[2] == f"  tier 3 torch.mps.compile_shader: loaded, runs all {total} kernels"
    assert all(len(line) < 240 for line in lines)
    tier1 = mps_tier_states(tiers)[0]
    results = list(filter(tier1.runs, check_backend(tier1.backend, "cpu", tier1.label, n=300)))
    assert [r.dtypes for r in results if "bfloat16" in r.dtypes] == []
    assert len(results) == 3 * 3 and all(r.passed for r in results), results


def test_optimizer_step_probes_every_kernel_before_encoding_any(emu, pkg, monkeypatch):
    """The optimizers prepare a step's kernels before its first update (issue 34's one base):
    on the chain every probe of the first step comes before any real dispatch, so a refused
    kernel reroutes its tensors before anything of the step is encoded. AdamW8bit with bf16
    stochastic rounding on a device without bfloat: the result is the plain tier 2's."""
    ext = Sabotaged(emu, kernel_name("adam8bit", F16, torch.uint8), "wrong")
    ext.bfloat = False
    chain = make_chain(pkg, emu, ext=ext)
    gen = torch.Generator().manual_seed(12)
    start = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d))
             for s, d in (((64, 80), F32), ((40, 30), F16), ((50, 20), BF16), ((7,), BF16))]
    params, other = fresh(start), fresh(start)
    kw = dict(cls=mfa.AdamW8bit, min_8bit_size=256, bf16_stochastic_round=True)
    ext.calls.clear()
    train(chain, monkeypatch, params, steps=1, **kw)
    sizes = [lst[0][2] for c in ext.calls for lst in c[1][:1]]
    real = [i for i, n in enumerate(sizes) if n != PROBE_ELEMENTS]
    assert real and max(i for i, n in enumerate(sizes) if n == PROBE_ELEMENTS) < real[0], sizes
    train(chain, monkeypatch, params, steps=2, **kw)
    train(make_backend(2, pkg, emu), monkeypatch, other, steps=1, **kw)
    train(make_backend(2, pkg, emu), monkeypatch, other, steps=2, **kw)
    assert same_training(params, other)
    assert chain.tier_of(Kernel("adam8bit", F32, torch.uint8)) == "metal"
    assert chain.tier_of(Kernel("adam8bit", F16, torch.uint8)) == "load_metallib"
    assert chain.tier_of(Kernel("adam8bit", BF16, torch.uint8)) == "load_metallib"
