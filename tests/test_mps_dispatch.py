"""The Python dispatch of MPS tiers 1-3 (backends/mps.py), end to end on CPU tensors.

The stand-ins of tests/support/emulated_mps.py take the place of the ``_metal`` extension and of torch's
ShaderLibrary and run the shipped kernel source through the host emulator, so argument packing,
grid sizes, kernel choice and fallbacks are exercised with the real dispatch code and real numbers.
"""
from __future__ import annotations

import inspect
import struct
import sys
import warnings

import pytest
import torch

from conftest import choose_backend_afresh
from emulated_mps import METAL_SOURCE, FakeMetalExt, FakeMpsApi, make_backend
from mps_fused_adam import backends
from mps_fused_adam.numerics.contract import AdamHyper, adam_scalars
from mps_fused_adam.backends.mps import (KERNELS, MAX_THREADS_PER_DISPATCH, METALLIB_NAME, ShaderLibraryBackend, dispatch_plan, find_metal_source, mps_tiers, pack_params, params_as_words)
from mps_fused_adam.numerics.reference import reference_adam_

PAIRS = [(p, s) for rule, p, s in KERNELS if rule == "adam"]
PAIR_IDS = [KERNELS[("adam", *p)].removeprefix("fused_adam_") for p in PAIRS]




def hyper(step, **kw):
    base = dict(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, step=step)
    base.update(kw)
    return AdamHyper(**base)


