"""The DeepSpeed Lion and Adagrad facades (mps_fused_adam.deepspeed.rule_ops) against the reference.

No DeepSpeed needed: the facades are called with the exact signatures DeepSpeed 0.19.8 uses
(deepspeed/ops/lion/fused_lion.py, cpu_lion.py; deepspeed/ops/adagrad/cpu_adagrad.py). The CPU
backend follows the contracts bit for bit, so the results must equal the reference exactly.
"""
from __future__ import annotations

import pytest
import torch

from mps_fused_adam.numerics.contract import AdagradHyper, LionHyper
from mps_fused_adam.deepspeed import ops, rule_ops
from mps_fused_adam.numerics.reference import reference_adagrad_, reference_lion_

from conftest import DTYPE_PAIRS, pair_id


def _tensors(n: int, dtype, state_dtype, seed: int, positive_state: bool = False):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(dtype)
    grad = torch.randn(n, generator=g).to(dtype)
    s = (torch.rand(n, generator=g) * 0.01 if positive_state else 0.1 * torch.randn(n, generator=g)).to(state_dtype)
    return p, grad, s


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_multi_tensor_lion_matches_reference(pair):
    dtype, state_dtype = pair
    tensors = [_tensors(n, dtype, state_dtype, seed=n) for n in (1, 33, 4099)]
    ref = [[t.clone() for t in ts] for ts in tensors]
    ops.reset_kernel_calls()
    for step in (1, 2, 3):
        grads = [ts[1] for ts in tensors]
        rule_ops.FUSED_LION_OP.multi_tensor_lion(2048 * 32, torch.zeros(1, dtype=torch.int32),
                                                 [grads, [ts[0] for ts in tensors], [ts[2] for ts in tensors]],
                                                 1e-3, 0.9, 0.99, step, 0.1)
        for r in ref:
            reference_lion_(r[0], r[1], r[2], LionHyper(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1))
    for ts, r in zip(tensors, ref):
        assert _same(ts[0], r[0]) and _same(ts[2], r[2])
    assert ops.kernel_calls() == {"multi_tensor_lion:cpu": 3}


def test_multi_tensor_lion_leaf_bf16_noncontiguous_and_bad_lists():
    # DeepSpeed's FusedLion passes bf16 params as leaves that require grad.
    p = torch.nn.Parameter(torch.randn(40, 30).bfloat16().t())
    g = torch.randn(30, 40).bfloat16()
    m = torch.zeros(30, 40, dtype=torch.bfloat16)
    rp, rm = p.detach().clone(), m.clone()
    rule_ops.FUSED_LION_OP.multi_tensor_lion(1, None, [[g], [p], [m]], 1e-2, 0.9, 0.99, 1, 0.0)
    reference_lion_(rp, g, rm, LionHyper(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.0))
    assert torch.equal(p.detach(), rp) and torch.equal(m, rm) and not p.is_contiguous()
    with pytest.raises(ValueError, match=r"\[grads, params, exp_avgs\]"):
        rule_ops.FUSED_LION_OP.multi_tensor_lion(1, None, [[g], [p]], 1e-2, 0.9, 0.99, 1, 0.0)
    with pytest.raises(ValueError, match="differ in length"):
        rule_ops.FUSED_LION_OP.multi_tensor_lion(1, None, [[g], [p], []], 1e-2, 0.9, 0.99, 1, 0.0)
    with pytest.raises(ValueError, match="shape"):
        rule_ops.FUSED_LION_OP.multi_tensor_lion(1, None, [[g], [p], [torch.zeros(3)]], 1e-2, 0.9, 0.99, 1, 0.0)
    with pytest.raises(TypeError, match="int64"):
        q = torch.zeros(3, dtype=torch.int64)
        rule_ops.FUSED_LION_OP.multi_tensor_lion(1, None, [[q], [q], [q]], 1e-2, 0.9, 0.99, 1, 0.0)


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_lion_update_matches_reference(pair):
    op = rule_ops.CPULionOp()
    assert op.create_lion(2, 1e-3, 0.9, 0.999, 0.0, False) == 0
    p, g, m = _tensors(4097, *pair, seed=5)
    rp, rm = p.clone(), m.clone()
    for step in (1, 2):
        # Every call carries its hyperparameters; those given to create_lion are not used.
        assert op.lion_update(2, step, 3e-4, 0.95, 0.98, 0.2, p, g, m) == 0
        reference_lion_(rp, g, rm, LionHyper(lr=3e-4, beta1=0.95, beta2=0.98, weight_decay=0.2))
    assert _same(p, rp) and _same(m, rm)


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_adagrad_update_matches_reference(pair):
    op = rule_ops.CPUAdagradOp()
    assert op.create_adagrad(4, 1e-2, 1e-10, 0.0, False) == 0
    p, g, s = _tensors(4097, *pair, seed=7, positive_state=True)
    rp, rs = p.clone(), s.clone()
    for step in (1, 2, 3):
        assert op.adagrad_update(4, step, 1e-2, 1e-8, 0.1, p, g, s) == 0
        # DeepSpeed's Adagrad has no learning-rate decay: every step uses lr itself.
        reference_adagrad_(rp, g, rs, AdagradHyper(lr=1e-2, eps=1e-8, weight_decay=0.1, step=1))
    assert _same(p, rp) and _same(s, rs)
    assert not torch.equal(p, _tensors(4097, *pair, seed=7)[0])


