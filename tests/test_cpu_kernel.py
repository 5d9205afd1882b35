"""The C++ CPU kernel against the independent reference (docs/numerics.md), on every SIMD path
this CPU can run. Operation order and rounding are the same, so results must be bit-identical."""
from __future__ import annotations

import sys

import pytest
import torch

from mps_fused_adam import _cpu
from mps_fused_adam.backends import CPUBackend
from mps_fused_adam.numerics.contract import RULES, AdamHyper, element_rules
from mps_fused_adam.numerics.reference import reference_adam_

from conftest import DTYPE_PAIRS, FORK_ON_DARWIN, pair_id


def make_tensors(n: int, pdtype: torch.dtype, sdtype: torch.dtype):
    p = torch.randn(n).to(pdtype)
    g = (torch.randn(n) * 0.5).to(pdtype)
    m = (torch.randn(n) * 0.1).to(sdtype)
    v = (torch.rand(n) * 0.01).to(sdtype)
    return p, g, m, v


def run_both(tensors, steps, **hp_kwargs):
    ours = [t.clone() for t in tensors]
    ref = [t.clone() for t in tensors]
    backend = CPUBackend()
    for step in range(1, steps + 1):
        hp = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=step, **hp_kwargs)
        backend.update("adam", [ours[0]], [ours[1]], [[ours[2]], [ours[3]]], hp)
        reference_adam_(*ref, hp)
    return ours, ref


def assert_identical(ours, ref):
    for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq"), ours, ref):
        assert a.dtype == b.dtype
        diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), \
            f"{name} differs from the reference (max abs diff {diff})"


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
@pytest.mark.parametrize("n,bias_correction,maximize", [
    (n, bc, mx) for n in (1, 7, 4097) for bc in (True, False) for mx in (False, True)
] + [((1 << 20) + 3, True, False)])  # the mode flags do not depend on size: one large case suffices
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_matches_reference(simd, pair, n, adam_w_mode, bias_correction, maximize):
    tensors = make_tensors(n, *pair)
    ours, ref = run_both(tensors, steps=3, adam_w_mode=adam_w_mode, bias_correction=bias_correction,
                         maximize=maximize)
    assert_identical(ours, ref)
    # The update did something: a kernel that never writes would match an all-no-op reference only
    # if the reference were broken too, so check against the inputs as well.
    assert not torch.equal(ours[0], tensors[0]) or n == 0


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_simd_paths_agree_bitwise(pair):
    """Every SIMD build gives the same bits as the scalar build (also for NaN/Inf/denormals)."""
    n = 4096 + 13
    p, g, m, v = make_tensors(n, *pair)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 0.0, -0.0, 6e-8, 65504.0])
    g[: len(specials)] = specials.to(g.dtype)
    p[20:29] = specials.to(p.dtype)
    results = {}
    before = _cpu.simd_path()
    try:
        for path in _cpu.simd_paths():
            _cpu.set_simd_path(path)
            out = [t.clone() for t in (p, g, m, v)]
            for step in (1, 2):
                CPUBackend().update("adam", [out[0]], [out[1]], [[out[2]], [out[3]]], AdamHyper(1e-3, 0.9, 0.99, 1e-6, 0.1, step))
            results[path] = out
    finally:
        _cpu.set_simd_path(before)
    base = results["scalar"]
    for path, out in results.items():
        for a, b in zip(out, base):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{path} differs from scalar"
    assert torch.isnan(base[0][:1].float()).all(), "NaN gradients must propagate, not be skipped"


def test_many_tensors_one_call_and_threads():
    """1,000 tensors in one call, split across threads by elements, still match per-tensor reference."""
    shapes = [(int(s),) for s in torch.randint(1, 3000, (1000,))]
    tensors = [make_tensors(s[0], torch.float32, torch.float32) for s in shapes]
    ours = [[t.clone() for t in ts] for ts in tensors]
    hp = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        CPUBackend().update("adam", [t[0] for t in ours], [t[1] for t in ours], [[t[2] for t in ours], [t[3] for t in ours]], hp)
    finally:
        torch.set_num_threads(old)
    for ts, out in zip(tensors, ours):
        ref = [t.clone() for t in ts]
        reference_adam_(*ref, hp)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.parametrize("torch_openmp", [True, False], ids=["torch-openmp", "own-pool"])