def group_tensors(pdtype, sdtype, sizes=(1, 5, 4097, 3, 64), seed=0):
    """Params as views into one flat buffer at odd offsets (as DeepSpeed's flat groups are), so
    storage offsets and unaligned starts are part of every test."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes) + len(sizes)
    flat = {k: torch.randn(total, generator=gen) for k in ("p", "g", "m", "v")}
    flat = {"p": flat["p"].to(pdtype), "g": flat["g"].to(pdtype),
            "m": (0.1 * flat["m"]).to(sdtype), "v": (0.01 * flat["v"].abs()).to(sdtype)}
    out = {k: [] for k in flat}
    off = 1
    for n in sizes:
        for k in flat:
            out[k].append(flat[k][off:off + n])
        off += n + 1
    return out


def clone_group(t):
    return {k: [x.clone() for x in v] for k, v in t.items()}


def bits_equal(a, b):
    view = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def run_steps(backend, t, steps=3, **mode):
    for step in range(1, steps + 1):
        backend.update("adam", t["p"], t["g"], [t["m"], t["v"]], hyper(step, **mode))


def run_reference(t, steps=3, **mode):
    for step in range(1, steps + 1):
        for p, g, m, v in zip(t["p"], t["g"], t["m"], t["v"]):
            reference_adam_(p, g, m, v, hyper(step, **mode))


@pytest.mark.parametrize("mode", [dict(adam_w_mode=True), dict(adam_w_mode=False, maximize=True),
                                  dict(adam_w_mode=True, bias_correction=False)],
                         ids=["adamw", "l2-max", "adamw-nobc"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_tiers_agree_bit_for_bit_with_reference(emu, pkg, pair, mode):
    start = group_tensors(*pair, seed=PAIRS.index(pair))
    want = clone_group(start)
    run_reference(want, **mode)
    for tier in (1, 2, 3):
        got = clone_group(start)
        backend = make_backend(tier, pkg, emu)
        run_steps(backend, got, **mode)
        for k in want:
            for a, b in zip(got[k], want[k]):
                assert bits_equal(a, b), f"tier {tier} ({backend.name}) {k} differs"


def test_tier1_arguments(emu, pkg):
    ext = FakeMetalExt(emu)
    backend = make_backend(1, pkg, emu, ext=ext)
    assert backend.name == "metal" and ext.loaded == [str(pkg / METALLIB_NAME)]
    t = group_tensors(torch.bfloat16, torch.float32)
    hp = hyper(7, adam_w_mode=False, maximize=True)
    backend.update("adam", t["p"], t["g"], [t["m"], t["v"]], hp)
    assert len(ext.calls) == 1  # one call per group
    name, lists, packed = ext.calls[0]
    assert name == "fused_adam_bfloat_float" and len(lists) == 4
    for triples, tensors in zip(lists, (t["p"], t["g"], t["m"], t["v"])):
        for (handle, offset, n), x in zip(triples, tensors):
            assert handle == x.untyped_storage().data_ptr()
            assert offset == x.storage_offset() * x.element_size() and offset > 0
            assert n == x.numel()
    # The bytes are the contract's scalars in order: 9 fp32 then two uint32 flags.
    unpacked = struct.unpack("<9f2I", packed)
    assert unpacked == tuple(adam_scalars(hp))
    assert unpacked[-2:] == (0, 1)
    # Grid: one dispatch per tensor, 4 elements per thread, groups of at most 256.
    got = [(d["threads"], d["group"], d["base"], d["n"]) for d in emu.dispatches[-5:]]
    assert got == [(1, 1, 0, 1), (2, 2, 0, 5), (1025, 256, 0, 4097), (1, 1, 0, 3), (16, 16, 0, 64)]


@pytest.mark.parametrize("tier", [2, 3])
def test_library_tier_arguments(emu, pkg, tier):
    api = FakeMpsApi(emu)
    backend = make_backend(tier, pkg, emu, api=api)
    assert backend.name == {2: "load_metallib", 3: "compile_shader"}[tier]
    if tier == 2:
        assert api.loaded_paths == [str(pkg / METALLIB_NAME)]
    else:  # tier 3 compiles the bundled source text it read, unmodified
        assert api.compiled_sources == [(pkg / "metal" / "fused_adam.metal").read_text()]
    t = group_tensors(torch.float16, torch.float16, sizes=(4097, 5))
    hp = hyper(2)
    emu.dispatches.clear()
    backend.update("adam", t["p"], t["g"], [t["m"], t["v"]], hp)
    d = emu.dispatches
    assert [x["name"] for x in d] == ["fused_adam_half_half"] * 2
    assert [(x["threads"], x["group"], x["base"], x["n"]) for x in d] == [(1025, 256, 0, 4097), (2, 2, 0, 5)]
    # The int64 words that torch binds with setBytes carry the struct byte for byte.
    assert d[0]["hyper"][:44] == pack_params(hp) and len(d[0]["hyper"]) == 48
    assert d[0]["addrs"][0] == t["p"][0].data_ptr()


def test_params_as_words_round_trip():
    packed = pack_params(hyper(3, maximize=True))
    words = params_as_words(packed)
    assert len(words) == 6 and all(-(2**63) <= w < 2**63 for w in words)
    assert struct.pack("<6q", *words)[:44] == packed


def test_dispatch_plan():
    assert dispatch_plan(0) == []
    assert dispatch_plan(1) == [(0, 1)]
    assert dispatch_plan(4097) == [(0, 1025)]
    big = 4 * MAX_THREADS_PER_DISPATCH  # 2^32 elements per dispatch
    plan = dispatch_plan(2 * big + 5)
    assert plan == [(0, MAX_THREADS_PER_DISPATCH), (big, MAX_THREADS_PER_DISPATCH), (2 * big, 2)]
    assert all(threads <= MAX_THREADS_PER_DISPATCH for _, threads in plan)


@pytest.mark.parametrize("tier", [1, 2])
def test_split_dispatches_agree_with_one(emu, pkg, tier):
    """Tensors split into many dispatches by advancing base (the path that keeps tensors past
    2^32 elements right), with the split forced small here."""
    start = group_tensors(torch.float32, torch.float32, sizes=(1003, 33))
    want, got = clone_group(start), clone_group(start)
    run_steps(make_backend(tier, pkg, emu), want)
    if tier == 1:
        small = make_backend(1, pkg, emu, ext=FakeMetalExt(emu, max_threads=8))
    else:
        small = ShaderLibraryBackend("load_metallib", FakeMpsApi(emu).load_metallib(pkg / METALLIB_NAME),
                                     max_threads=8)
    emu.dispatches.clear()
    run_steps(small, got)
    bases = [x["base"] for x in emu.dispatches if x["n"] == 1003]
    assert bases == list(range(0, 1003, 32)) * 3
    for k in want:
        for a, b in zip(got[k], want[k]):
            assert bits_equal(a, b)


def _select(tiers):
    """The real selection of backends.py, on our tiers; returns (backend, warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = backends._try("mps-test", tiers)
    backends._reasons.pop("mps-test", None)
    return backend, [str(w.message) for w in caught]


def test_fallback_when_extension_missing(emu, pkg):
    def no_ext():
        raise ImportError("cannot import name '_metal'")
    backend, msgs = _select(mps_tiers(load_ext=no_ext, mps_api=FakeMpsApi(emu), package_dir=pkg, probe_device="cpu"))
    assert backend.name == "load_metallib"
    assert len(msgs) == 1 and "_metal extension" in msgs[0] and "cannot import name '_metal'" in msgs[0]


def test_old_torch_skips_tier1(emu, pkg):
    backend, msgs = _select(mps_tiers(load_ext=lambda: FakeMetalExt(emu), mps_api=FakeMpsApi(emu),
                                      package_dir=pkg, torch_version=lambda: (2, 8), probe_device="cpu"))
    assert backend.name == "load_metallib"
    assert len(msgs) == 1 and "older than 2.9" in msgs[0] and "endKernelCoalescing" in msgs[0]
    backend, msgs = _select(mps_tiers(load_ext=lambda: FakeMetalExt(emu), mps_api=FakeMpsApi(emu),
                                      package_dir=pkg, torch_version=lambda: (2, 9), probe_device="cpu"))
    assert backend.name == "metal" and msgs == []


def test_fallback_when_metallib_missing(emu, pkg):
    (pkg / METALLIB_NAME).unlink()
    backend, msgs = _select(mps_tiers(load_ext=lambda: FakeMetalExt(emu), mps_api=FakeMpsApi(emu),
                                      package_dir=pkg, probe_device="cpu"))
    assert backend.name == "compile_shader"
    assert len(msgs) == 2 and all("metallib missing" in m for m in msgs)
    # What a source build on a Mac without the Metal toolchain gets (cmake/apple_metal.cmake builds
    # _metal but no metallib): each refusal, as backend_info()'s "unavailable" lists it, names the
    # cause and the fix.
    for m in msgs:
        assert f"{pkg / METALLIB_NAME} (a source build without the Metal toolchain has none" in m
        assert "tier 3 compiles the bundled .metal source instead" in m
        assert "xcodebuild -downloadComponent MetalToolchain" in m


def test_fallback_to_foreach(emu, pkg):
    class OldTorchMps:  # a torch without either API
        pass
    (pkg / METALLIB_NAME).unlink()
    backend, msgs = _select(mps_tiers(load_ext=lambda: FakeMetalExt(emu), mps_api=OldTorchMps(),
                                      package_dir=pkg, probe_device="cpu"))
    assert backend.name == "foreach"
    assert len(msgs) == 3 and "no torch.mps.compile_shader" in msgs[2]


def test_tier_that_loads_but_cannot_run_is_refused_by_its_probe(emu, pkg):
    """A torch whose ShaderLibrary binds arguments otherwise (the kernel call raises), or a kernel
    that runs but computes something else, is refused at selection by the first-use probe, and the
    next tier runs: the first training step does not fail."""
    class OtherBinding(FakeMpsApi):  # the call raises, as a binding that wants other arguments would
        def load_metallib(self, source):
            lib = super().load_metallib(source)

            class Lib:
                def __dir__(self):
                    return dir(lib)

                def __getattr__(self, name):
                    def call(*args, **kwargs):
                        raise TypeError("Unsupported argument type list")
                    return call
            return Lib()

    class Idle(FakeMetalExt):  # a kernel that runs and writes nothing
        def step(self, kernel_name, tensors, scalars):
            self.calls.append((kernel_name, tensors, scalars))

    backend, msgs = _select(mps_tiers(load_ext=lambda: Idle(emu), mps_api=OtherBinding(emu), package_dir=pkg,
                                      probe_device="cpu"))
    assert backend.name == "compile_shader"
    assert len(msgs) == 2
    assert "_metal extension" in msgs[0] and "first-use probe" in msgs[0] and "param" in msgs[0]
    assert "away from the reference" in msgs[0]
    assert "load_metallib" in msgs[1] and "first-use probe" in msgs[1] and "Unsupported argument type" in msgs[1]
    # The tier chosen passed the same probe, and runs.
    p, g, m, v = torch.randn(9), torch.randn(9), torch.zeros(9), torch.zeros(9)
    want = [t.clone() for t in (p, g, m, v)]
    backend.update("adam", [p], [g], [[m], [v]], AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, 1))
    reference_adam_(*want, AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, 1))
    assert torch.equal(p, want[0])


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS wheels carry _metal and the metallib")
def test_on_this_machine_mps_falls_back_once(monkeypatch):
    """The real tiers with the real torch here (no MPS): each says why once, then foreach."""
    first, again, msgs = choose_backend_afresh(monkeypatch, "mps")
    assert first is again and first.name == "foreach"
    labels = ["_metal extension", "torch.mps.load_metallib", "torch.mps.compile_shader"]
    assert len(msgs) == 3 and all(label in m for label, m in zip(labels, msgs))


