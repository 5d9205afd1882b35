"""Every rule of contract.RULES but Adam (Lion, Adagrad; Adam's own tests: test_cpu_kernel.py,
test_metal_emulator.py) on the CPU kernel (every SIMD path), the foreach tier and the Metal
kernels, against the reference, with each rule's example (contract.Example).

All follow the contracts of contract.py operation for operation, so every result must equal the
reference bit for bit, in every (param, state) dtype pair, for NaN, infinities, signed zeros and
denormals too. (The Metal kernels of the same rules: tests/test_metal_emulator.py.)
"""
from __future__ import annotations

import pytest
import torch

from mps_fused_adam import _cpu
from mps_fused_adam.backends import CPUBackend, ForeachBackend
from mps_fused_adam.numerics.contract import RULES, LionHyper, element_rules, example
from mps_fused_adam.numerics.reference import reference_step_

from conftest import DTYPE_PAIRS, pair_id
from optim_db import rule_example_class

# Adam has its own, deeper tests (test_cpu_kernel.py, test_metal_emulator.py); every other rule runs here.
RULE_NAMES = [name for name in element_rules() if name != "adam"]
SPECIALS = [float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 0.0, -0.0, 6e-8, 65504.0, 1e30]


def hyper(rule: str, step: int, maximize: bool = False, weight_decay: float = 0.1):
    return example(rule).hyper(step, maximize=maximize, weight_decay=weight_decay)


def make(rule: str, n: int, pdtype, sdtype, seed: int = 0, specials: bool = False) -> list[torch.Tensor]:
    """[param, grad, *states]: the states drawn as the rule's example says (non-negative ones from
    0.01 * U[0, 1), the others from 0.1 * N(0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(pdtype)
    g = (0.5 * torch.randn(n, generator=gen)).to(pdtype)
    nonneg = [name in example(rule).nonnegative for name in RULES[rule].states]
    states = [(0.01 * torch.rand(n, generator=gen) if pos else 0.1 * torch.randn(n, generator=gen)).to(sdtype)
              for pos in nonneg]
    if specials:
        k = len(SPECIALS)
        sp = torch.tensor(SPECIALS)
        g[:k] = sp.to(pdtype)
        p[k:2 * k] = sp.to(pdtype)
        g[3 * k:4 * k] = 0.0  # Lion: c = beta1 * m exactly, and c = 0 where m = 0
        for s, pos in zip(states, nonneg):
            s[2 * k:3 * k] = sp.abs().to(sdtype) if pos else sp.to(sdtype)
            s[3 * k:3 * k + 3] = 0.0
    return [p, g, *states]


def state_lists(tensors) -> list[list[torch.Tensor]]:
    """The backends' state lists of one [param, grad, *states]."""
    return [[s] for s in tensors[2:]]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_identical(ours, ref, what=""):
    """Bit for bit, except that any NaN equals any NaN. The contract fixes where NaN appears, not
    its sign or payload: IEEE 754 leaves open which operand's NaN an operation returns (x86 returns
    the first, and a compiler may commute ``a + b``), and torch's own bf16 conversion writes 0xFFFF
    in its vector loop and 0x7FC0 in its scalar tail."""
    assert len(ours) == len(ref)
    for name, a, b in zip(("param", "grad", *(f"state {i}" for i in range(len(ours) - 2))), ours, ref):
        assert a.dtype == b.dtype
        na, nb = torch.isnan(a), torch.isnan(b)
        assert torch.equal(na, nb), f"{what}{name}: NaN in different places than the reference"
        assert torch.equal(bits(a)[~na], bits(b)[~nb]), f"{what}{name} differs from the reference"


def run(backend, rule, tensors, steps, **kw):
    ours = [t.clone() for t in tensors]
    ref = [t.clone() for t in tensors]
    for step in range(1, steps + 1):
        hp = hyper(rule, step, **kw)
        backend.update(rule, [ours[0]], [ours[1]], state_lists(ours), hp)
        reference_step_(rule, ref[0], ref[1], ref[2:], hp)
    return ours, ref


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
@pytest.mark.parametrize("n,maximize,wd", [(1, False, 0.1), (7, True, 0.1), (4097, False, 0.0), (4097, True, 0.1),
                                           ((1 << 20) + 3, False, 0.1)])