def test_thread_count_follows_torch(torch_openmp):
    """Every thread count, on torch's OpenMP threads and on our own pool, gives the reference's bits."""
    old = torch.get_num_threads()
    _cpu.use_torch_openmp(torch_openmp)
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            p, g, m, v = make_tensors(1 << 20, torch.float32, torch.float32)
            ref = [t.clone() for t in (p, g, m, v)]
            hp = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
            CPUBackend().update("adam", [p], [g], [[m], [v]], hp)
            reference_adam_(*ref, hp)
            assert torch.equal(p, ref[0]) and torch.equal(m, ref[2]) and torch.equal(v, ref[3])
            if not torch_openmp:
                assert _cpu.pool_size() >= threads
    finally:
        _cpu.use_torch_openmp(True)
        torch.set_num_threads(old)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torch's OpenMP is borrowed on Linux only")
def test_steps_run_on_torchs_openmp_threads():
    """On Linux the kernel runs on the OpenMP runtime of torch's wheel (found, not linked), so it
    shares torch's worker threads instead of competing with them."""
    assert _cpu.thread_pool().startswith("torch's OpenMP (") and "/torch/lib/" in _cpu.thread_pool()
    _cpu.use_torch_openmp(False)
    try:
        assert _cpu.thread_pool() == "own"
    finally:
        _cpu.use_torch_openmp(True)


