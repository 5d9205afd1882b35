"""The shipped Metal kernel, compiled as C++ and run over its grid on the CPU, against the reference.

The reference (mps_fused_adam.numerics.reference) is independent torch code with the contract's operation
order, so the kernel must match it bit for bit: in fp32 by the contract, and in half/bfloat too,
because both widen exactly, compute in fp32 in the same order and round to nearest even once per
store. The contract's looser bound (8 * eps(dtype) * max|ref|) is what other implementations and
Apple hardware must meet; the measured ratio is printed (run with -s) and asserted.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from emulated_mps import METAL_SOURCE, Emulator, build_emulator, compile_emulator, find_compiler, host_names
from mps_fused_adam.numerics.contract import RULES, AdamHyper, element_rules, example
from mps_fused_adam.numerics import lowbit
from mps_fused_adam.backends.mps import KERNELS, METAL_RULES, pack_params
from mps_fused_adam.numerics.reference import reference_adam_
from mps_fused_adam.numerics.reference_lowbit import reference_adam8bit_, reference_adam_sr_

# (param dtype, state dtype) of every instantiation in fused_adam.metal.
VARIANTS = [(torch.float32, torch.float32), (torch.float16, torch.float32),
            (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
            (torch.bfloat16, torch.bfloat16)]
VARIANT_IDS = ["f32-f32", "f16-f32", "f16-f16", "bf16-f32", "bf16-bf16"]
MODES = [dict(adam_w_mode=w, bias_correction=b, maximize=x)
         for w in (True, False) for b in (True, False) for x in (False, True)]
MODE_IDS = [f"{'adamw' if m['adam_w_mode'] else 'l2'}-{'bc' if m['bias_correction'] else 'nobc'}"
            f"{'-max' if m['maximize'] else ''}" for m in MODES]
STEPS = 4


@pytest.fixture(scope="session")
def emu(emulator_cxx) -> Emulator:
    # Under each compiler (conftest.emulator_cxx). The default fails (does not skip) without a
    # compiler: CI has g++, and a skipped emulator tests nothing.
    return build_emulator(cxx=emulator_cxx)


# One hyperparameter object per rule (its example, contract.Example), for the checks that only need the struct's size.
RULE_HYPER = {name: example(name).hyper(1) for name in element_rules()}


def hyper(step: int, **mode) -> AdamHyper:
    return AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step, **mode)


def make_state(n: int, pdtype, sdtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(pdtype)
    m = (0.1 * torch.randn(n, generator=gen)).to(sdtype)
    v = (0.01 * torch.rand(n, generator=gen)).to(sdtype)
    return p, m, v


def grads(n: int, pdtype, seed: int, steps: int):
    gen = torch.Generator().manual_seed(seed + 1000)
    return [torch.randn(n, generator=gen).to(pdtype) for _ in range(steps)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def run_both(emu: Emulator, n: int, pdtype, sdtype, mode: dict, seed: int = 0, steps: int = STEPS,
             **dispatch_kw):
    """``steps`` Adam steps by the emulated kernel and by the reference, from the same state."""
    p, m, v = make_state(n, pdtype, sdtype, seed)
    ours = [p.clone(), m.clone(), v.clone()]
    ref = [p.clone(), m.clone(), v.clone()]
    for step, g in enumerate(grads(n, pdtype, seed, steps), start=1):
        hp = hyper(step, **mode)
        emu.run_tensors(ours[0], g, ours[1], ours[2], pack_params(hp), **dispatch_kw)
        reference_adam_(ref[0], g, ref[1], ref[2], hp)
    return ours, ref


def assert_bitwise(ours, ref):
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, ref):
        assert a.dtype == b.dtype
        diff = (bits(a) != bits(b)).nonzero()
        assert diff.numel() == 0, (
            f"{name}: {diff.numel()} of {a.numel()} differ, first at {diff[0].item()}: "
            f"{a[diff[0]].item()!r} vs {b[diff[0]].item()!r}")


def test_kernel_names_agree(emu):
    """What the source exports, what the emulator runs and what the Python tiers call are one set."""
    exported = host_names(METAL_SOURCE.read_text())
    assert sorted(exported) == sorted(emu.kernel_names) == sorted(KERNELS.values())
    # Five dtype pairs per rule, Adam with stochastic rounding for the two bf16-param pairs, and
    # 8-bit and 4-bit Adam for the three param dtypes.
    assert len(exported) == 5 * len(element_rules()) + 2 + 3 + 3
    assert {f"fused_adam{b}bit_{p}_uchar" for b in (8, 4) for p in ("float", "half", "bfloat")} <= set(exported)
    assert {"fused_adam_sr_bfloat_float", "fused_adam_sr_bfloat_bfloat"} <= set(exported)
    # Before Metal 3.1 (no bfloat type) only the float and half kernels exist.
    assert sorted(host_names(METAL_SOURCE.read_text(), metal_version=300)) == sorted(
        [f"fused_{rule}_{pair}" for rule in element_rules() for pair in ("float_float", "half_float", "half_half")]
        + [f"fused_adam{b}bit_{p}_uchar" for b in (8, 4) for p in ("float", "half")])


def test_params_struct_size(emu):
    """Every kernel's Params struct is its rule's packed scalars, byte for byte in size, and
    takes param, grad and the rule's states."""
    hypers = {**RULE_HYPER, "adam_sr": lowbit.AdamSRHyper(RULE_HYPER["adam"], 0xDEADBEEF),
              "adam8bit": lowbit.Adam8bitTensorHyper(RULE_HYPER["adam"], 7),
              "adam4bit": lowbit.Adam8bitTensorHyper(RULE_HYPER["adam"], 7)}
    for (rule, _, _), name in KERNELS.items():
        assert emu.params_size[name] == len(METAL_RULES[rule].pack(hypers[rule]))
        assert emu.buffer_count[name] == 2 + len(METAL_RULES[rule].states)
    assert emu.params_size["fused_adam_sr_bfloat_float"] == 48
    assert emu.params_size["fused_adam8bit_float_uchar"] == 56
    assert emu.params_size["fused_adam4bit_bfloat_uchar"] == 56  # the 8-bit rule's struct
    assert emu.params_size["fused_adam_float_float"] == 44


