"""The optimizer classes on CPU tensors: torch parity, param groups, schedulers, closures,
state dicts in both directions, dtype policies, non-contiguous and skipped tensors."""
from __future__ import annotations

import copy

import pytest
import torch

import mps_fused_adam as mfa
from mps_fused_adam.contract import AdamHyper
from mps_fused_adam.reference import reference_adam_


def make_model(dtype=torch.float32):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dtype)
    return model


def train(model, opt, steps=5, sched=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen).to(next(model.parameters()).dtype)
        y = torch.randn(8, 4, generator=gen).to(x.dtype)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def assert_params_close(a, b, rtol=1e-5, atol=1e-6):
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol)


# torch's Adam rounds differently (sqrt(v) / sqrt(bc2) where we multiply by 1/sqrt(bc2)); after 5 steps of lr 1e-2 the
# fp32 difference is a few ulps of the parameters, far inside rtol 1e-5.
@pytest.mark.parametrize("ours_cls,torch_cls,kwargs", [
    (mfa.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (mfa.AdamW, torch.optim.AdamW, dict(lr=1e-2, maximize=True)),
    (mfa.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (mfa.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    (mfa.Adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6)),
])
def test_parity_with_torch(ours_cls, torch_cls, kwargs):
    a, b = make_model(), make_model()
    b.load_state_dict(a.state_dict())
    la = train(a, ours_cls(a.parameters(), **kwargs))
    lb = train(b, torch_cls(b.parameters(), **kwargs))
    assert_params_close(a, b)
    assert la == pytest.approx(lb, rel=1e-5)
    assert la[-1] != la[0]


def test_fused_adam_matches_reference_l2_and_no_bias_correction():
    p = torch.nn.Parameter(torch.randn(100))
    ref = [p.detach().clone(), None, torch.zeros(100), torch.zeros(100)]
    opt = mfa.FusedAdam([p], lr=1e-2, bias_correction=False, adam_w_mode=False, weight_decay=0.3)
    for step in range(1, 4):
        p.grad = torch.randn(100)
        ref[1] = p.grad.clone()
        opt.step()
        reference_adam_(*ref, AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.3, step, adam_w_mode=False, bias_correction=False))
    assert torch.equal(p.detach(), ref[0])
    assert opt.state[p]["step"] == 3


def test_param_groups_scheduler_closure():
    a, b = make_model(), make_model()
    b.load_state_dict(a.state_dict())

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 1e-2}, {"params": m[2].parameters(), "weight_decay": 0.0}]

    oa, ob = mfa.AdamW(groups(a), lr=3e-3), torch.optim.AdamW(groups(b), lr=3e-3)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=2, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=2, gamma=0.5)
    train(a, oa, steps=6, sched=sa)
    train(b, ob, steps=6, sched=sb)
    assert_params_close(a, b)
    assert oa.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)

    x, y = torch.randn(4, 16), torch.randn(4, 4)

    def closure():
        oa.zero_grad()
        loss = torch.nn.functional.mse_loss(a(x), y)
        loss.backward()
        return loss

    loss = oa.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    oa.zero_grad()
    assert all(p.grad is None for p in a.parameters())


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_state_dict_round_trip(direction):
    a, b = make_model(), make_model()
    b.load_state_dict(a.state_dict())
    first, second = (mfa.AdamW, torch.optim.AdamW) if direction == "ours_to_torch" else (torch.optim.AdamW, mfa.AdamW)
    oa = first(a.parameters(), lr=1e-2)
    train(a, oa, steps=3)
    # Continue training a copy with the other implementation from the saved state ...
    b.load_state_dict(a.state_dict())
    ob = second(b.parameters(), lr=1e-2)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    # ... and compare with the first implementation continuing on its own.
    train(a, oa, steps=3, seed=1)
    train(b, ob, steps=3, seed=1)
    assert_params_close(a, b)
    steps = [int(s["step"]) for s in ob.state_dict()["state"].values()]
    assert steps == [6] * len(steps)
    # A state dict survives a second hop back unchanged in meaning.
    oc = first(b.parameters(), lr=1e-2)
    oc.load_state_dict(ob.state_dict())
    assert torch.equal(next(iter(oc.state.values()))["exp_avg"], next(iter(ob.state.values()))["exp_avg"])


