"""The CPU 4-bit Adam kernel (src/cpu/adam4bit_kernel.h, adam4bit.cpp) against the plain-torch
reference (reference_lowbit.reference_adam4bit_): bit-identical packed codes, scales and params,
for every param dtype, with and without bf16 stochastic rounding, on every SIMD path this machine
runs (through the extension) and on NEON and the x86 builds in the native harness
(tests/support/native/q4_parity.cpp: each build against the reference's own outputs), at one and several
threads, for sizes around the block and byte boundaries."""
from __future__ import annotations

import platform
import re
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import require_tool
from mps_fused_adam import _cpu
from mps_fused_adam.backends import get_backend
from mps_fused_adam.numerics import lowbit, lowbit4
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference_lowbit import reference_adam4bit_

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")  # the backends' order
ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "cpu"


def fresh_state(n: int) -> dict[str, torch.Tensor]:
    nb = lowbit4.num_blocks4(n)
    return {"exp_avg_codes": lowbit4.fresh_codes4(n, True), "exp_avg_absmax": torch.zeros(nb),
            "exp_avg_sq_codes": lowbit4.fresh_codes4(n, False), "exp_avg_sq_absmax": torch.zeros(nb)}


def reference_step(p, g, st, hp, key) -> None:
    reference_adam4bit_(p, g, *(st[k] for k in KEYS), hp, key)


def backend_step(p, g, st, hp, key) -> None:
    """The CPU backend's 4-bit rule on one tensor (what an optimizer calls)."""
    get_backend("cpu").update("adam4bit", [p], [g], [[st[k]] for k in KEYS], hp,
                              sr_keys=None if key is None else [key])