@pytest.mark.parametrize("n", [1, 3, 4, 5, 4097])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("pdtype,sdtype", VARIANTS, ids=VARIANT_IDS)
def test_matches_reference_bitwise(emu, n, mode, pdtype, sdtype):
    ours, ref = run_both(emu, n, pdtype, sdtype, mode, seed=n)
    assert_bitwise(ours, ref)


@pytest.mark.parametrize("mode", [MODES[0], MODES[5]], ids=[MODE_IDS[0], MODE_IDS[5]])
@pytest.mark.parametrize("pdtype,sdtype", VARIANTS, ids=VARIANT_IDS)
def test_large_tensor_and_contract_bound(emu, mode, pdtype, sdtype):
    n = 1_000_003
    ours, ref = run_both(emu, n, pdtype, sdtype, mode, seed=7, steps=3)
    assert_bitwise(ours, ref)
    # The contract's bound, stated on its own so the measured margin is visible.
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, ref):
        eps = torch.finfo(a.dtype).eps
        scale = b.float().abs().max().item()
        err = (a.float() - b.float()).abs().max().item()
        ratio = err / (eps * scale)
        print(f"\n{pdtype}/{sdtype} {name}: max|ours-ref| = {err:.3g} = {ratio:.3g} * eps*max|ref|"
              f" (bound 8)")
        assert ratio <= 8


@pytest.mark.parametrize("group", [1, 7, 32, 256, 1024])
def test_threadgroup_size_and_order_do_not_matter(emu, group):
    want, _ = run_both(emu, 4099, torch.bfloat16, torch.float32, MODES[0], seed=3)
    got, _ = run_both(emu, 4099, torch.bfloat16, torch.float32, MODES[0], seed=3, group=group,
                      reverse=True)
    assert_bitwise(got, want)


def test_threads_past_the_end_write_nothing(emu):
    """Surplus threads (a grid rounded up) and the tail thread stay inside the tensor."""
    n = 10
    buf = [torch.full((n + 8,), 7.0) for _ in range(4)]
    p, g, m, v = (b[:n] for b in buf)
    g.normal_()
    v.abs_()
    emu.run_tensors(p, g, m, v, pack_params(hyper(1, adam_w_mode=True)), threads=8, group=3)
    for b in buf:
        assert torch.equal(b[n:], torch.full((8,), 7.0))
    assert (p != 7.0).all()


def test_grid_offset_dispatch_covers_only_its_range(emu):
    """Two dispatches with base 0 and base 8 equal one dispatch; the first touches only [0, 8)."""
    n = 4097
    p, m, v = make_state(n, torch.float32, torch.float32, 11)
    g = grads(n, torch.float32, 11, 1)[0]
    hp = pack_params(hyper(1, adam_w_mode=False))
    whole = [p.clone(), m.clone(), v.clone()]
    emu.run_tensors(whole[0], g, whole[1], whole[2], hp)
    split = [p.clone(), m.clone(), v.clone()]
    emu.run_tensors(split[0], g, split[1], split[2], hp, base=0, threads=2)
    assert torch.equal(split[0][8:], p[8:]) and not torch.equal(split[0][:8], p[:8])
    emu.run_tensors(split[0], g, split[1], split[2], hp, base=8)
    assert_bitwise(split, whole)


