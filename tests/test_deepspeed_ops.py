"""The DeepSpeed op facades (mps_fused_adam.deepspeed.ops) against independent references.

These need no DeepSpeed: the facades are what DeepSpeed's builders return, tested through the
exact call signatures DeepSpeed uses (deepspeed/ops/adam/fused_adam.py and cpu_adam.py, 0.19.8).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.deepspeed import ops
from mps_fused_adam.numerics.reference import reference_adam_

PAIRS = [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.float16, torch.float16),
         (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


def _ids(pair):
    return "-".join(str(d).replace("torch.", "") for d in pair)


def _bound(ref: torch.Tensor) -> float:
    """The contract's bound: within 8 * eps(dtype) * max|ref| of the reference."""
    return 8 * torch.finfo(ref.dtype).eps * max(ref.float().abs().max().item(), 1e-30)


def _state(n: int, dtype, state_dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(dtype)
    grad = torch.randn(n, generator=g).to(dtype)
    m = (0.1 * torch.randn(n, generator=g)).to(state_dtype)
    v = (0.01 * torch.rand(n, generator=g)).to(state_dtype)
    return p, grad, m, v


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.dtype == ref.dtype
    diff = (got.float() - ref.float()).abs().max().item()
    assert diff <= _bound(ref), f"{what}: max diff {diff:.3e} > bound {_bound(ref):.3e}"


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("adam_w_mode", [1, 0])
@pytest.mark.parametrize("bias_correction", [1, 0])
def test_multi_tensor_adam_matches_reference(pair, adam_w_mode, bias_correction):
    dtype, state_dtype = pair
    sizes = [1, 7, 4097]
    tensors = [_state(n, dtype, state_dtype, seed=i) for i, n in enumerate(sizes)]
    expected = [tuple(t.clone() for t in ts) for ts in tensors]
    lr, b1, b2, eps, wd, step = 3e-3, 0.9, 0.99, 1e-8, 0.05, 3
    lists = [[t[1] for t in tensors], [t[0] for t in tensors], [t[2] for t in tensors], [t[3] for t in tensors]]
    ops.FUSED_ADAM_OP.multi_tensor_adam(2048 * 32, torch.zeros(1, dtype=torch.int32), lists,
                                        lr, b1, b2, eps, step, adam_w_mode, bias_correction, wd)
    hp = AdamHyper(lr, b1, b2, eps, wd, step, adam_w_mode=bool(adam_w_mode), bias_correction=bool(bias_correction))
    for (p, g, m, v), (rp, rg, rm, rv) in zip(tensors, expected):
        reference_adam_(rp, rg, rm, rv, hp)
        _assert_close(p, rp, "param")
        _assert_close(m, rm, "exp_avg")
        _assert_close(v, rv, "exp_avg_sq")


def test_multi_tensor_adam_modes_and_bias_correction_matter():
    """The flags reach the kernel: each of the four combinations gives a different result."""
    results = {}
    for mode in (0, 1):
        for bc in (0, 1):
            p, g, m, v = _state(257, torch.float32, torch.float32, seed=5)
            ops.FUSED_ADAM_OP.multi_tensor_adam(1, None, [[g], [p], [m], [v]], 1e-2, 0.9, 0.999, 1e-8, 2, mode, bc, 0.1)
            results[(mode, bc)] = p
    keys = list(results)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert not torch.equal(results[a], results[b]), f"{a} and {b} gave identical params"


def test_multi_tensor_adam_mixed_lists_leaf_bf16_and_noncontiguous():
    """One call with mixed dtypes (grouped per dtype), a bf16 leaf that requires grad (DeepSpeed
    passes bf16 params that way), a non-contiguous view, an fp32 grad for a bf16 param, an empty
    tensor."""
    leaf = torch.randn(33, dtype=torch.bfloat16).requires_grad_()
    base = torch.randn(8, 6)
    view = base.t()  # non-contiguous: DeepSpeed's CPU kernel would silently lose this update
    p16 = torch.randn(9, dtype=torch.float16)
    empty = torch.empty(0)
    params = [leaf, view, p16, empty]
    grads = [torch.randn(33), torch.randn(6, 8), torch.randn(9, dtype=torch.float16), torch.empty(0)]
    grads_as_param = [grads[0].to(torch.bfloat16), grads[1], grads[2], grads[3]]
    ms = [torch.zeros(33, dtype=torch.bfloat16), torch.zeros(8, 6).t(), torch.zeros(9, dtype=torch.float16),
          torch.empty(0)]
    vs = [torch.zeros_like(m) for m in ms]
    refs = [(p.detach().clone(), g.clone(), m.clone(), v.clone()) for p, g, m, v in zip(params, grads_as_param, ms, vs)]
    ops.reset_kernel_calls()
    ops.FUSED_ADAM_OP.multi_tensor_adam(1, None, [grads, params, ms, vs], 1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.01)
    assert leaf.requires_grad and leaf.grad_fn is None
    hp = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.01, 1)
    for (p, m, v), (rp, rg, rm, rv) in zip(zip(params, ms, vs), refs):
        if p.numel() == 0:
            continue
        reference_adam_(rp, rg, rm, rv, hp)
        _assert_close(p.detach(), rp, "param")
        _assert_close(m, rm, "exp_avg")
    # Three (device, dtype, state dtype) groups -> three backend calls; the empty tensor is skipped.
    assert sum(ops.kernel_calls().values()) == 3