def test_torch_mps_api_is_what_tiers_2_and_3_call():
    """torch 2.13's Python API: load_metallib(path or bytes) and compile_shader(source)."""
    assert list(inspect.signature(torch.mps.load_metallib).parameters) == ["source"]
    assert list(inspect.signature(torch.mps.compile_shader).parameters) == ["source"]
    if not torch.backends.mps.is_available():
        with pytest.raises(RuntimeError, match="MPS is not available"):
            torch.mps.compile_shader("kernel void f() {}")


def test_bundled_source_is_found():
    from mps_fused_adam.backends import mps as mps_backends
    found = find_metal_source(mps_backends._package_dir())
    assert found.read_text() == METAL_SOURCE.read_text()


def test_fast_math_note_per_tier():
    """What PYTORCH_MPS_FAST_MATH can change: nothing for the prebuilt metallib (tiers 1 and 2);
    for tier 3, which torch compiles, NaN/Inf handling and subnormals (sqrt and division stay
    precise); nothing of ours for foreach."""
    from mps_fused_adam.backends.mps import fast_math_note
    for name in ("metal", "load_metallib"):
        for env in ({}, {"PYTORCH_MPS_FAST_MATH": "1"}):
            assert fast_math_note(name, env).startswith("not applicable: prebuilt metallib")
    assert fast_math_note("compile_shader", {}).startswith("off")
    assert fast_math_note("compile_shader", {"PYTORCH_MPS_FAST_MATH": "0"}).startswith("off")
    on = fast_math_note("compile_shader", {"PYTORCH_MPS_FAST_MATH": "1"})
    assert on.startswith("on (PYTORCH_MPS_FAST_MATH=1)")
    assert "NaN/Inf" in on and "subnormals" in on and "metal::precise::" in on
    assert fast_math_note("foreach", {"PYTORCH_MPS_FAST_MATH": "1"}) is None


def test_backend_info_reports_fast_math_for_the_mps_tier(monkeypatch, emu, pkg):
    """backend_info()["mps"] carries the active tier's fast-math note (tier 3 chosen here through
    the stand-ins, with the variable set as a user would)."""
    monkeypatch.setattr(backends, "_chosen", {})
    monkeypatch.setattr(backends, "_reasons", {})
    monkeypatch.setenv("PYTORCH_MPS_FAST_MATH", "1")

    def no_ext():
        raise ImportError("no _metal here")
    api = FakeMpsApi(emu)
    monkeypatch.setattr(api, "load_metallib", None, raising=False)
    monkeypatch.setattr(backends, "_tiers", lambda device_type: (
        mps_tiers(load_ext=no_ext, mps_api=api, package_dir=pkg, probe_device="cpu") if device_type == "mps"
        else [("_cpu extension", backends.CPUBackend)]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backends.get_backend("mps")
        info = backends.backend_info()
    assert info["mps"]["backend"] == "compile_shader"
    assert info["mps"]["fast_math"].startswith("on (PYTORCH_MPS_FAST_MATH=1)")
    assert "fast_math" not in info["cpu"]