@pytest.mark.parametrize("pdtype,sdtype", VARIANTS, ids=VARIANT_IDS)
def test_indices_past_2_pow_32(emu, pdtype, sdtype):
    """The large-index path without 2^32 real elements: buffers are addressed from a virtual start
    `base` elements before the real memory, and the dispatch starts at `base` > 2^32, as the host
    does for the tail of a huge tensor. A kernel that truncated the index to 32 bits would read and
    write 16 GiB away from the data (a crash, or a wrong result below)."""
    base = (1 << 32) + (1 << 30)  # a multiple of 4, like every dispatch's base
    count = 4099
    p, m, v = make_state(count, pdtype, sdtype, 5)
    g = grads(count, pdtype, 5, 1)[0]
    hp = hyper(1, adam_w_mode=True, maximize=True)
    ours = [p.clone(), m.clone(), v.clone()]
    # Modulo 2^64, as the 64-bit address arithmetic in the kernel wraps back onto the real data.
    addrs = tuple((t.data_ptr() - base * t.element_size()) % 2**64 for t in (ours[0], g, ours[1], ours[2]))
    name = KERNELS[("adam", pdtype, sdtype)]
    emu.dispatch(name, addrs, pack_params(hp), base, base + count, -(-count // 4), 256)
    ref = [p.clone(), m.clone(), v.clone()]
    reference_adam_(ref[0], g, ref[1], ref[2], hp)
    assert_bitwise(ours, ref)


def test_nan_and_inf_propagate(emu):
    n = 9
    p, m, v = make_state(n, torch.float32, torch.float32, 2)
    g = grads(n, torch.float32, 2, 1)[0]
    g[1] = float("nan")
    g[6] = float("inf")  # lands in the vector body (index 4-7) while index 8 is the tail
    ours = [p.clone(), m.clone(), v.clone()]
    ref = [p.clone(), m.clone(), v.clone()]
    hp = hyper(1, adam_w_mode=True)
    emu.run_tensors(ours[0], g, ours[1], ours[2], pack_params(hp))
    reference_adam_(ref[0], g, ref[1], ref[2], hp)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert ours[0][1].isnan() and ours[0][6].isnan() and ours[0][[0, 2, 8]].isfinite().all()


@pytest.mark.parametrize("dtype,fn", [(torch.float16, "emu_round_half"), (torch.bfloat16, "emu_round_bfloat")])
def test_compat_header_rounds_like_torch(emu, dtype, fn):
    """The emulator's half/bfloat conversions against torch's (round to nearest even)."""
    import ctypes
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(100_000, generator=gen) * 10.0 ** torch.randint(-8, 6, (100_000,), generator=gen),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65504.0, 65520.0, 1e-8, 6e-8,
                                 1.0009765625 + 2 ** -24, 3.4e38])])
    # Exact ties: midpoints between adjacent representable values, both directions of rounding.
    lo = torch.arange(-300, 300, dtype=torch.float32).to(dtype)
    x = torch.cat([x, (lo.float() + torch.nextafter(lo, torch.tensor(float("inf"), dtype=dtype)).float()) / 2])
    out = torch.empty(x.numel(), dtype=torch.int16)
    getattr(emu.lib, fn)(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), x.numel())
    assert torch.equal(out, x.to(dtype).view(torch.int16))
    nan = torch.tensor([float("nan")])
    getattr(emu.lib, fn)(ctypes.c_void_p(nan.data_ptr()), ctypes.c_void_p(out.data_ptr()), 1)
    assert out[:1].view(dtype).isnan().all()


def _is_gcc() -> bool:
    macros = subprocess.run([find_compiler(), "-dM", "-E", "-x", "c++", "-"], input="",
                            capture_output=True, text=True).stdout
    return "__GNUC__" in macros and "__clang__" not in macros


