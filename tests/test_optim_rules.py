"""The Lion, FusedLion and Adagrad classes on CPU tensors: bit-for-bit against the reference,
parity with lion_pytorch and torch.optim.Adagrad, state dicts in both directions, option checks."""
from __future__ import annotations

import copy

import pytest
import torch

import mps_fused_adam as mfa
from mps_fused_adam.numerics.contract import AdagradHyper, LionHyper
from mps_fused_adam.numerics.reference import reference_adagrad_, reference_lion_

from test_optim import assert_params_close, make_model, train
from test_rules_contract import lion_pytorch_or_skip


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [False, True])
def test_lion_matches_reference(dtype, decoupled):
    ps = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in (5, 1000)]
    refs = [[p.detach().clone(), torch.zeros_like(p)] for p in ps]
    opt = mfa.Lion([{"params": [ps[0]]}, {"params": [ps[1]], "lr": 3e-4}], lr=1e-3, weight_decay=0.1,
                   decoupled_weight_decay=decoupled)
    for _ in range(3):
        for p, r in zip(ps, refs):
            p.grad = torch.randn_like(p)
            r.append(p.grad.clone())
        opt.step()
        for i, r in enumerate(refs):
            lr = 1e-3 if i == 0 else 3e-4
            wd = 0.1 / 1e-3 if decoupled else 0.1
            reference_lion_(r[0], r.pop(), r[1], LionHyper(lr=lr, beta1=0.9, beta2=0.99, weight_decay=wd))
    for p, r in zip(ps, refs):
        assert _bits_equal(p.detach(), r[0]) and _bits_equal(opt.state[p]["exp_avg"], r[1])
        assert opt.state[p]["step"] == 3 and opt.state[p]["exp_avg"].dtype == dtype


def test_lion_parity_and_state_dict_with_lion_pytorch():
    lion_pytorch = lion_pytorch_or_skip()
    for first, second in ((mfa.Lion, lion_pytorch.Lion), (lion_pytorch.Lion, mfa.Lion)):
        a, b = make_model(), make_model()
        b.load_state_dict(a.state_dict())
        oa = first(a.parameters(), lr=1e-3, weight_decay=0.1)
        train(a, oa, steps=3)
        b.load_state_dict(a.state_dict())
        ob = second(b.parameters(), lr=1e-3, weight_decay=0.1)
        ob.load_state_dict(copy.deepcopy(oa.state_dict()))
        train(a, oa, steps=3, seed=1)
        train(b, ob, steps=3, seed=1)
        # lion_pytorch fuses multiply-adds (torch's add with alpha), the contract does not: a few
        # ulps, far below one Lion step (1e-3 per element).
        assert_params_close(a, b, rtol=1e-5, atol=1e-6)
        assert all(torch.allclose(oa.state[pa]["exp_avg"], ob.state[pb]["exp_avg"], rtol=1e-5, atol=1e-7)
                   for pa, pb in zip(a.parameters(), b.parameters()))


def test_lion_parity_with_lion_pytorch_training():
    lion_pytorch = lion_pytorch_or_skip()
    a, b = make_model(), make_model()
    b.load_state_dict(a.state_dict())
    la = train(a, mfa.Lion(a.parameters(), lr=1e-3, betas=(0.95, 0.98), weight_decay=0.5), steps=5)
    lb = train(b, lion_pytorch.Lion(b.parameters(), lr=1e-3, betas=(0.95, 0.98), weight_decay=0.5), steps=5)
    assert_params_close(a, b, rtol=1e-5, atol=1e-6)
    assert la == pytest.approx(lb, rel=1e-5) and la[-1] != la[0]


def test_fused_lion_signature_and_zero_grad():
    p = torch.nn.Parameter(torch.randn(10))
    opt = mfa.FusedLion([p])
    assert opt.defaults == dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    p.grad = torch.randn(10)
    opt.step()
    opt.zero_grad()
    assert p.grad is None
    with pytest.raises(RuntimeError, match="FusedLion has been updated"):
        opt.step(grads=[torch.zeros(10)])