def gradient(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Magnitudes over 6 decades inside each block, and exact zeros."""
    g = (torch.randn(n, generator=gen) * 10.0 ** (-6 * torch.rand(n, generator=gen))).to(dtype)
    g[5::11] = 0
    return g


def run_both(n, dtype, steps=3, sr=False, specials=False, zero_block=False, step_fn=backend_step, **mode):
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen).to(dtype)
    ours, ref = p0.clone(), p0.clone()
    so, sref = fresh_state(n), fresh_state(n)
    for step in range(1, steps + 1):
        g = gradient(n, dtype, gen)
        if specials and step == 2:
            g[3] = float("nan")
            if n > 600:
                g[600] = float("inf")
                g[601] = float("-inf")
        if zero_block and n > 2 * lowbit4.BLOCK4:
            g[lowbit4.BLOCK4:2 * lowbit4.BLOCK4] = 0  # block 1: zero grads (and zero params below)
            if step == 1:
                ours[lowbit4.BLOCK4:2 * lowbit4.BLOCK4] = 0
                ref[lowbit4.BLOCK4:2 * lowbit4.BLOCK4] = 0
        hp = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step, **mode)
        key = lowbit.sr_key(12345, step) if sr else None
        step_fn(ours, g, so, hp, key)
        reference_step(ref, g, sref, hp, key)
    return (ours, so), (ref, sref)


def assert_same(a, b) -> None:
    (pa, sa), (pb, sb) = a, b
    assert torch.equal(pa.view(torch.uint8), pb.view(torch.uint8)), \
        f"param differs at {torch.nonzero(pa.view(torch.uint8) != pb.view(torch.uint8))[:5].tolist()}"
    for k in sa:
        da, db = sa[k].view(torch.uint8), sb[k].view(torch.uint8)
        assert torch.equal(da, db), f"{k} differs at bytes {torch.nonzero(da != db)[:5].flatten().tolist()}"


SIZES = [1, 2, 3, 127, 128, 129, 255, 256, 257, 1001, 4097]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mode", [dict(), dict(adam_w_mode=False, maximize=True), dict(bias_correction=False)],
                         ids=["adamw", "l2-max", "nobc"])
def test_matches_reference_bitwise(simd, dtype, n, mode):
    ours, ref = run_both(n, dtype, **mode)
    assert_same(ours, ref)
    assert (ours[1]["exp_avg_sq_absmax"] > 0).all()  # the kernel really ran (bf16 params may not move)
    if n % 2:
        assert ours[1]["exp_avg_codes"][-1] & 0x0F == 0 and ours[1]["exp_avg_sq_codes"][-1] & 0x0F == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stochastic_rounding_specials_and_zero_blocks(simd, dtype):
    """bf16 stochastic rounding (RNE for the other dtypes, which ignore the key), a NaN and both
    infinities in the gradient, and a block of zero params and grads: a NaN moment takes code 0
    and makes its block's scale NaN, a zero block keeps scale 0, all as the reference."""
    ours, ref = run_both(1000, dtype, sr=True, specials=True, zero_block=True)
    assert_same(ours, ref)
    assert torch.isnan(ours[0][3].float())  # NaN propagates into its block
    assert torch.isnan(ours[1]["exp_avg_absmax"][0])
    assert ours[1]["exp_avg_sq_absmax"][1] == 0 and ours[1]["exp_avg_absmax"][1] == 0
    if dtype is torch.bfloat16:  # stochastic rounding really differs from round to nearest
        rne, _ = run_both(1000, dtype, sr=False, specials=True, zero_block=True)
        assert not torch.equal(rne[0].view(torch.int16), ours[0].view(torch.int16))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_and_large_tensor(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours, ref = run_both(128 * 700 + 77, torch.bfloat16, steps=2, sr=True)
    finally:
        torch.set_num_threads(old)
    assert_same(ours, ref)


def test_rejects_bad_arguments():
    t1, t2 = (lowbit4.kernel_table4(s).data_ptr() for s in (True, False))
    with pytest.raises(ValueError, match="adam4bit takes a 48-byte scalar struct; got 1"):
        _cpu.adam4bit_step(0, 0, 0, 0, 0, 0, 0, 0, t1, t2, b"x", 0, False, 1)
    with pytest.raises(ValueError, match="param dtype code"):
        _cpu.adam4bit_step(0, 0, 0, 0, 0, 0, 0, 7, t1, t2, b"\0" * 48, 0, False, 1)
    with pytest.raises(ValueError, match="negative element count"):
        _cpu.adam4bit_step(0, 0, 0, 0, 0, 0, -1, 0, t1, t2, b"\0" * 48, 0, False, 1)


def test_rejects_wrong_tables_before_writing_anything():
    n = 300
    p, g, st = torch.randn(n), torch.randn(n), fresh_state(n)
    before = p.clone(), {k: v.clone() for k, v in st.items()}
    args = [p.data_ptr(), g.data_ptr(), *(st[k].data_ptr() for k in KEYS), n, 0]
    scal = lowbit4.pack_adam8bit(AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, 1))
    t1, t2 = lowbit4.kernel_table4(True), lowbit4.kernel_table4(False)
    with pytest.raises(ValueError, match=r"map1 \(lowbit4.kernel_table4\(True\)\): not a signed map"):
        _cpu.adam4bit_step(*args, t2.data_ptr(), t2.data_ptr(), scal, 0, False, 1)
    with pytest.raises(ValueError, match=r"map2 \(lowbit4.kernel_table4\(False\)\): not the zero-free"):
        _cpu.adam4bit_step(*args, t1.data_ptr(), t1.data_ptr(), scal, 0, False, 1)
    with pytest.raises(ValueError, match="null address"):
        _cpu.adam4bit_step(*args, 0, t2.data_ptr(), scal, 0, False, 1)
    bad = t1.clone()
    bad[16 + 3], bad[16 + 4] = bad[16 + 4].item(), bad[16 + 3].item()
    with pytest.raises(ValueError, match="midpoints not strictly ascending"):
        _cpu.adam4bit_step(*args, bad.data_ptr(), t2.data_ptr(), scal, 0, False, 1)
    bad = lowbit.kernel_table(True)  # the 8-bit table: its first 32 words are no 4-bit map
    with pytest.raises(ValueError, match="map1"):
        _cpu.adam4bit_step(*args, bad.data_ptr(), t2.data_ptr(), scal, 0, False, 1)
    assert torch.equal(p, before[0]) and all(torch.equal(st[k], before[1][k]) for k in st)


# ---- the nearest-code search alone ------------------------------------------------------------

def near_midpoints4(signed: bool) -> torch.Tensor:
    """Every midpoint and code value of a map +-4 ulps with both signs, the special classes, and
    values over nine decades (an odd count: the pad nibble too)."""
    from q8_cases import _from_bits
    table = lowbit4.kernel_table4(signed)
    both = torch.cat([table[:31], -table[:31]])
    cols, up, down = [both], both, both
    for _ in range(4):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        cols += [up, down]
    specials = _from_bits([0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF,
                           0xFF7FFFFF, 0x3F800001, 0xBF800001, 0x40000000, 0x7F800000, 0xFF800000, 0x7FC00000,
                           0xFFC00000, 0x7F800001, 0xFFFFFFFF])
    gen = torch.Generator().manual_seed(4)
    spread = (torch.rand(5001, generator=gen) * 10.0 ** (-9 * torch.rand(5001, generator=gen))
              * torch.where(torch.rand(5001, generator=gen) < 0.5, -1.0, 1.0))
    x = torch.cat(cols + [specials, spread]).contiguous()
    return x if x.numel() % 2 else torch.cat([x, x[:1]])


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_search_matches_reference_near_every_midpoint(simd, signed):
    """The kernel's nearest code (binary search on the signed map, arithmetic on the linear one)
    against the reference's (searchsorted: midpoints strictly below, ties low, NaN to 0), packed."""
    from mps_fused_adam.numerics.reference_lowbit import quantize_with
    x = near_midpoints4(signed)
    want = lowbit4.pack_codes4(quantize_with(x, torch.ones(lowbit4.num_blocks4(x.numel())),
                                             lowbit4.midpoints4(signed), lowbit4.BLOCK4))
    got = torch.full((lowbit4.packed_size(x.numel()),), 0xFF, dtype=torch.uint8)
    _cpu.q4_quantize(x.data_ptr(), x.numel(), lowbit4.kernel_table4(signed).data_ptr(), signed, got.data_ptr())
    bad = torch.nonzero(got != want).flatten()[:5].tolist()
    assert not bad, [(x[2 * i].item(), x[2 * i + 1].item(), hex(got[i]), hex(want[i])) for i in bad]


# ---- many tensors in one call ------------------------------------------------------------------

def _batch_args(tensors):
    """adam4bit_step_many's columns for [(param, grad, state, hyper, key)]."""
    cols = [[] for _ in range(11)]
    for p, g, st, hp, key in tensors:
        for col, v in zip(cols, (p.data_ptr(), g.data_ptr(), *(st[k].data_ptr() for k in KEYS), p.numel(),
                                 DTYPE_CODES[p.dtype], lowbit4.pack_adam8bit(hp), 0 if key is None else key,
                                 int(key is not None))):
            col.append(v)
    return cols


MAPS = (lowbit4.kernel_table4(True).data_ptr(), lowbit4.kernel_table4(False).data_ptr())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_tensors_in_one_call_match_the_reference(simd, threads):
    """Blocks of several tensors shared among threads as one range: every tensor bit for bit as
    the reference, whatever the split (sizes under, at and across block, byte and thread boundaries)."""
    gen = torch.Generator().manual_seed(3)
    specs = [(0, torch.float32), (1, torch.bfloat16), (127, torch.float16), (129, torch.float32),
             (128 * 260 + 3, torch.bfloat16), (128 * 280, torch.float32), (4097, torch.bfloat16), (255, torch.bfloat16)]
    ours, refs = [], []
    for n, dtype in specs:
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
            _cpu.adam4bit_step_many(*cols[:8], *MAPS, *cols[8:], threads)
            for r, g, k in zip(refs, grads, keys):
                reference_step(r[0], g, r[1], hp, k)
    finally:
        torch.set_num_threads(old)
    for (p, so), (pr, sr) in zip(ours, refs):
        assert_same((p, so), (pr, sr))
    assert (ours[4][1]["exp_avg_sq_absmax"] > 0).all()


def test_many_rejects_bad_entries_before_writing_anything():
    n = 600
    tensors = [(torch.randn(n), torch.randn(n), fresh_state(n), AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, 1), None)
               for _ in range(3)]
    before = [(t[0].clone(), {k: v.clone() for k, v in t[2].items()}) for t in tensors]
    cols = _batch_args(tensors)
    bad = [list(c) for c in cols]
    bad[7][2] = 9
    with pytest.raises(ValueError, match="tensor 2: param dtype code must be 0"):
        _cpu.adam4bit_step_many(*bad[:8], *MAPS, *bad[8:], 2)
    bad = [list(c) for c in cols]
    bad[8][1] = b"short"
    with pytest.raises(ValueError, match="tensor 1: adam4bit takes a 48-byte scalar struct; got 5"):
        _cpu.adam4bit_step_many(*bad[:8], *MAPS, *bad[8:], 2)
    with pytest.raises(ValueError, match="adam4bit_step_many: every list has one entry per tensor \\(3\\); got one of 2"):
        _cpu.adam4bit_step_many(*cols[:6], cols[6][:2], cols[7], *MAPS, *cols[8:], 2)
    for (p, _, st, _, _), (p0, st0) in zip(tensors, before):
        assert torch.equal(p, p0) and all(torch.equal(st[k], st0[k]) for k in st)