def test_multi_tensor_adam_rejects_bad_lists():
    p, g, m, v = _state(4, torch.float32, torch.float32, seed=1)
    with pytest.raises(ValueError, match="tensor_lists"):
        ops.FUSED_ADAM_OP.multi_tensor_adam(1, None, [[g], [p], [m]], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    with pytest.raises(ValueError, match="differ in length"):
        ops.FUSED_ADAM_OP.multi_tensor_adam(1, None, [[g], [p], [m], []], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    with pytest.raises(ValueError, match="shape"):
        ops.FUSED_ADAM_OP.multi_tensor_adam(1, None, [[g[:2]], [p], [m], [v]], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    before = p.clone()
    with pytest.raises(TypeError, match="state dtype"):
        ops.FUSED_ADAM_OP.multi_tensor_adam(1, None, [[g], [p], [m.half()], [v.half()]], 1e-3, 0.9, 0.999, 1e-8, 1,
                                            1, 1, 0.0)
    assert torch.equal(p, before), "a rejected call must change nothing"


# --- CPU Adam: create_adam / adam_update / adam_rollback / destroy_adam ---------------------------

@pytest.fixture
def cpu_op():
    op = ops.CPUAdamOp()
    yield op


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_update_matches_reference(cpu_op, pair, adamw_mode, bias_correction):
    dtype, state_dtype = pair
    cpu_op.create_adam(3, 1e-3, 0.9, 0.999, 1e-8, 0.0, adamw_mode, False)
    p, g, m, v = _state(4097, dtype, state_dtype, seed=11)
    rp, rg, rm, rv = (t.clone() for t in (p, g, m, v))
    # DeepSpeed passes the group's current hyperparameters on every call; they override create_adam's.
    assert cpu_op.adam_update(3, 4, 2e-3, 0.8, 0.99, 1e-6, 0.1, bias_correction, p, g, m, v) == 0
    reference_adam_(rp, rg, rm, rv, AdamHyper(2e-3, 0.8, 0.99, 1e-6, 0.1, 4, adam_w_mode=adamw_mode,
                                              bias_correction=bias_correction))
    _assert_close(p, rp, "param")
    _assert_close(m, rm, "exp_avg")
    _assert_close(v, rv, "exp_avg_sq")


def test_adam_update_mode_is_per_id(cpu_op):
    """adamw_mode is fixed per optimizer id at create_adam; two ids on the same inputs differ."""
    cpu_op.create_adam(0, 1e-3, 0.9, 0.999, 1e-8, 0.1, True, False)
    cpu_op.create_adam(1, 1e-3, 0.9, 0.999, 1e-8, 0.1, False, False)
    out = {}
    for opt_id, mode in ((0, True), (1, False)):
        p, g, m, v = _state(100, torch.float32, torch.float32, seed=3)
        rp, rg, rm, rv = (t.clone() for t in (p, g, m, v))
        cpu_op.adam_update(opt_id, 1, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, p, g, m, v)
        reference_adam_(rp, rg, rm, rv, AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, 1, adam_w_mode=mode))
        _assert_close(p, rp, f"param (id {opt_id})")
        out[opt_id] = p
    assert not torch.equal(out[0], out[1])


def test_adam_update_same_step_repeats_bit_for_bit(cpu_op):
    """DeepSpeed's ZeRO-3 sub-groups call adam_update with the same step once per sub-group, and
    re-run a step after a rollback: the update must depend on the step argument only."""
    cpu_op.create_adam(7, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    p, g, m, v = _state(10_000, torch.float32, torch.float32, seed=21)
    for step in (1, 2):
        cpu_op.adam_update(7, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, p, g, m, v)
    snapshot = [t.clone() for t in (p, g, m, v)]
    cpu_op.adam_update(7, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, p, g, m, v)
    first = [t.clone() for t in (p, m, v)]
    p2, g2, m2, v2 = (t.clone() for t in snapshot)
    cpu_op.adam_update(7, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, p2, g2, m2, v2)
    for a, b in zip(first, (p2, m2, v2)):
        assert torch.equal(a, b)
    # The same step split into two sub-groups, each its own call, equals the whole tensor at once.
    p3, g3, m3, v3 = (t.clone() for t in snapshot)
    for sl in (slice(0, 4321), slice(4321, None)):
        cpu_op.adam_update(7, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, p3[sl], g3[sl], m3[sl], v3[sl])
    for a, b in zip(first, (p3, m3, v3)):
        assert torch.equal(a, b)


def _rollback_numpy(p, g, m, v, lr, b1, b2, eps, wd, step):
    """The AdamW rollback DeepSpeed defines (the algebraic inverse of the step from the updated
    moments, csrc/adam/cpu_adam_impl.cpp's adamw_rollback_inplace), written for the step of
    contract v2 in numpy float32, with the fp32 scalars our update used (contract.adam_scalars)."""
    from mps_fused_adam.numerics.contract import adam_scalars
    k = adam_scalars(AdamHyper(lr, b1, b2, eps, wd, step))
    f = np.float32
    p, g, m, v = (t.numpy().astype(np.float32, copy=True) for t in (p, g, m, v))
    denom = np.sqrt(v) * f(k.d2) + f(k.eps)
    new_p = (p + f(k.step_size) * (m / denom)) / f(k.decay)
    new_p[~np.isfinite(new_p)] = 0
    m = (m - f(k.one_minus_beta1) * g) / f(k.beta1)
    v = (v - f(k.one_minus_beta2) * (g * g)) / f(k.beta2)
    return new_p, m, v


def test_adam_rollback_inverts_the_contract_step_and_restores(cpu_op):
    cpu_op.create_adam(2, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    p, g, m, v = _state(5000, torch.float32, torch.float32, seed=8)
    v.add_(1e-4)  # keep v well above rounding noise so the inversion is well conditioned
    for step in (1, 2):
        cpu_op.adam_update(2, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, p, g, m, v)
    before = [t.clone() for t in (p, m, v)]
    g3 = torch.randn(5000)
    cpu_op.adam_update(2, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, p, g3, m, v)
    assert (p - before[0]).abs().max() > 1e-4  # the step moved the params, so restoring them means something
    expected = _rollback_numpy(p, g3, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3)
    assert cpu_op.adam_rollback(2, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, p, g3, m, v) == 0
    for got, exp, name in zip((p, m, v), expected, ("param", "exp_avg", "exp_avg_sq")):
        np.testing.assert_array_equal(got.numpy(), exp, err_msg=f"{name} differs from the numpy inverse")
    # And it undoes the step, up to fp32 rounding of the inversion (relative to each tensor's scale).
    for got, old, name in zip((p, m, v), before, ("param", "exp_avg", "exp_avg_sq")):
        err = (got - old).abs().max().item() / old.abs().max().item()
        assert err < 1e-5, f"{name} not restored: relative error {err:.2e}"


@pytest.mark.parametrize("adamw_mode,bias_correction", [(False, True), (True, False), (False, False)])
def test_adam_rollback_inverts_other_modes(cpu_op, adamw_mode, bias_correction):
    """Where DeepSpeed's rollback ignores the flags (it always inverts a bias-corrected AdamW step),
    ours inverts the step that was taken."""
    cpu_op.create_adam(4, 1e-3, 0.9, 0.999, 1e-8, 0.05, adamw_mode, False)
    p, g, m, v = _state(3000, torch.float32, torch.float32, seed=9)
    v.add_(1e-4)
    before = [t.clone() for t in (p, m, v)]
    cpu_op.adam_update(4, 2, 1e-2, 0.9, 0.999, 1e-8, 0.05, bias_correction, p, g, m, v)
    assert not torch.equal(p, before[0])
    cpu_op.adam_rollback(4, 2, 1e-2, 0.9, 0.999, 1e-8, 0.05, bias_correction, p, g, m, v)
    for got, old, name in zip((p, m, v), before, ("param", "exp_avg", "exp_avg_sq")):
        err = (got - old).abs().max().item() / old.abs().max().item()
        assert err < 1e-5, f"{name} not restored: relative error {err:.2e}"


def test_adam_rollback_rejects_step_zero(cpu_op):
    """(fp16/bf16 rollbacks are tested in test_deepspeed_rollback.py.)"""
    cpu_op.create_adam(5, adamw_mode=True)
    p, g, m, v = _state(10, torch.float32, torch.float32, seed=2)
    before = p.clone()
    with pytest.raises(ValueError, match="step"):
        cpu_op.adam_rollback(5, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, p, g, m, v)
    assert torch.equal(p, before)


def test_unknown_and_destroyed_ids(cpu_op):
    p, g, m, v = _state(10, torch.float32, torch.float32, seed=2)
    with pytest.raises(KeyError, match="create_adam"):
        cpu_op.adam_update(42, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, p, g, m, v)
    cpu_op.create_adam(42)
    cpu_op.adam_update(42, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, p, g, m, v)
    assert cpu_op.destroy_adam(42) == 0
    with pytest.raises(KeyError):
        cpu_op.adam_update(42, 2, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, p, g, m, v)
    assert cpu_op.destroy_adam(42) == 0  # destroying twice is harmless, as in DeepSpeed


def test_create_adam_should_log_names_backend(cpu_op, capsys):
    cpu_op.create_adam(9, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    out = capsys.readouterr().out
    assert "Adam Optimizer #9" in out and "mps_fused_adam" in out


def test_importing_glue_does_not_import_deepspeed():
    import subprocess
    code = ("import sys, mps_fused_adam.deepspeed, mps_fused_adam.deepspeed.ops; "
            "assert 'deepspeed' not in sys.modules, sorted(m for m in sys.modules if m.startswith('deepspeed'))")
    env = dict(os.environ)
    import mps_fused_adam.deepspeed as mfd
    from pathlib import Path
    env["PYTHONPATH"] = str(Path(mfd.__file__).resolve().parents[2])
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def test_against_deepspeeds_own_cpu_adam(cpu_op):
    """Our facade vs DeepSpeed's own C++ op, update and rollback. Its .so is JIT-built once by
    .ci/run (a compiler is needed for that, never by the package) and named by MFA_DS_CPU_ADAM_SO."""
    import importlib.util
    if not os.environ.get("MFA_DS_CPU_ADAM_SO"):
        msg = "cross-check against a JIT-built DeepSpeed cpu_adam: set MFA_DS_CPU_ADAM_SO to its .so"
        if os.environ.get("MFA_REQUIRE_DEEPSPEED"):
            pytest.fail(msg + " (MFA_REQUIRE_DEEPSPEED is set)")
        pytest.skip(msg)
    spec = importlib.util.spec_from_file_location("cpu_adam", os.environ["MFA_DS_CPU_ADAM_SO"])
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    for mod in (ds, cpu_op):
        mod.create_adam(0, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    a = list(_state(4099, torch.float32, torch.float32, seed=4))
    a[3].add_(1e-4)
    b = [t.clone() for t in a]

    def rel(x, y):
        return (x - y).abs().max().item() / y.abs().max().item()

    # DeepSpeed rounds 1 - beta to fp32 after rounding beta (1 - 0.999 becomes 0.99998713e-3, 1.3e-5
    # off), the contract rounds 1 - beta computed in double; so exp_avg_sq differs by about 1e-5
    # relative and the rest by less. Anything beyond 3e-5 would be a real semantic difference.
    for step in (1, 2):
        ds.adam_update(0, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, *a)
        cpu_op.adam_update(0, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, *b)
    snap_a, snap_b = [t.clone() for t in a], [t.clone() for t in b]
    ds.adam_update(0, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, *a)
    cpu_op.adam_update(0, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, *b)
    for x, y, name in zip(a, b, ("param", "grad", "exp_avg", "exp_avg_sq")):
        assert rel(x, y) <= 3e-5, f"update: {name} differs from DeepSpeed's by {rel(x, y):.2e}"
    ds.adam_rollback(0, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, *a)
    cpu_op.adam_rollback(0, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, *b)
    for x, y, sx, sy, name in zip(a, b, snap_a, snap_b, ("param", "grad", "exp_avg", "exp_avg_sq")):
        assert rel(x, sx) <= 1e-5, f"DeepSpeed's rollback left {name} {rel(x, sx):.2e} from its pre-step state"
        assert rel(y, sy) <= 1e-5, f"our rollback left {name} {rel(y, sy):.2e} from its pre-step state"
        assert rel(x, y) <= 3e-5, f"rollback: {name} differs from DeepSpeed's by {rel(x, y):.2e}"


def test_adam_rollback_non_finite_param_becomes_zero(cpu_op):
    """DeepSpeed's rollback replaces a non-finite restored parameter by 0; so does ours."""
    cpu_op.create_adam(6, adamw_mode=True)
    p, g, m, v = _state(8, torch.float32, torch.float32, seed=12)
    p[3] = float("inf")
    cpu_op.adam_rollback(6, 2, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, p, g, m, v)
    assert p[3].item() == 0.0 and torch.isfinite(p).all()


def test_redirect_policy():
    """Which builder class DeepSpeed gets: ours for the two Adam ops, an unavailable subclass for
    ops we ship no kernel for, DeepSpeed's own for prebuilt ops, None where DeepSpeed has none."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support", "deepspeed_support"))
    import dsenv
    dsenv.require_deepspeed()
    from mps_fused_adam.deepspeed import builders

    class Base:
        NAME = "base"

        def __init__(self):
            self.name = self.NAME

        def is_compatible(self, verbose=False):
            return True

    class Shm(Base):
        NAME = "deepspeed_shm_comm"

    class Fused(Base):
        NAME = "fused_adam"

    table = {"ShareMemCommBuilder": Shm, "FusedAdamBuilder": Fused}
    redirect = builders.Redirect(block_jit=True)
    redirect.prebuilt = set()
    fused = redirect.resolve("FusedAdamBuilder", table.get)
    assert issubclass(fused, Fused) and fused.NAME == "fused_adam"
    assert fused().load() is ops.FUSED_ADAM_OP and fused().is_compatible()
    assert redirect.resolve("FusedAdamBuilder", table.get) is fused  # the same class every time
    shm = redirect.resolve("ShareMemCommBuilder", table.get)
    assert issubclass(shm, Shm) and shm.NAME == "deepspeed_shm_comm" and not shm().is_compatible()
    with pytest.raises(RuntimeError, match="would be JIT-compiled"):
        shm().load()
    assert redirect.resolve("ShareMemCommBuilder", lambda name: shm) is shm  # never wrapped twice
    assert redirect.resolve("NoSuchBuilder", table.get) is None
    redirect.prebuilt = {"deepspeed_shm_comm"}  # DS_BUILD_OPS=1 installs: loading compiles nothing
    assert redirect.resolve("ShareMemCommBuilder", table.get) is Shm
    assert builders.Redirect(block_jit=False).resolve("ShareMemCommBuilder", table.get) is Shm


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_applies_weight_decay_only_when_positive(cpu_op, adamw_mode):
    """DeepSpeed's CPU Adam tests ``weight_decay > 0`` in both modes (its Python class never
    rejects a negative value): a negative one means none, for the update and its rollback alike.
    The fused multi_tensor_adam applies any value, as DeepSpeed's CUDA kernel does."""
    cpu_op.create_adam(7, adamw_mode=adamw_mode)
    a = list(_state(257, torch.float32, torch.float32, seed=5))
    a[3].add_(1e-4)
    b = [t.clone() for t in a]
    cpu_op.adam_update(7, 2, 1e-2, 0.9, 0.999, 1e-8, -0.5, True, *a)
    cpu_op.adam_update(7, 2, 1e-2, 0.9, 0.999, 1e-8, 0.0, True, *b)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    cpu_op.adam_rollback(7, 2, 1e-2, 0.9, 0.999, 1e-8, -0.5, True, *a)
    cpu_op.adam_rollback(7, 2, 1e-2, 0.9, 0.999, 1e-8, 0.0, True, *b)
    assert all(torch.equal(x, y) for x, y in zip(a, b))

    p, g, m, v = _state(257, torch.float32, torch.float32, seed=6)
    ref = [t.clone() for t in (p, g, m, v)]
    ops.FUSED_ADAM_OP.multi_tensor_adam(1, None, [[g], [p], [m], [v]], 1e-2, 0.9, 0.999, 1e-8, 2,
                                        int(adamw_mode), 1, -0.5)
    reference_adam_(*ref, AdamHyper(1e-2, 0.9, 0.999, 1e-8, -0.5, 2, adam_w_mode=adamw_mode))
    assert torch.equal(p, ref[0]) and torch.equal(m, ref[2])
    assert not torch.equal(p, a[0])  # so the fused op did decay


def test_adam_rollback_of_an_id_not_created_inverts_the_adamw_form(cpu_op):
    """DeepSpeed's rollback never looks the id up and always inverts the AdamW form; ours does the
    same for an id that was never created or was destroyed, instead of raising."""
    cpu_op.create_adam(8, adamw_mode=True)
    p, g, m, v = _state(3000, torch.float32, torch.float32, seed=10)
    v.add_(1e-4)
    before = [t.clone() for t in (p, m, v)]
    cpu_op.adam_update(8, 2, 1e-2, 0.9, 0.999, 1e-8, 0.05, True, p, g, m, v)
    assert cpu_op.destroy_adam(8) == 0
    twin = [t.clone() for t in (p, g, m, v)]
    assert cpu_op.adam_rollback(8, 2, 1e-2, 0.9, 0.999, 1e-8, 0.05, True, p, g, m, v) == 0
    assert cpu_op.adam_rollback(12345, 2, 1e-2, 0.9, 0.999, 1e-8, 0.05, True, *twin) == 0
    assert torch.equal(p, twin[0]) and torch.equal(m, twin[2]) and torch.equal(v, twin[3])
    for got, old, name in zip((p, m, v), before, ("param", "exp_avg", "exp_avg_sq")):
        err = (got - old).abs().max().item() / old.abs().max().item()
        assert err < 1e-5, f"{name} not restored: relative error {err:.2e}"


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")  # torch's notice, not ours
@pytest.mark.parametrize("layout", ["csr", "coo", "mkldnn"])
def test_non_strided_tensors_rejected_before_any_group_is_written(cpu_op, layout):
    """A call whose later (device, dtype) group holds a sparse or mkldnn tensor must fail in
    validation, naming it, with the earlier groups untouched."""
    p1, g1, m1, v1 = _state(4, torch.float32, torch.float32, seed=1)
    dense = torch.ones(2, 2)
    odd = {"csr": dense.to_sparse_csr(), "coo": dense.to_sparse(), "mkldnn": dense.to_mkldnn()}[layout]
    before = [t.clone() for t in (p1, m1, v1)]
    with pytest.raises(RuntimeError, match=r"params\[1\] has layout"):
        ops.FUSED_ADAM_OP.multi_tensor_adam(1, None, [[g1, dense], [p1, odd], [m1, dense.clone()], [v1, dense.clone()]],
                                            1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    assert all(torch.equal(a, b) for a, b in zip((p1, m1, v1), before))
    cpu_op.create_adam(1)
    with pytest.raises(RuntimeError, match=r"grads\[0\] has layout"):
        cpu_op.adam_update(1, 1, 1e-2, 0.9, 0.999, 1e-8, 0.0, True, dense.clone(), odd, dense.clone(), dense.clone())