def test_cpu_kernel_matches_reference(simd, rule, pair, n, maximize, wd):
    tensors = make(rule, n, *pair, seed=n)
    ours, ref = run(CPUBackend(), rule, tensors, steps=3, maximize=maximize, weight_decay=wd)
    assert_identical(ours, ref, f"{simd} {rule}: ")
    assert not torch.equal(ours[0], tensors[0]) and all(not torch.equal(a, b) for a, b in zip(ours[2:], tensors[2:]))


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_special_values_on_every_simd_path(simd, rule, pair):
    """NaN, infinities, signed zeros, denormals and a zero momentum (Lion's sign(0) = +0)."""
    tensors = make(rule, 4096 + 13, *pair, seed=3, specials=True)
    ours, ref = run(CPUBackend(), rule, tensors, steps=2)
    assert_identical(ours, ref, f"{simd} {rule}: ")
    assert torch.isnan(ours[0][:1].float()).all(), "a NaN gradient must reach the parameter"


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_simd_paths_agree_with_scalar(rule, pair):
    tensors = make(rule, 4096 + 13, *pair, seed=4, specials=True)
    results = {}
    before = _cpu.simd_path()
    try:
        for path in _cpu.simd_paths():
            _cpu.set_simd_path(path)
            out = [t.clone() for t in tensors]
            for step in (1, 2):
                CPUBackend().update(rule, [out[0]], [out[1]], state_lists(out), hyper(rule, step))
            results[path] = out
    finally:
        _cpu.set_simd_path(before)
    for path, out in results.items():
        assert_identical(out, results["scalar"], f"{path} vs scalar: ")


def test_lion_zero_momentum_leaves_param_bits():
    """c = 0 exactly (zero momentum and gradient): the parameter keeps its bits, -0 included."""
    p = torch.tensor([-0.0, 0.0, 1.5, -2.0] * 5)
    g = torch.zeros(20)
    m = torch.zeros(20)
    before = p.clone()
    CPUBackend().update("lion", [p], [g], [[m]], LionHyper(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0))
    assert torch.equal(bits(p), bits(before))


@pytest.mark.parametrize("lr", [-1e-2, -0.0, 0.0, 1e-2])
@pytest.mark.parametrize("pair", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)], ids=pair_id)
def test_lion_lr_sign_on_every_simd_path(simd, lr, pair):
    """The kernels form lr * sign(c) from lr's bits where lr's sign bit is clear and multiply
    where it is set (DeepSpeed's op calls pass lr unvalidated): both give the reference's bits,
    signed zeros of c and of the param included (lr = -0: lr * sign(+-0) = -0, so p = -0 becomes +0)."""
    p, g, m = make("lion", 4096 + 13, *pair, seed=5, specials=True)
    p[-40:] = torch.tensor([-0.0, 0.0] * 20).to(pair[0])
    g[-40:] = 0.0
    m[-40:] = torch.tensor([0.0, -0.0, -0.0, 0.0] * 10).to(pair[1])
    hp = LionHyper(lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.0)
    ours, ref = [p.clone(), g.clone(), m.clone()], [p.clone(), g.clone(), m.clone()]
    CPUBackend().update("lion", [ours[0]], [ours[1]], [[ours[2]]], hp)
    reference_step_("lion", ref[0], ref[1], [ref[2]], hp)
    assert_identical(ours, ref, f"{simd} lr={lr}: ")
    if str(lr) == "-0.0":  # c = +-0 gives lr * +0 = -0, and -0 - (-0) is +0
        assert not torch.signbit(ours[0][-40:].float()).any()


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_many_tensors_one_call_two_threads(rule):
    shapes = [int(s) for s in torch.randint(1, 3000, (500,))]
    tensors = [make(rule, n, torch.bfloat16, torch.float32, seed=i) for i, n in enumerate(shapes)]
    ours = [[t.clone() for t in ts] for ts in tensors]
    hp = hyper(rule, 1)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        CPUBackend().update(rule, [t[0] for t in ours], [t[1] for t in ours],
                            [[t[k] for t in ours] for k in range(2, len(ours[0]))], hp)
    finally:
        torch.set_num_threads(old)
    for ts, out in zip(tensors, ours):
        ref = [t.clone() for t in ts]
        reference_step_(rule, ref[0], ref[1], ref[2:], hp)
        assert_identical(out, ref)


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_foreach_tier_matches_reference(rule, pair):
    tensors = make(rule, 1000, *pair, seed=5, specials=True)
    ours, ref = run(ForeachBackend(), rule, tensors, steps=3, maximize=True)
    assert_identical(ours, ref, f"foreach {rule}: ")


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_cpu_rejects_wrong_state_count_and_struct(rule):
    blob = RULES[rule].pack(hyper(rule, 1))
    k = len(RULES[rule].states)
    with pytest.raises(ValueError, match=f"rule '{rule}' has {k} states; got {k + 1} state lists"):
        _cpu.step(rule, [], [], [[]] * (k + 1), [], 0, 0, blob, 1)
    with pytest.raises(ValueError, match=f"{len(blob)}-byte scalar struct; got {len(blob) - 4} bytes"):
        _cpu.step(rule, [], [], [[]] * k, [], 0, 0, blob[:-4], 1)