# ---- the benchmark's floor ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_floor_keeps_every_value(simd, dtype):
    """The memory floor (benchmarks) reads and writes the step's bytes and changes none of them."""
    n = 128 * 5 + 3
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(n, generator=gen).to(dtype)
    g = torch.randn(n, generator=gen).to(dtype)
    st = {"exp_avg_codes": torch.randint(0, 256, (lowbit4.packed_size(n),), dtype=torch.uint8, generator=gen),
          "exp_avg_absmax": torch.rand(lowbit4.num_blocks4(n), generator=gen),
          "exp_avg_sq_codes": torch.randint(0, 256, (lowbit4.packed_size(n),), dtype=torch.uint8, generator=gen),
          "exp_avg_sq_absmax": torch.rand(lowbit4.num_blocks4(n), generator=gen)}
    before = p.clone(), {k: v.clone() for k, v in st.items()}
    _cpu.adam4bit_step(p.data_ptr(), g.data_ptr(), *(st[k].data_ptr() for k in KEYS), n, DTYPE_CODES[dtype], *MAPS,
                       lowbit4.pack_adam8bit(AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, 1)), 0, False, 2, floor=True)
    assert_same((p, st), before)


# ---- the native harness: NEON under qemu, the x86 builds natively, against reference outputs ---