def test_lion_rejects_bad_hyperparameters():
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.5"):
        mfa.Lion([p], betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        mfa.Lion([p], lr=-1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        mfa.Lion([p], lr=0.0, decoupled_weight_decay=True)
    opt = mfa.Lion([p])
    opt.param_groups[0]["weight_decay"] = -0.1
    p.grad = torch.randn(3)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"Invalid weight_decay value: -0.1 \(in param_groups\[0\]\)"):
        opt.step()
    assert torch.equal(p.detach(), before) and p not in opt.state


@pytest.mark.parametrize("kwargs", [
    dict(lr=1e-2),
    dict(lr=1e-2, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1),
    dict(lr=5e-2, eps=1e-6, maximize=True),
])
def test_adagrad_parity_with_torch(kwargs):
    a, b = make_model(), make_model()
    b.load_state_dict(a.state_dict())
    la = train(a, mfa.Adagrad(a.parameters(), **kwargs), steps=6)
    lb = train(b, torch.optim.Adagrad(b.parameters(), **kwargs), steps=6)
    # torch divides (clr * g) / std, the contract clr * (g / std) (contract.py): an ulp or so.
    assert_params_close(a, b, rtol=1e-5, atol=1e-6)
    assert la == pytest.approx(lb, rel=1e-5) and la[-1] != la[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_adagrad_matches_reference(dtype):
    p = torch.nn.Parameter(torch.randn(1001).to(dtype))
    ref = [p.detach().clone(), None, torch.full((1001,), 0.5, dtype=dtype)]
    opt = mfa.Adagrad([p], lr=0.1, lr_decay=0.02, weight_decay=0.05, initial_accumulator_value=0.5)
    for step in (1, 2, 3):
        p.grad = torch.randn(1001).to(dtype)
        ref[1] = p.grad.clone()
        opt.step()
        reference_adagrad_(*ref, AdagradHyper(lr=0.1, eps=1e-10, weight_decay=0.05, step=step, lr_decay=0.02))
    assert _bits_equal(p.detach(), ref[0]) and _bits_equal(opt.state[p]["sum"], ref[2])
    assert opt.state[p]["step"] == 3


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_adagrad_state_dict_round_trip(direction):
    a, b = make_model(), make_model()
    b.load_state_dict(a.state_dict())
    first, second = (mfa.Adagrad, torch.optim.Adagrad) if direction == "ours_to_torch" else (torch.optim.Adagrad, mfa.Adagrad)
    kw = dict(lr=1e-2, lr_decay=0.01, initial_accumulator_value=0.1)
    oa = first(a.parameters(), **kw)
    train(a, oa, steps=3)
    b.load_state_dict(a.state_dict())
    ob = second(b.parameters(), **kw)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    train(a, oa, steps=3, seed=1)
    train(b, ob, steps=3, seed=1)
    assert_params_close(a, b)
    steps = [int(s["step"]) for s in ob.state_dict()["state"].values()]
    assert steps == [6] * len(steps)


def test_adagrad_creates_state_eagerly_like_torch():
    model = make_model()
    ours, theirs = mfa.Adagrad(model.parameters(), initial_accumulator_value=0.3), torch.optim.Adagrad(
        model.parameters(), initial_accumulator_value=0.3)
    so, st = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert so.keys() == st.keys() and len(so) == 4
    assert all(torch.equal(so[k]["sum"], st[k]["sum"]) and int(so[k]["step"]) == 0 for k in so)


def test_adagrad_rejected_options_and_values():
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="Adagrad does not support differentiable=True"):
        mfa.Adagrad([p], differentiable=True)
    mfa.Adagrad([p], foreach=True, fused=True)  # implementation switches: accepted
    for kw, msg in ((dict(lr=-1), "Invalid learning rate"), (dict(lr_decay=-1), "Invalid lr_decay value"),
                    (dict(weight_decay=-1), "Invalid weight_decay value"),
                    (dict(initial_accumulator_value=-1), "Invalid initial_accumulator_value value"),
                    (dict(eps=-1), "Invalid epsilon value")):
        with pytest.raises(ValueError, match=msg):
            mfa.Adagrad([p], **kw)
        with pytest.raises(ValueError, match=msg):
            torch.optim.Adagrad([p], **kw)  # the same messages as torch


def test_adagrad_sparse_grad_rejected_and_nothing_changes():
    p = torch.nn.Parameter(torch.randn(4, 4))
    q = torch.nn.Parameter(torch.randn(4))
    opt = mfa.Adagrad([q, p])
    q.grad = torch.randn(4)
    p.grad = torch.eye(4).to_sparse()
    before = [q.detach().clone(), p.detach().clone(), opt.state[q]["sum"].clone()]
    with pytest.raises(ValueError, match="sparse gradients are not supported"):
        opt.step()
    assert torch.equal(q.detach(), before[0]) and torch.equal(p.detach(), before[1])
    assert torch.equal(opt.state[q]["sum"], before[2]) and opt.state[q]["step"] == 0


@pytest.mark.parametrize("source,target,message", [
    (lambda ps: torch.optim.AdamW(ps), lambda ps: mfa.Lion(ps), "not a Lion state dict: param_groups[0] has 'eps'"),
    (lambda ps: torch.optim.AdamW(ps), lambda ps: mfa.Adagrad(ps), "not an Adagrad state dict: param_groups[0] has no 'lr_decay'"),
    (lambda ps: torch.optim.Adagrad(ps), lambda ps: mfa.AdamW(ps), "not an Adam-family state dict: param_groups[0] has no 'betas'"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: mfa.Lion(ps), "not a Lion state dict: param_groups[0] has no 'betas'"),
])
def test_another_rules_state_dict_is_rejected_and_nothing_changes(source, target, message):
    """Each rule's load_state_dict takes only its own family's state dicts, names what it found,
    and changes nothing."""
    model = torch.nn.Linear(3, 2)
    src = source(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    src.step()
    ours = target(model.parameters())
    before = copy.deepcopy(ours.state_dict())
    with pytest.raises(ValueError) as err:
        ours.load_state_dict(copy.deepcopy(src.state_dict()))
    assert message in str(err.value), str(err.value)
    after = ours.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert set(after["state"]) == set(before["state"])
    for k, st in before["state"].items():
        assert all(torch.equal(v, after["state"][k][n]) if isinstance(v, torch.Tensor) else v == after["state"][k][n]
                   for n, v in st.items())