def test_adagrad_update_sparse_style_values_and_grad_dtype():
    """DeepSpeedCPUAdagrad passes the values of sparse tensors (dense 1-d tensors); a grad in
    another dtype than the param is rounded to the param's dtype first, as for Adam."""
    op = rule_ops.CPUAdagradOp()
    op.create_adagrad(0)
    p = torch.randn(10).bfloat16()
    s = torch.zeros(10)
    g = torch.randn(10)  # fp32 grad for a bf16 param
    rp, rs = p.clone(), s.clone()
    op.adagrad_update(0, 1, 1e-2, 1e-10, 0.0, p, g, s)
    reference_adagrad_(rp, g.bfloat16(), rs, AdagradHyper(lr=1e-2, eps=1e-10, weight_decay=0.0, step=1))
    assert torch.equal(p, rp) and torch.equal(s, rs)


def test_unknown_destroyed_ids_and_logging(capsys):
    lion, adagrad = rule_ops.CPULionOp(), rule_ops.CPUAdagradOp()
    t = torch.zeros(4)
    with pytest.raises(KeyError, match=r"create_lion\(9"):
        lion.lion_update(9, 1, 1e-3, 0.9, 0.99, 0.0, t, t.clone(), t.clone())
    with pytest.raises(KeyError, match=r"create_adagrad\(9"):
        adagrad.adagrad_update(9, 1, 1e-3, 1e-8, 0.0, t, t.clone(), t.clone())
    lion.create_lion(1, should_log=True)
    adagrad.create_adagrad(1, should_log=True)
    out = capsys.readouterr().out
    assert "Lion Optimizer #1 is created with mps_fused_adam (cpu backend" in out
    assert "Adagrad Optimizer #1 is created with mps_fused_adam (cpu backend" in out
    assert lion.destroy_lion(1) == 0 and lion.destroy_lion(1) == 0
    assert adagrad.destroy_adagrad(1) == 0
    with pytest.raises(KeyError):
        lion.lion_update(1, 1, 1e-3, 0.9, 0.99, 0.0, t, t.clone(), t.clone())


def test_rejected_call_changes_nothing():
    """Validation runs over every tensor before any is written."""
    good = _tensors(16, torch.float32, torch.float32, seed=1)
    before = [t.clone() for t in good]
    bad_m = torch.zeros(16, dtype=torch.float16)  # fp16 state for an fp32 param
    with pytest.raises(TypeError, match="states must be float32 or the param's dtype"):
        rule_ops.FUSED_LION_OP.multi_tensor_lion(1, None, [[good[1], good[1]], [good[0], good[0].clone()],
                                                           [good[2], bad_m]], 1e-3, 0.9, 0.99, 1, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(good, before))