def _cases_file(tmp_path: Path) -> tuple[str, int]:
    """Inputs and the reference's outputs of a set of 4-bit steps, for tests/support/native/q4_parity.cpp:
    per case a header ("<qiIi" + 48 scalar bytes: n, dtype code, sr key, sr), then the
    param, grad, codes1, absmax1, codes2, absmax2 before and after (the reference's result)."""
    t1, t2 = lowbit4.kernel_table4(True), lowbit4.kernel_table4(False)
    out = [t1.numpy().tobytes(), t2.numpy().tobytes()]
    gen = torch.Generator().manual_seed(36)
    cases = 0
    for dtype in DTYPES:
        for n in (1, 2, 3, 5, 7, 127, 128, 129, 255, 300, 1001):
            for mode, sr in ((dict(), False), (dict(adam_w_mode=False, maximize=True), True),
                             (dict(bias_correction=False), dtype is torch.bfloat16)):
                p = torch.randn(n, generator=gen).to(dtype)
                st = fresh_state(n)
                # A first step through the reference gives the state a realistic start.
                hp1 = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, 1, **mode)
                reference_step(p, gradient(n, dtype, gen), st, hp1, None)
                g = gradient(n, dtype, gen)
                if n > 200:
                    g[7] = float("nan")
                    g[150] = float("inf")
                hp = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, 2, **mode)
                key = lowbit.sr_key(99, n) if sr else None
                tensors = [p, g, *(st[k] for k in KEYS)]
                before = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
                reference_step(p, g, st, hp, key)
                after = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (p, g, *(st[k] for k in KEYS)))
                out.append(struct.pack("<qiIi", n, DTYPE_CODES[dtype], 0 if key is None else key, int(sr and
                                       dtype is torch.bfloat16)) + lowbit4.pack_adam8bit(hp) + before + after)
                cases += 1
    path = tmp_path / "q4_cases.bin"
    path.write_bytes(b"".join(out))
    return str(path), cases