def test_every_line_of_the_kernel_runs(tmp_path):
    """gcov line coverage of fused_adam.metal under this file's cases, per template instantiation."""
    if not _is_gcc():
        pytest.skip("line coverage is measured with GCC and gcov (the Linux CI's toolchain)")
    gcov = shutil.which("gcov")
    if gcov is None:
        pytest.fail("gcov not found (it ships with g++)")
    text = METAL_SOURCE.read_text()
    lib = compile_emulator(text, tmp_path, coverage=True)
    cov = Emulator(lib, text)
    from test_rules_kernels import RULE_NAMES
    from test_rules_kernels import hyper as rule_hyper
    from test_rules_kernels import make as rule_tensors
    for pdtype, sdtype in VARIANTS:
        for mode in MODES:
            run_both(cov, 6, pdtype, sdtype, mode, steps=1)  # one vector body and a tail of 2
        for rule in RULE_NAMES:
            for maximize, wd in ((False, 0.0), (True, 0.1)):
                # Specials in the first 40 elements: every branch of Lion's sign runs.
                p, g, st = rule_tensors(rule, 46, pdtype, sdtype, specials=True)
                cov.run_tensors(p, g, st, None, RULES[rule].pack(rule_hyper(rule, 1, maximize, wd)), rule=rule)
    for sdtype in (torch.float32, torch.bfloat16):
        run_sr(cov, 6, sdtype, MODES[0], steps=1, specials=True)
    for pdtype in (torch.float32, torch.float16, torch.bfloat16):
        for mode in (MODES[0], MODES[5]):
            for sr in ((False, True) if pdtype is torch.bfloat16 else (False,)):
                run_8bit(cov, 300, pdtype, mode, sr=sr, steps=1, specials=True)
                run_4bit(cov, 301, pdtype, mode, sr=sr, steps=1, specials=True)
    cov.lib.emu_coverage_dump()
    proc = subprocess.run([gcov, "-m", "-o", str(tmp_path), str(Path(__file__).parent / "support" / "metal_emulator.cpp")],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "fused_adam.metal.gcov").read_text()
    unexecuted = [line for line in report.splitlines() if re.match(r"\s*(#####|=====):", line)]
    assert not unexecuted, "\n".join(unexecuted)
    # Each instantiation shows up as its own block; all kernels must have run. (gcov's
    # demangler leaves the _Float16 ones mangled.)
    kernels = re.findall(r"^(?:void fused_step_[12]<[^>]*>|_Z12fused_step_[12]\w+)", report, flags=re.M)
    assert len(kernels) == 5 * len(element_rules()) + 2, kernels
    # gcov shows the block-wise kernel's lines merged over its instantiations: each one was dispatched.
    assert {d["name"] for d in cov.dispatches} >= {f"fused_adam{b}bit_{p}_uchar" for b in (8, 4)
                                                   for p in ("float", "half", "bfloat")}
    executed = [int(c) for c in re.findall(r"^\s*(\d+)\*?:\s+\d+:\s+Rule::apply\(", report, re.M)]
    assert executed and all(c > 0 for c in executed)


# ---- Adam with the bf16 parameter stored by stochastic rounding (lowbit.py) -------------------

SR_STATES = [torch.float32, torch.bfloat16]


def run_sr(emu: Emulator, n: int, sdtype, mode: dict, seed: int = 0, steps: int = STEPS, specials: bool = False,
           **dispatch_kw):
    """``steps`` steps of fused_adam_sr_bfloat_* and of the reference, each with its own key."""
    p, m, v = make_state(n, torch.bfloat16, sdtype, seed)
    if specials:
        p[:3] = torch.tensor([float("nan"), float("inf"), 0.0])
    ours = [p.clone(), m.clone(), v.clone()]
    ref = [p.clone(), m.clone(), v.clone()]
    for step, g in enumerate(grads(n, torch.bfloat16, seed, steps), start=1):
        hp = hyper(step, **mode)
        key = lowbit.sr_key(0x0123456789ABCDEF + seed, step)
        emu.run_tensors(ours[0], g, ours[1], ours[2], pack_params(lowbit.AdamSRHyper(hp, key), "adam_sr"),
                        rule="adam_sr", **dispatch_kw)
        reference_adam_sr_(ref[0], g, ref[1], ref[2], hp, key)
    return ours, ref


@pytest.mark.parametrize("n", [1, 3, 4, 5, 4097])
@pytest.mark.parametrize("mode", [MODES[0], MODES[3], MODES[5]], ids=[MODE_IDS[0], MODE_IDS[3], MODE_IDS[5]])
@pytest.mark.parametrize("sdtype", SR_STATES, ids=["bf16sr-f32", "bf16sr-bf16"])
def test_stochastic_rounding_kernel_matches_reference_bitwise(emu, n, mode, sdtype):
    ours, ref = run_sr(emu, n, sdtype, mode, seed=n)
    assert_bitwise(ours, ref)
    if n == 4097:
        # Not round to nearest: the same steps with the plain Adam kernel store other bits.
        plain, _ = run_both(emu, n, torch.bfloat16, sdtype, mode, seed=n)
        assert (bits(plain[0]) != bits(ours[0])).any()


@pytest.mark.parametrize("group", [1, 7, 256])
def test_stochastic_rounding_independent_of_threadgroups_and_order(emu, group):
    want, _ = run_sr(emu, 4099, torch.float32, MODES[0], seed=3)
    got, _ = run_sr(emu, 4099, torch.float32, MODES[0], seed=3, group=group, reverse=True)
    assert_bitwise(got, want)