def _deepspeeds_own(name: str):
    """DeepSpeed's own JIT-built op, for the cross-check: .ci/run builds it once with the machine's
    compiler (the package never does) and names its .so in MFA_DS_CPU_ADAM_SO / MFA_DS_CPU_LION_SO /
    MFA_DS_CPU_ADAGRAD_SO."""
    import importlib.util
    import os
    var = f"MFA_DS_{name.upper()}_SO"
    if not os.environ.get(var):
        msg = f"cross-check against a JIT-built DeepSpeed {name}: set {var} to its .so"
        if os.environ.get("MFA_REQUIRE_DEEPSPEED"):
            pytest.fail(msg + " (MFA_REQUIRE_DEEPSPEED is set)")
        pytest.skip(msg)
    spec = importlib.util.spec_from_file_location(name, os.environ[var])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# DeepSpeed's kernels fuse multiply-adds (and round 1 - beta in fp32 from the rounded beta), ours
# round every operation (contract.py): fp32 results agree to a few ulps. Its bf16 stores round
# differently from torch's round-to-nearest-even, so with bf16 states its momentum drifts by a bf16
# ulp and a few Lion signs near zero flip; that pair is checked with bounds that say so.
@pytest.mark.parametrize("pair", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                  (torch.bfloat16, torch.bfloat16)], ids=pair_id)
def test_against_deepspeeds_own_cpu_lion(pair):
    ds, ours = _deepspeeds_own("cpu_lion"), rule_ops.CPULionOp()
    for op in (ds, ours):
        op.create_lion(0, 1e-3, 0.9, 0.99, 0.01, False)
    n = 100_003
    p, _, m = _tensors(n, *pair, seed=21)
    a, b = [p.clone(), m.clone()], [p.clone(), m.clone()]
    gen = torch.Generator().manual_seed(22)
    for step in range(1, 6):
        g = torch.randn(n, generator=gen).to(pair[0])
        ds.lion_update(0, step, 1e-3, 0.9, 0.99, 0.01, a[0], g.clone(), a[1])
        ours.lion_update(0, step, 1e-3, 0.9, 0.99, 0.01, b[0], g.clone(), b[1])
    dp = (a[0].float() - b[0].float()).abs()
    dm = ((a[1].float() - b[1].float()).abs().max() / b[1].float().abs().max()).item()
    flipped = int((dp > 1e-3).sum())  # a sign that differs moves a parameter by 2 lr
    if pair[1] == torch.float32:
        assert flipped == 0 and dp.max().item() <= 4 * torch.finfo(pair[0]).eps * b[0].float().abs().max().item()
        assert dm <= 1e-6
    else:
        assert flipped <= n // 1000 and dm <= 2 ** -7
    assert not torch.equal(b[0], p)


@pytest.mark.parametrize("pair", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                  (torch.bfloat16, torch.bfloat16)], ids=pair_id)
def test_against_deepspeeds_own_cpu_adagrad(pair):
    ds, ours = _deepspeeds_own("cpu_adagrad"), rule_ops.CPUAdagradOp()
    for op in (ds, ours):
        op.create_adagrad(0, 1e-2, 1e-8, 0.01, False)
    n = 100_003
    p, _, v = _tensors(n, *pair, seed=23, positive_state=True)
    a, b = [p.clone(), v.clone()], [p.clone(), v.clone()]
    gen = torch.Generator().manual_seed(24)
    for step in range(1, 6):
        g = torch.randn(n, generator=gen).to(pair[0])
        ds.adagrad_update(0, step, 1e-2, 1e-8, 0.01, a[0], g.clone(), a[1])
        ours.adagrad_update(0, step, 1e-2, 1e-8, 0.01, b[0], g.clone(), b[1])
    for x, y in zip(a, b):
        rel = ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
        assert rel <= 4 * torch.finfo(pair[0]).eps, rel
    assert not torch.equal(b[0], p)