FLAGS = ["-std=c++17", "-O2", "-ffp-contract=off", "-fno-math-errno", "-fno-fast-math"]


def _assert_harness(stdout: str, isa: str, cases: int) -> None:
    assert f"{isa} and scalar vs reference: {cases} cases, 0 mismatches" in stdout, stdout
    assert re.search(r"^search: [1-9]\d+ values, 0 mismatches$", stdout, re.M), stdout


def test_neon_matches_reference_under_qemu(tmp_path):
    cxx, qemu = require_tool("aarch64-linux-gnu-g++", "qemu-aarch64")
    exe = tmp_path / "q4_parity"
    subprocess.run([cxx, *FLAGS, "-static", f"-I{SRC}", "-DMFA_NATIVE_NS=isa_neon",
                    str(ROOT / "tests/support/native/q4_parity.cpp"), str(SRC / "adam_scalar.cpp"), str(SRC / "adam_neon.cpp"),
                    "-o", str(exe)], check=True)
    cases, count = _cases_file(tmp_path)
    run = subprocess.run([qemu, str(exe), cases], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    _assert_harness(run.stdout, "neon", count)


@pytest.mark.parametrize("isa", ["avx2", "avx512", "avx512bf16"])
def test_x86_build_matches_reference_natively(tmp_path, isa):
    from test_native_isa import X86_NEEDS, _build_flags, _cpu_flags
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"an x86-64 build; this machine is {platform.machine()}")
    missing = X86_NEEDS[isa] - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}, which the {isa} build needs")
    [cxx] = require_tool("g++")
    objs = []
    for src, extra in ((ROOT / "tests/support/native/q4_parity.cpp", [f"-DMFA_NATIVE_NS=isa_{isa}"]),
                       (SRC / "adam_scalar.cpp", []), (SRC / f"adam_{isa}.cpp", _build_flags(isa))):
        obj = tmp_path / (src.stem + ".o")
        subprocess.run([cxx, *FLAGS, f"-I{SRC}", *extra, "-c", str(src), "-o", str(obj)], check=True)
        objs.append(str(obj))
    exe = tmp_path / "q4_parity"
    subprocess.run([cxx, *objs, "-o", str(exe)], check=True)
    cases, count = _cases_file(tmp_path)
    run = subprocess.run([str(exe), cases], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    _assert_harness(run.stdout, isa, count)


@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
def test_bf16_pair_path_changes_speed_only(simd, sr):
    """bf16 params on the x86 paths go through the kernel as even/odd vector pairs (their codes are
    the bytes' two nibbles); turned off, the same steps run one vector at a time: both match the
    reference, for whole blocks, a short last block and an odd length."""
    assert _cpu.bf16_pairs()  # the default
    try:
        for on in (False, True):
            _cpu.set_bf16_pairs(on)
            for n in (128 * 3, 128 * 2 + 77, 128 + 31, 45):
                ours, ref = run_both(n, torch.bfloat16, sr=sr)
                assert_same(ours, ref)
    finally:
        _cpu.set_bf16_pairs(True)