def test_stochastic_rounding_specials_and_indices_past_2_pow_32(emu):
    """NaN stores 0x7FC0, Inf and zero stay; elements past 2^32 hash the high index word (a
    dispatch at base > 2^32 over memory addressed from a virtual start, as in the Adam test)."""
    ours, ref = run_sr(emu, 9, torch.float32, MODES[0], steps=1, specials=True)
    assert_bitwise(ours, ref)
    assert bits(ours[0])[0].item() == 0x7FC0 and ours[0][1].item() == float("inf")
    base, count = (1 << 32) + (1 << 30), 4099
    p, m, v = make_state(count, torch.bfloat16, torch.float32, 5)
    g = grads(count, torch.bfloat16, 5, 1)[0]
    hp, key = hyper(1, adam_w_mode=True), 0x9E3779B9
    ours = [p.clone(), m.clone(), v.clone()]
    addrs = tuple((t.data_ptr() - base * t.element_size()) % 2**64 for t in (ours[0], g, ours[1], ours[2]))
    emu.dispatch("fused_adam_sr_bfloat_float", addrs, pack_params(lowbit.AdamSRHyper(hp, key), "adam_sr"),
                 base, base + count, -(-count // 4), 256)
    # The reference at the same indices: Adam in fp32, then the contract's rounding of index base + j.
    p32, m32, v32 = p.float(), m.clone(), v.clone()
    reference_adam_(p32, g, m32, v32, hp)
    u = p32.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = lowbit.sr_bits(key, torch.arange(base, base + count, dtype=torch.int64))
    want = (((u + r) >> 16) & 0xFFFF).to(torch.int16)
    assert torch.equal(bits(ours[0]), want) and torch.equal(ours[1], m32) and torch.equal(ours[2], v32)
    # The low index word alone would give other bits for some elements.
    r_low = lowbit.sr_bits(key, torch.arange(base, base + count, dtype=torch.int64) & 0xFFFFFFFF)
    assert not torch.equal(r, r_low)


# ---- 8-bit block-wise Adam (lowbit.py) ---------------------------------------------------------

P8 = [torch.float32, torch.float16, torch.bfloat16]


def make_8bit(n: int, pdtype, seed: int, specials: bool = False):
    """A param and 8-bit states as after some steps: random codes, positive block scales (one
    block all zero, so a zero scale is covered); specials put NaN, Inf and zero in the param."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(pdtype)
    blocks = lowbit.num_blocks(n)
    c1 = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    c2 = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    a1 = 0.1 * torch.rand(blocks, generator=gen) + 0.01
    a2 = 0.01 * torch.rand(blocks, generator=gen) + 1e-4
    if blocks > 1:
        c1[256:512] = lowbit.SIGNED_ZERO_CODE
        c2[256:512] = lowbit.UNSIGNED_ZERO_CODE
        a1[1] = a2[1] = 0.0
    if specials:
        p[:3] = torch.tensor([float("nan"), float("inf"), 0.0])
        # One huge second moment in block 0: the others quantize below the first code's midpoint,
        # and a positive one takes code 1, not 0.
        c2[:min(n, 256)] = lowbit.UNSIGNED_ZERO_CODE
        c2[min(n, 256) - 1] = 255
        a2[0] = 1e6
    return [p, c1, c2, a1, a2]


def run_8bit(emu: Emulator, n: int, pdtype, mode: dict, sr: bool = False, seed: int = 0, steps: int = STEPS,
             specials: bool = False, group: int = 256, reverse: bool = False, split: bool = False,
             grad_specials: bool = False):
    """``steps`` steps of fused_adam8bit_*_uchar (one dispatch, or two split at a block boundary)
    and of reference_adam8bit_ from the same state. ``grad_specials`` puts a NaN and an Inf in
    block 0's gradient (elements 3 and 4) at every step."""
    start = make_8bit(n, pdtype, seed, specials)
    ours = [t.clone() for t in start]
    ref = [t.clone() for t in start]
    tables = (lowbit.kernel_table(True), lowbit.kernel_table(False))
    name = f"fused_adam8bit_{ {torch.float32: 'float', torch.float16: 'half', torch.bfloat16: 'bfloat'}[pdtype] }_uchar"
    for step, g in enumerate(grads(n, pdtype, seed, steps), start=1):
        if grad_specials:
            g[3:5] = torch.tensor([float("nan"), float("inf")])
        hp = hyper(step, **mode)
        key = lowbit.sr_key(0xFEEDFACE + seed, step) if sr else None
        packed = pack_params(lowbit.Adam8bitTensorHyper(hp, key), "adam8bit")
        p, c1, c2, a1, a2 = ours
        addrs = tuple(t.data_ptr() for t in (p, g, c1, c2, a1, a2, *tables))
        threads = -(-n // 4)
        if split and n > 256:
            emu.dispatch(name, addrs, packed, 0, n, 64, group, reverse)  # block 0 only
            emu.dispatch(name, addrs, packed, 256, n, -(-(n - 256) // 4), group, reverse)
        else:
            emu.dispatch(name, addrs, packed, 0, n, threads, group, reverse)
        reference_adam8bit_(ref[0], g, ref[1], ref[3], ref[2], ref[4], hp, key)
    return ours, ref


def assert_8bit_equal(ours, ref):
    for name, a, b in zip(("param", "exp_avg codes", "exp_avg_sq codes", "exp_avg absmax", "exp_avg_sq absmax"),
                          ours, ref):
        a_bits = a.view(torch.uint8) if a.dtype is torch.uint8 else bits(a)
        b_bits = b.view(torch.uint8) if b.dtype is torch.uint8 else bits(b)
        diff = (a_bits != b_bits).nonzero()
        assert diff.numel() == 0, f"{name}: {diff.numel()} of {a.numel()} differ, first at {diff[0].item()}"


@pytest.mark.parametrize("n", [1, 5, 256, 257, 1000, 4097])
@pytest.mark.parametrize("mode", [MODES[0], MODES[3], MODES[5]], ids=[MODE_IDS[0], MODE_IDS[3], MODE_IDS[5]])
@pytest.mark.parametrize("pdtype", P8, ids=["f32", "f16", "bf16"])
def test_8bit_kernel_matches_reference_bitwise(emu, n, mode, pdtype):
    ours, ref = run_8bit(emu, n, pdtype, mode, seed=n)
    assert_8bit_equal(ours, ref)


@pytest.mark.parametrize("n", [5, 300])
@pytest.mark.parametrize("pdtype", P8, ids=["f32", "f16", "bf16"])
def test_8bit_kernel_l2_specials_matches_reference_bitwise(emu, n, pdtype):
    """L2 mode carries the NaN param (and the NaN and Inf gradients) into the moments, so block 0's
    new scales must turn NaN as the reference's (torch's amax) do, whatever order the NaN, the Inf
    and the finite values of the block arrive in; the other blocks stay finite."""
    l2 = MODES[5]
    assert not l2["adam_w_mode"]
    ours, ref = run_8bit(emu, n, pdtype, l2, seed=n, steps=2, specials=True, grad_specials=True)
    # Bit for bit, except that a NaN's sign and payload are not part of the contract: NaN where
    # the reference has NaN, the same bits everywhere else.
    for name, a, b in zip(("param", "exp_avg codes", "exp_avg_sq codes", "exp_avg absmax", "exp_avg_sq absmax"),
                          ours, ref):
        if a.dtype is torch.uint8:
            assert torch.equal(a, b), name
            continue
        nan = b.isnan()
        assert torch.equal(a.isnan(), nan), f"{name}: NaN at {a.isnan().nonzero().flatten().tolist()[:8]}, " \
                                            f"reference at {nan.nonzero().flatten().tolist()[:8]}"
        assert torch.equal(bits(a)[~nan], bits(b)[~nan]), name
    for name, a, b in (("exp_avg absmax", ours[3], ref[3]), ("exp_avg_sq absmax", ours[4], ref[4])):
        assert b[0].isnan(), f"reference {name}[0] = {b[0].item()}"
        assert a[0].isnan(), f"{name}[0] = {a[0].item()}, reference NaN"
        assert torch.isfinite(a[1:]).all() and torch.equal(a[1:], b[1:])
    assert torch.equal(ours[0].isnan(), ref[0].isnan())


@pytest.mark.parametrize("n", [300, 4097])
def test_8bit_kernel_with_stochastic_rounding_matches_reference(emu, n):
    ours, ref = run_8bit(emu, n, torch.bfloat16, MODES[0], sr=True, seed=n, specials=True)
    assert_8bit_equal(ours, ref)
    assert ours[0][0].isnan() and (ours[2][3:255] == 1).all()  # the positive-moment rule ran
    plain, _ = run_8bit(emu, n, torch.bfloat16, MODES[0], sr=False, seed=n, specials=True)
    assert (bits(plain[0]) != bits(ours[0])).any()  # the switch does round stochastically


@pytest.mark.parametrize("group,reverse,split", [(1, True, False), (7, True, False), (64, False, True),
                                                 (1024, True, True)])
def test_8bit_kernel_independent_of_threadgroups_order_and_dispatch_split(emu, group, reverse, split):
    want, _ = run_8bit(emu, 4099, torch.float32, MODES[0], seed=3)
    got, _ = run_8bit(emu, 4099, torch.float32, MODES[0], seed=3, group=group, reverse=reverse, split=split)
    assert_8bit_equal(got, want)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_8bit_search_matches_reference_near_every_midpoint(emu, signed):
    """The Metal source's code_of (the 8-bit kernel's nearest-code search) on every fp32 near every
    midpoint of both maps and on the special classes, against the contract's searchsorted."""
    from q8_cases import midpoint_count, near_midpoints

    x = near_midpoints(signed)
    got = emu.code_of(x, lowbit.kernel_table(signed)).long()
    want = midpoint_count(x, signed)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(x[i]), int(want[i]), int(got[i])) for i in bad[:8]]


# ---- 4-bit block-wise Adam (lowbit4.py) --------------------------------------------------------

_SHORT_P = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}


def make_4bit(n: int, pdtype, seed: int, specials: bool = False):
    """A param and 4-bit states as after some steps: random codes (packed, the padding nibble of
    an odd n zero), positive block scales, block 1 fresh (codes of 0.0, zero scales) where there
    is one; specials put NaN, Inf and zero in the param and one large second moment in block 0."""
    from mps_fused_adam.numerics import lowbit4
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(pdtype)
    blocks = lowbit4.num_blocks4(n)
    q1 = torch.randint(0, 16, (n,), generator=gen, dtype=torch.uint8)
    q2 = torch.randint(0, 16, (n,), generator=gen, dtype=torch.uint8)
    a1 = 0.1 * torch.rand(blocks, generator=gen) + 0.01
    a2 = 0.01 * torch.rand(blocks, generator=gen) + 1e-4
    b = lowbit4.BLOCK4
    if blocks > 1:
        q1[b:2 * b] = lowbit4.SIGNED_ZERO_CODE4
        q2[b:2 * b] = 0
        a1[1] = a2[1] = 0.0
    if specials:
        p[:3] = torch.tensor([float("nan"), float("inf"), 0.0])
        q2[:min(n, b)] = 0
        q2[min(n, b) - 1] = 15
        a2[0] = 1e6
    return [p, lowbit4.pack_codes4(q1), lowbit4.pack_codes4(q2), a1, a2]


def run_4bit(emu: Emulator, n: int, pdtype, mode: dict, sr: bool = False, seed: int = 0, steps: int = STEPS,
             specials: bool = False, group: int = 256, reverse: bool = False, split: bool = False,
             grad_specials: bool = False, start=None, zero_grad_block: int | None = None):
    """``steps`` steps of fused_adam4bit_*_uchar (one dispatch, or two split at the second block)
    and of reference_adam4bit_ from the same state (``start``, else :func:`make_4bit`);
    ``grad_specials`` as in :func:`run_8bit`; ``zero_grad_block``: that block's gradient is 0."""
    from mps_fused_adam.numerics import lowbit4
    from mps_fused_adam.numerics.reference_lowbit import reference_adam4bit_
    start = start if start is not None else make_4bit(n, pdtype, seed, specials)
    ours = [t.clone() for t in start]
    ref = [t.clone() for t in start]
    tables = (lowbit4.kernel_table4(True), lowbit4.kernel_table4(False))
    name = f"fused_adam4bit_{_SHORT_P[pdtype]}_uchar"
    b = lowbit4.BLOCK4
    for step, g in enumerate(grads(n, pdtype, seed, steps), start=1):
        if grad_specials:
            g[3:5] = torch.tensor([float("nan"), float("inf")])
        if zero_grad_block is not None:
            g[zero_grad_block * b:(zero_grad_block + 1) * b] = 0
        hp = hyper(step, **mode)
        key = lowbit.sr_key(0xFEEDFACE + seed, step) if sr else None
        packed = pack_params(lowbit.Adam8bitTensorHyper(hp, key), "adam4bit")
        p, c1, c2, a1, a2 = ours
        addrs = tuple(t.data_ptr() for t in (p, g, c1, c2, a1, a2, *tables))
        if split and n > b:
            emu.dispatch(name, addrs, packed, 0, n, b // 4, group, reverse)  # block 0 only
            emu.dispatch(name, addrs, packed, b, n, -(-(n - b) // 4), group, reverse)
        else:
            emu.dispatch(name, addrs, packed, 0, n, -(-n // 4), group, reverse)
        reference_adam4bit_(ref[0], g, ref[1], ref[3], ref[2], ref[4], hp, key)
    return ours, ref


# n: one element; one byte; a block less one, a block, a block and one; odd sizes over several
# blocks (the padding nibble); sizes whose threadgroups of 256 threads hold 8 blocks each.
SIZES4 = [1, 2, 3, 127, 128, 129, 255, 1001, 4097, 8193]


@pytest.mark.parametrize("n", SIZES4)
@pytest.mark.parametrize("mode", [MODES[0], MODES[3], MODES[5]], ids=[MODE_IDS[0], MODE_IDS[3], MODE_IDS[5]])
@pytest.mark.parametrize("pdtype", P8, ids=["f32", "f16", "bf16"])
def test_4bit_kernel_matches_reference_bitwise(emu, n, mode, pdtype):
    ours, ref = run_4bit(emu, n, pdtype, mode, seed=n)
    assert_8bit_equal(ours, ref)
    assert ours[1].numel() == ours[2].numel() == (n + 1) // 2
    if n % 2:
        assert ours[1][-1] & 0x0F == 0 and ours[2][-1] & 0x0F == 0, "an odd tensor's padding nibble is 0"


@pytest.mark.parametrize("n", [129, 4097])
def test_4bit_kernel_with_stochastic_rounding_matches_reference(emu, n):
    ours, ref = run_4bit(emu, n, torch.bfloat16, MODES[0], sr=True, seed=n, specials=True)
    assert_8bit_equal(ours, ref)
    assert ours[0][0].isnan()
    plain, plain_ref = run_4bit(emu, n, torch.bfloat16, MODES[0], sr=False, seed=n, specials=True)
    assert_8bit_equal(plain, plain_ref)
    assert (bits(plain[0]) != bits(ours[0])).any()  # the switch does round stochastically


@pytest.mark.parametrize("n", [5, 300])
@pytest.mark.parametrize("pdtype", P8, ids=["f32", "f16", "bf16"])
def test_4bit_kernel_l2_specials_nan_blocks(emu, n, pdtype):
    """As the 8-bit test: L2 mode carries the NaN param and the NaN/Inf gradients into block 0's
    moments, whose scales turn NaN as torch's amax does; the other blocks stay finite and exact."""
    ours, ref = run_4bit(emu, n, pdtype, MODES[5], seed=n, steps=2, specials=True, grad_specials=True)
    for name, a, b in zip(("param", "exp_avg codes", "exp_avg_sq codes", "exp_avg absmax", "exp_avg_sq absmax"),
                          ours, ref):
        if a.dtype is torch.uint8:
            assert torch.equal(a, b), name
            continue
        nan = b.isnan()
        assert torch.equal(a.isnan(), nan), name
        assert torch.equal(bits(a)[~nan], bits(b)[~nan]), name
    for a, b in ((ours[3], ref[3]), (ours[4], ref[4])):
        assert b[0].isnan() and a[0].isnan()
        assert torch.isfinite(a[1:]).all() and torch.equal(a[1:], b[1:])


@pytest.mark.parametrize("pdtype", P8, ids=["f32", "f16", "bf16"])
def test_4bit_kernel_zero_blocks(emu, pdtype):
    """A fresh state (first-moment bytes 0x77, second 0x00, zero scales) and a block whose gradient
    is zero at every step: in AdamW mode its scales stay 0 and its codes those of 0.0 (code 7; the
    second moment's code 0 under a zero scale), while the other blocks move; in L2 mode the decay
    reaches the moments. Bit for bit the reference in both."""
    from mps_fused_adam.numerics import lowbit4
    n, b = 1001, lowbit4.BLOCK4
    gen = torch.Generator().manual_seed(9)
    p = torch.randn(n, generator=gen).to(pdtype)
    nb = lowbit4.num_blocks4(n)
    start = [p, lowbit4.fresh_codes4(n, True), lowbit4.fresh_codes4(n, False), torch.zeros(nb), torch.zeros(nb)]
    assert start[1][-1] == 0x70  # odd n: the padding nibble of a fresh state is 0 too
    for mode in (MODES[0], MODES[4]):
        ours, ref = run_4bit(emu, n, pdtype, mode, seed=9, start=start, zero_grad_block=2)
        assert_8bit_equal(ours, ref)
        moved = [k for k in range(nb) if k != 2]
        assert (ours[3][moved] > 0).all() and (ours[4][moved] > 0).all()
        zero_bytes = slice(2 * b // 2, 3 * b // 2)  # block 2's code bytes
        if mode["adam_w_mode"]:
            assert ours[3][2] == 0 and ours[4][2] == 0
            assert (ours[1][zero_bytes] == 0x77).all() and (ours[2][zero_bytes] == 0).all()
        else:
            assert ours[3][2] > 0 and ours[4][2] > 0


@pytest.mark.parametrize("group,reverse,split", [(1, True, False), (7, True, False), (32, False, True),
                                                 (1024, True, True)])
def test_4bit_kernel_independent_of_threadgroups_order_and_dispatch_split(emu, group, reverse, split):
    """Threadgroups of 1 to 1,024 threads (32 threads, 4 blocks, per group of 256 by default),
    backwards, and a tensor split into two dispatches at its second block: the same bits."""
    want, ref = run_4bit(emu, 4099, torch.float32, MODES[0], seed=3)
    assert_8bit_equal(want, ref)
    got, _ = run_4bit(emu, 4099, torch.float32, MODES[0], seed=3, group=group, reverse=reverse, split=split)
    assert_8bit_equal(got, want)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_4bit_search_matches_reference_at_every_midpoint(emu, signed):
    """The 4-bit kernel's code search on each midpoint, its fp32 neighbours, every code value,
    zeros, infinities, NaN and random values, against the contract's count of midpoints strictly
    below (a value on a midpoint takes the lower code)."""
    from mps_fused_adam.numerics import lowbit4
    mids = lowbit4.midpoints4(signed)
    table = lowbit4.kernel_table4(signed)
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.full_like(mids, -float("inf")))
    gen = torch.Generator().manual_seed(4)
    x = torch.cat([mids, up, down, lowbit4.map4(signed), -lowbit4.map4(signed),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 2.0, -2.0, 1e-30, -1e-30]),
                   torch.rand(10_000, generator=gen) * 2 - 1])
    want = torch.searchsorted(mids, x, right=False)
    got = emu.code4_of(x, table).long()
    assert torch.equal(got, want), [(float(x[i]), int(want[i]), int(got[i])) for i in (got != want).nonzero()[:8]]
    assert int(emu.code4_of(torch.tensor([float("nan")]), table)[0]) == 0
    assert torch.equal(emu.code4_of(mids, table).long(), torch.arange(15))  # on a midpoint: the lower code