def test_cpu_adam_fp32_states_for_bf16_params():
    p = torch.nn.Parameter(torch.randn(1000).bfloat16())
    opt = mfa.CPUAdam([p], lr=1e-2, weight_decay=0.01)
    ref = [p.detach().clone(), None, torch.zeros(1000), torch.zeros(1000)]
    for step in (1, 2, 3):
        p.grad = torch.randn(1000).bfloat16()
        ref[1] = p.grad.clone()
        opt.step()
        reference_adam_(*ref, AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.01, step))
    st = opt.state[p]
    assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(p.detach(), ref[0]) and torch.equal(st["exp_avg"], ref[2])
    # A checkpoint keeps the fp32 moments exact across a reload (torch would cast them to bf16).
    opt2 = mfa.CPUAdam([p], lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt2.state[p]["exp_avg"], st["exp_avg"])
    low = mfa.CPUAdam([p], fp32_optimizer_states=False)
    p.grad = torch.randn(1000).bfloat16()
    low.step()
    assert low.state[p]["exp_avg"].dtype == torch.bfloat16


def test_mixed_dtype_groups():
    ps = [torch.nn.Parameter(torch.randn(50).to(d)) for d in (torch.float32, torch.float16, torch.bfloat16)]
    refs = [[p.detach().clone(), None, torch.zeros_like(p), torch.zeros_like(p)] for p in ps]
    opt = mfa.AdamW([{"params": [ps[0], ps[1]]}, {"params": [ps[2]], "lr": 1e-1}], lr=1e-2)
    for step in (1, 2):
        for p, r in zip(ps, refs):
            p.grad = torch.randn(50).to(p.dtype)
            r[1] = p.grad.clone()
        opt.step()
        for i, (p, r) in enumerate(zip(ps, refs)):
            reference_adam_(*r, AdamHyper(1e-1 if i == 2 else 1e-2, 0.9, 0.999, 1e-8, 1e-2, step))
    for p, r in zip(ps, refs):
        assert torch.equal(p.detach(), r[0]), p.dtype


def test_non_contiguous_param_is_updated():
    base = torch.randn(40, 30)
    p = torch.nn.Parameter(base.t())  # a transposed, non-contiguous leaf
    assert not p.is_contiguous()
    ref = [p.detach().clone(), None, torch.zeros(30, 40), torch.zeros(30, 40)]
    opt = mfa.AdamW([p], lr=1e-2)
    for step in (1, 2):
        p.grad = torch.randn(40, 30).t()
        ref[1] = p.grad.clone()
        opt.step()
        reference_adam_(*ref, AdamHyper(1e-2, 0.9, 0.999, 1e-8, 1e-2, step))
    assert not p.is_contiguous()
    assert torch.equal(p.detach(), ref[0])
    assert torch.equal(opt.state[p]["exp_avg_sq"], ref[3])


def test_params_without_grad_and_empty_are_skipped():
    used = torch.nn.Parameter(torch.randn(10))
    unused = torch.nn.Parameter(torch.randn(10))
    empty = torch.nn.Parameter(torch.randn(0))
    used.grad, empty.grad = torch.randn(10), torch.randn(0)
    before = unused.detach().clone()
    opt = mfa.AdamW([used, unused, empty])
    opt.step()
    assert torch.equal(unused.detach(), before)
    assert unused not in opt.state and empty not in opt.state
    assert opt.state[used]["step"] == 1


def test_named_parameters_accepted():
    a, b = make_model(), make_model()
    b.load_state_dict(a.state_dict())
    opt = mfa.AdamW(a.named_parameters(), lr=1e-2)
    assert opt.param_groups[0]["param_names"][0] == "0.weight"
    train(a, opt, steps=3)
    train(b, torch.optim.AdamW(b.named_parameters(), lr=1e-2), steps=3)
    assert_params_close(a, b)


def test_first_step_does_not_import_torch_dynamo():
    """torch.optim.Optimizer's add_param_group/zero_grad/state_dict import torch._dynamo on first
    call (about a second); ours skip that until torch.compile has loaded it."""
    import subprocess
    import sys
    code = ("import sys, torch, mps_fused_adam as mfa\n"
            "p = torch.nn.Parameter(torch.randn(3)); opt = mfa.AdamW([p])\n"
            "p.grad = torch.randn(3); opt.step(); opt.zero_grad(); opt.load_state_dict(opt.state_dict())\n"
            "opt.add_param_group({'params': [torch.nn.Parameter(torch.randn(2))]})\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