# --- The Metal kernels (fused_<rule>_*), run by the host emulator and tiers 1-3 ---

@pytest.fixture(scope="session")
def kernel_emu(emulator_cxx):
    """The host emulator under each compiler (conftest.emulator_cxx), for the kernel-level tests;
    the tiers' tests below take conftest's ``emu``."""
    from emulated_mps import build_emulator
    return build_emulator(cxx=emulator_cxx)


def run_emulated(emu, rule, tensors, steps, **dispatch_kw):
    ours = [t.clone() for t in tensors]
    ref = [t.clone() for t in tensors]
    for step in range(1, steps + 1):
        hp = hyper(rule, step, maximize=step == 2)
        m, v = (ours[2:] + [None])[:2]  # the emulator's two state slots; v is None for one state
        emu.run_tensors(ours[0], ours[1], m, v, RULES[rule].pack(hp), rule=rule, **dispatch_kw)
        reference_step_(rule, ref[0], ref[1], ref[2:], hp)
    return ours, ref


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
@pytest.mark.parametrize("n", [1, 3, 4, 5, 4097, 100_003])
def test_metal_kernel_matches_reference(kernel_emu, rule, pair, n):
    tensors = make(rule, n, *pair, seed=n, specials=n > 40)
    ours, ref = run_emulated(kernel_emu, rule, tensors, steps=3)
    assert_identical(ours, ref, f"fused_{rule} ")
    assert all(not torch.equal(a, b) for a, b in zip(ours[2:], tensors[2:]))


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("group", [1, 7, 256])
def test_metal_group_size_and_order_do_not_matter(kernel_emu, rule, group):
    tensors = make(rule, 4099, torch.bfloat16, torch.float32, seed=2)
    want, _ = run_emulated(kernel_emu, rule, tensors, steps=2)
    got, _ = run_emulated(kernel_emu, rule, tensors, steps=2, group=group, reverse=True)
    assert_identical(got, want)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_metal_one_state_shape_indices_past_2_pow_32(kernel_emu, rule):
    """The one-state kernel shape binds base and n at buffers 4 and 5; a dispatch whose base is past
    2^32 must index with 64 bits (see test_metal_emulator.test_indices_past_2_pow_32)."""
    from mps_fused_adam.backends.mps import KERNELS
    base = (1 << 32) + (1 << 30)
    count = 4099
    tensors = make(rule, count, torch.float16, torch.float32, seed=9)
    ours = [t.clone() for t in tensors]
    hp = hyper(rule, 1)
    addrs = tuple((t.data_ptr() - base * t.element_size()) % 2**64 for t in ours)
    kernel_emu.dispatch(KERNELS[(rule, torch.float16, torch.float32)], addrs, RULES[rule].pack(hp), base, base + count,
                        -(-count // 4), 256)
    ref = [t.clone() for t in tensors]
    reference_step_(rule, ref[0], ref[1], ref[2:], hp)
    assert_identical(ours, ref)


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_mps_tiers_1_to_3_match_reference(emu, pkg, rule, pair):
    """The three MPS tiers' dispatch code (backends/mps.py), its Apple pieces replaced by stand-ins
    that run the shipped kernels (tests/support/emulated_mps.py), on params at odd storage offsets."""
    from emulated_mps import make_backend
    flat = make(rule, 5000, *pair, seed=1)
    sizes, off = (1, 5, 4097, 3), 1
    views = []
    for n in sizes:
        views.append([t[off:off + n] for t in flat])
        off += n + 1
    want = [[t.clone() for t in v] for v in views]
    for step in (1, 2):
        for v in want:
            reference_step_(rule, v[0], v[1], v[2:], hyper(rule, step))
    for tier in (1, 2, 3):
        got = [[t.clone() for t in v] for v in views]
        backend = make_backend(tier, pkg, emu)
        for step in (1, 2):
            backend.update(rule, [v[0] for v in got], [v[1] for v in got],
                           [[v[k] for v in got] for k in range(2, len(flat))], hyper(rule, step))
        for g, w in zip(got, want):
            assert_identical(g, w, f"tier {tier} ({backend.name}) {rule}: ")


@pytest.mark.parametrize("tier", [1, 2, 3])
def test_optimizer_classes_through_metal_tiers(monkeypatch, emu, pkg, tier):
    """Each rule's public class (contract.Example.optimizer, with its example arguments), optimizer
    to Metal dispatch, on mixed dtypes, against the reference with the rule's example hyperparameters."""
    import mps_fused_adam as mfa
    from emulated_mps import make_backend
    from mps_fused_adam import backends
    monkeypatch.setitem(backends._chosen, "cpu", make_backend(tier, pkg, emu))
    for rule in RULE_NAMES:
        ex = example(rule)
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d))
                  for s, d in (((33, 7), torch.float32), ((4097,), torch.float16), ((5,), torch.bfloat16))]
        opt = getattr(mfa, ex.optimizer)(params, **rule_example_class(rule).example_kwargs)
        group = opt.param_groups[0]
        # The states' start is the class's (Adagrad's initial_accumulator_value); the steps' hyperparameters
        # are the example's, not the class's own _hyper.
        refs = [[p.detach().clone()] + [opt._new_state(p, name, opt._state_dtype(p), group).clone()
                                        for name in RULES[rule].states] for p in params]
        for step in (1, 2, 3):
            for p, r in zip(params, refs):
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
                reference_step_(rule, r[0], p.grad, r[1:], ex.hyper(step))
            opt.step()
        for p, r in zip(params, refs):
            assert torch.equal(bits(p.detach()), bits(r[0])), (rule, p.dtype)
            for name, want in zip(RULES[rule].states, r[1:]):
                assert torch.equal(opt.state[p][name], want), (rule, name)


def test_selfcheck_covers_every_rule():
    """``python -m mps_fused_adam``'s self-check runs every rule of contract.RULES on a backend
    (on a Mac: each Metal tier, against the contract's bound); on CPU all are bit for bit."""
    from mps_fused_adam.tools.selfcheck import check_backend
    results = list(check_backend(CPUBackend(), "cpu", "_cpu", n=257))
    assert len(results) == 5 * len(element_rules())
    assert {r.dtypes.split()[0] for r in results if " " in r.dtypes} == set(element_rules()) - {"adam"}
    assert all(r.passed and r.bit_exact for r in results), [r for r in results if not r.bit_exact]