def test_cpu_rule_ops_apply_weight_decay_only_when_positive():
    """DeepSpeed's CPU Lion and Adagrad test ``weight_decay > 0``: a negative one means none.
    multi_tensor_lion applies any value, as DeepSpeed's CUDA kernel does."""
    lion, adagrad = rule_ops.CPULionOp(), rule_ops.CPUAdagradOp()
    lion.create_lion(0)
    adagrad.create_adagrad(0)
    p, g, s = _tensors(300, torch.float32, torch.float32, seed=31, positive_state=True)
    a, b = [p.clone(), s.clone()], [p.clone(), s.clone()]
    lion.lion_update(0, 1, 1e-2, 0.9, 0.99, -0.5, a[0], g.clone(), a[1])
    lion.lion_update(0, 1, 1e-2, 0.9, 0.99, 0.0, b[0], g.clone(), b[1])
    assert _same(a[0], b[0]) and _same(a[1], b[1])
    a, b = [p.clone(), s.clone()], [p.clone(), s.clone()]
    adagrad.adagrad_update(0, 1, 1e-2, 1e-8, -0.5, a[0], g.clone(), a[1])
    adagrad.adagrad_update(0, 1, 1e-2, 1e-8, 0.0, b[0], g.clone(), b[1])
    assert _same(a[0], b[0]) and _same(a[1], b[1])
    fused, ref = [p.clone(), s.clone()], [p.clone(), s.clone()]
    rule_ops.FUSED_LION_OP.multi_tensor_lion(1, None, [[g.clone()], [fused[0]], [fused[1]]], 1e-2, 0.9, 0.99, 1, -0.5)
    reference_lion_(ref[0], g.clone(), ref[1], LionHyper(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=-0.5))
    assert _same(fused[0], ref[0]) and not _same(fused[0], b[0])


@pytest.mark.parametrize("name", ["cpu_lion", "cpu_adagrad", "cpu_adam"])
def test_negative_weight_decay_as_deepspeeds_own(name):
    """The same calls with weight_decay = -0.5 on DeepSpeed's own JIT-built ops and ours."""
    ds = _deepspeeds_own(name)
    ours = {"cpu_adam": ops.CPUAdamOp, "cpu_lion": rule_ops.CPULionOp, "cpu_adagrad": rule_ops.CPUAdagradOp}[name]()
    p, g, s = _tensors(4099, torch.float32, torch.float32, seed=41, positive_state=True)
    a, b = [p.clone(), s.clone(), s.clone()], [p.clone(), s.clone(), s.clone()]
    for mod, t in ((ds, a), (ours, b)):
        if name == "cpu_lion":
            mod.create_lion(0, 1e-2, 0.9, 0.99, -0.5, False)
            mod.lion_update(0, 1, 1e-2, 0.9, 0.99, -0.5, t[0], g.clone(), t[1])
        elif name == "cpu_adagrad":
            mod.create_adagrad(0, 1e-2, 1e-8, -0.5, False)
            mod.adagrad_update(0, 1, 1e-2, 1e-8, -0.5, t[0], g.clone(), t[1])
        else:
            mod.create_adam(0, 1e-2, 0.9, 0.999, 1e-8, -0.5, False, False)  # L2 mode
            mod.adam_update(0, 1, 1e-2, 0.9, 0.999, 1e-8, -0.5, True, t[0], g.clone(), t[1], t[2])
    # Without decay the two agree to a few fp32 ulps (DeepSpeed fuses multiply-adds); a decay of
    # -0.5 applied on one side only would move the params by about lr * 0.5 * |p|.
    rel = ((a[0] - b[0]).abs().max() / b[0].abs().max()).item()
    assert rel <= 4 * torch.finfo(torch.float32).eps, rel
    assert not torch.equal(b[0], p)