@pytest.mark.skipif(sys.platform == "darwin", reason=FORK_ON_DARWIN)
def test_fork_child_steps_on_its_own_pool():
    """A forked child (a DataLoader worker, say) cannot use the parent's OpenMP threads: it falls
    back to a fresh pool of its own and still computes the reference's bits."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    p, g, m, v = make_tensors(1 << 18, torch.float32, torch.float32)
    ref = [t.clone() for t in (p, g, m, v)]
    hp = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
    CPUBackend().update("adam", [p.clone()], [g], [[m.clone()], [v.clone()]], hp)  # parent uses its threads first
    reference_adam_(*ref, hp)
    shared = [t.clone().share_memory_() for t in (p, g, m, v)]
    proc = ctx.Process(target=_child_step, args=(shared, hp))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert torch.equal(shared[0], ref[0]) and torch.equal(shared[2], ref[2])


def _child_step(tensors, hp):
    torch.set_num_threads(2)
    p, g, m, v = tensors
    CPUBackend().update("adam", [p], [g], [[m], [v]], hp)


def test_set_simd_path_rejects_unknown():
    with pytest.raises(ValueError, match="not supported on this CPU; supported: .*scalar"):
        _cpu.set_simd_path("sse9")


def test_bad_arguments_rejected():
    blob = RULES["adam"].pack(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1))
    with pytest.raises(ValueError, match="states are float32 or the param dtype"):
        _cpu.step("adam", [], [], [[], []], [], 0, 2, blob, 1)
    # The kernel's own list, in its order: every rule of contract.RULES and the benchmark floors.
    assert set(_cpu.rules()) == set(element_rules()) | {"floor", "floor1"}
    with pytest.raises(ValueError, match=f"unknown update rule 'lamb'; the CPU kernel has: {', '.join(_cpu.rules())}"):
        _cpu.step("lamb", [], [], [[], []], [], 0, 0, blob, 1)
    with pytest.raises(ValueError, match="rule 'adam' has 2 states; got 1 state lists"):
        _cpu.step("adam", [], [], [[]], [], 0, 0, blob, 1)
    with pytest.raises(ValueError, match="44-byte scalar struct; got 40 bytes"):
        _cpu.step("adam", [], [], [[], []], [], 0, 0, blob[:40], 1)
    t = [torch.zeros(64) for _ in range(4)]
    a = [x.data_ptr() for x in t]
    # A tensor without memory (address 0, as a ZeroTensor has) is refused, not dereferenced.
    with pytest.raises(ValueError, match="tensor 0 has address 0"):
        _cpu.step("adam", [a[0]], [0], [[a[2]], [a[3]]], [64], 0, 0, blob, 1)

    class Evil:  # an __index__ that would change the lists while they are read
        def __index__(self):
            params.clear()
            return 64
    params = [a[0], a[0]]
    with pytest.raises(TypeError, match="numels must be plain ints"):
        _cpu.step("adam", params, [a[1]] * 2, [[a[2]] * 2, [a[3]] * 2], [Evil(), 64], 0, 0, blob, 1)
    with pytest.raises(TypeError, match="addresses must be plain ints"):
        _cpu.step("adam", [True], [a[1]], [[a[2]], [a[3]]], [64], 0, 0, blob, 1)


def test_group_plan_rejects_malformed_entries():
    p = torch.nn.Parameter(torch.zeros(4))
    st = {"step": 1, "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    entry = [0, p, p.dtype, p.shape, p.device, p.data_ptr(), st, (st["exp_avg"], st["exp_avg_sq"]),
             (st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr()), 1]
    _cpu.GroupPlan([p], ["exp_avg", "exp_avg_sq"], [tuple(entry)], [])  # well formed
    with pytest.raises(ValueError, match="an active entry is a tuple"):
        _cpu.GroupPlan([p], ["exp_avg", "exp_avg_sq"], [list(entry)], [])
    entry[7] = list(entry[7])
    with pytest.raises(ValueError, match="state tensors and addresses are tuples"):
        _cpu.GroupPlan([p], ["exp_avg", "exp_avg_sq"], [tuple(entry)], [])


def test_every_rule_has_a_cpu_kernel():
    """contract.RULES and the C++ rule list (adam_types.h) name the same rules (plus the floors)."""
    assert sorted(_cpu.rules()) == sorted([*element_rules(), "floor", "floor1"])


def test_simd_env_override_and_warning(tmp_path):
    import subprocess
    import sys
    code = ("import warnings, mps_fused_adam as m\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    info = m.backend_info()['cpu']\n"
            "print(info['simd'], len(w))\n"
            "print(*(str(x.message) for x in w), sep='\\n')")
    env = dict(__import__("os").environ, MPS_FUSED_ADAM_SIMD="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["scalar", "0"]
    env["MPS_FUSED_ADAM_SIMD"] = "avx9000"  # no such path anywhere: "unknown", with the known ones
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    first, message = out.splitlines()[:2]
    assert first.split() == [_cpu.simd_paths()[0], "1"]
    assert "MPS_FUSED_ADAM_SIMD='avx9000' is unknown (known: avx512bf16, avx512, avx2, neon, scalar)" in message
    # A real path of another architecture: "not supported on this CPU".
    env["MPS_FUSED_ADAM_SIMD"] = "neon" if "neon" not in _cpu.simd_paths() else "avx2"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert f"MPS_FUSED_ADAM_SIMD={env['MPS_FUSED_ADAM_SIMD']!r} is not supported on this CPU" in out


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_prefetch_distance_changes_speed_only(simd, pair):
    """The software prefetch distances (chosen per CPU vendor and dtypes) move no bit: every near
    and far distance, the per-vendor choice included, matches the reference on every SIMD path."""
    tensors = make_tensors(10_000, *pair)
    try:
        for distance in (0, 64, 1024, 65536, None):
            _cpu.set_prefetch_bytes(distance)
            assert_identical(*run_both(tensors, 2))
        # The far prefetch into L2 (per vendor: Intel x86 with fp32 states), forced on here
        # whatever this CPU's choice, past the tensors' ends included.
        _cpu.set_prefetch_bytes(None)
        for far in (64, 8192, 1 << 20, 0, None):
            _cpu.set_far_prefetch_bytes(far)
            assert_identical(*run_both(tensors, 2))
    finally:
        _cpu.set_prefetch_bytes(None)
        _cpu.set_far_prefetch_bytes(None)


@pytest.mark.parametrize("n", [64, 64 + 16, 1000 + 7])
def test_bf16_subnormal_moments_stored_exactly(simd, n):
    """bf16 params and states, from zero moments, with gradients so small that the new moments
    are fp32 subnormals (even elements: m; odd elements: v). Stored bf16 keeps subnormals (torch
    rounds them to nearest even, as the contract does), so a store that flushes them (AVX512_BF16's
    vcvtneps2bf16) must not take such vectors. NaN-free: only the subnormal check routes them.
    Sizes run the pair store (64 elements), a single vector and a scalar tail, with the bf16
    pairs on and off."""
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen).bfloat16()
    g = torch.randn(n, generator=gen)
    g[0::2] *= 1e-38  # m = 0.1 * g: subnormal; v = 0.001 * g * g underflows to 0
    g[1::2] *= 1e-18  # v = 0.001 * g * g: subnormal (bf16 keeps them down to 9e-41); m normal
    g = g.bfloat16()
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    try:
        for pairs in (True, False):  # off: every vector through the single store
            _cpu.set_bf16_pairs(pairs)
            ours, ref = run_both((p, g, m, v), steps=1)
            assert_identical(ours, ref)
    finally:
        _cpu.set_bf16_pairs(True)
    tiny = torch.finfo(torch.float32).tiny
    for name, t in (("exp_avg", ref[2][0::2]), ("exp_avg_sq", ref[3][1::2])):
        sub = (t != 0) & (t.float().abs() < tiny)
        assert sub.sum().item() > n // 4, f"{name}: only {sub.sum().item()} subnormals"
    assert not torch.isnan(ref[0]).any()


@pytest.mark.parametrize("sr", [False, True], ids=["nearest", "stochastic"])
def test_bf16_pairs_change_speed_only(simd, sr):
    """The even/odd-lane path of bf16 params and states (x86) moves no bit: on and off both match
    the reference, rounding to nearest and stochastically, for sizes that end in a pair, a single
    vector and a short tail."""
    from mps_fused_adam.numerics import lowbit
    from mps_fused_adam.numerics.reference_lowbit import reference_adam_sr_
    assert _cpu.bf16_pairs()  # the default
    try:
        for on in (False, True):
            _cpu.set_bf16_pairs(on)
            for n in (64, 64 + 16, 1000 + 7):
                tensors = make_tensors(n, torch.bfloat16, torch.bfloat16)
                if not sr:
                    assert_identical(*run_both(tensors, 2))
                    continue
                ours, ref = [t.clone() for t in tensors], [t.clone() for t in tensors]
                for step in (1, 2):
                    hp = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=step)
                    key = lowbit.sr_key(5, step)
                    CPUBackend().update("adam", [ours[0]], [ours[1]], [[ours[2]], [ours[3]]], hp, sr_keys=[key])
                    reference_adam_sr_(ref[0], ref[1], ref[2], ref[3], hp, key)
                assert_identical(ours, ref)
    finally:
        _cpu.set_bf16_pairs(True)


def test_far_prefetch_choice_and_overrides():
    """The far prefetch: 8 times the near distance for fp32 states on Intel x86 (where it was
    measured), none elsewhere and for 2-byte states; following an overridden near distance
    (MPS_FUSED_ADAM_PREFETCH=0 turns both off); one fixed distance or back to the choice."""
    import platform
    intel = platform.machine() in ("x86_64", "AMD64") and "AuthenticAMD" not in open("/proc/cpuinfo").read()
    try:
        assert _cpu.far_prefetch_bytes(4, 4) == (8 * _cpu.prefetch_bytes(4, 4) if intel else 0)
        assert _cpu.far_prefetch_bytes(2, 4) == (8 * _cpu.prefetch_bytes(2, 4) if intel else 0)
        assert _cpu.far_prefetch_bytes(2, 2) == 0
        _cpu.set_prefetch_bytes(0)
        assert _cpu.far_prefetch_bytes(4, 4) == 0
        _cpu.set_prefetch_bytes(300)
        assert _cpu.far_prefetch_bytes(4, 4) == (2400 if intel else 0)
        _cpu.set_far_prefetch_bytes(4096)
        assert [_cpu.far_prefetch_bytes(p, s) for p, s in ((4, 4), (2, 2), (2, 4))] == [4096] * 3
        for bad in (-2, (1 << 20) + 1):
            with pytest.raises(ValueError, match=f"far prefetch distance must be 0 to 1048576 bytes .*got {bad}"):
                _cpu.set_far_prefetch_bytes(bad)
        assert _cpu.far_prefetch_bytes(2, 2) == 4096  # a rejected value changes nothing
        _cpu.set_far_prefetch_bytes(None)
        assert _cpu.far_prefetch_bytes(2, 2) == 0
    finally:
        _cpu.set_prefetch_bytes(None)
        _cpu.set_far_prefetch_bytes(None)


def test_prefetch_distance_choice_and_overrides():
    import os
    import subprocess
    try:
        for psize, ssize in ((4, 4), (2, 2), (2, 4)):
            assert _cpu.prefetch_bytes(psize, ssize) in (0, 512, 1024)
        _cpu.set_prefetch_bytes(256)
        assert [_cpu.prefetch_bytes(p, s) for p, s in ((4, 4), (2, 2), (2, 4))] == [256] * 3
        for bad in (-2, 65537):
            with pytest.raises(ValueError, match=f"prefetch distance must be 0 to 65536 bytes .*got {bad}"):
                _cpu.set_prefetch_bytes(bad)
        assert _cpu.prefetch_bytes(4, 4) == 256  # a rejected value changes nothing
    finally:
        _cpu.set_prefetch_bytes(None)
    code = ("import warnings\nfrom mps_fused_adam import _cpu\nfrom mps_fused_adam.backends import CPUBackend\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    CPUBackend()\n"
            "print(_cpu.prefetch_bytes(4, 4), _cpu.prefetch_bytes(2, 2), len(w))\n"
            "print(*(str(x.message) for x in w))")
    default = f"{_cpu.prefetch_bytes(4, 4)} {_cpu.prefetch_bytes(2, 2)}"
    for value, expected, warned in (("128", "128 128", 0), ("0", "0 0", 0), ("65536", "65536 65536", 0),
                                    ("lots", default, 1), ("-5", default, 1), ("+64", default, 1),
                                    ("65537", default, 1)):
        env = dict(os.environ, MPS_FUSED_ADAM_PREFETCH=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        first, message = (out.stdout.splitlines() + [""])[:2]
        assert first.split() == [*expected.split(), str(warned)], value
        if warned:
            assert f"MPS_FUSED_ADAM_PREFETCH={value!r} is not a byte count from 0 to 65536" in message
