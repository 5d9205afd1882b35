"""The fast single-param steps of ``step_in_backward=True`` (the classes' ``_step_one``).

From its second step each hooked param is stepped through a plan of its own, proved in C++
(step_plan.py), instead of the full Python path; the 8-bit classes' plans hold their codes and
block scales as any class's hold its states. These tests change, between steps, everything a
plan records (a state tensor, the whole state, a state dict emptied, the param's storage, the
learning rate) and require the result to be bit for bit the plain optimizer's under the same
changes; and they check that the plans were used at all, so the comparison covers them.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import mps_fused_adam as mfa
from mps_fused_adam import backends
from mps_fused_adam.numerics.contract import RULES, AdamHyper
from mps_fused_adam.optimizers import in_backward

pytest.importorskip("mps_fused_adam._cpu", reason="the plans' checks are in the _cpu extension")


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(dtype)


def scale_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
    st = opt.state[p]
    name = next(k for k, v in st.items() if isinstance(v, torch.Tensor) and v.shape == p.shape)
    # A new tensor at a new address (8-bit codes: the same codes, moved).
    st[name] = st[name].clone() if st[name].dtype is torch.uint8 else st[name] * 0.5


def reload_scaled(opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.is_floating_point():
                entry[k] = v * 0.75
    opt.load_state_dict(sd)


def new_storage(opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
    p.data = p.data.clone() + 0.25


def empty_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
    opt.state[p].clear()  # torch takes an emptied state dict as no state: a fresh start for p


def halve_lr(opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
    for group in opt.param_groups:
        group["lr"] = group["lr"] * 0.5


CHANGES = [scale_state, reload_scaled, new_storage, empty_state, halve_lr]
CASES = [(mfa.AdamW, {}, torch.float32), (mfa.AdamW, {}, torch.bfloat16), (mfa.Adam, dict(weight_decay=0.1), torch.float32),
         (mfa.CPUAdam, {}, torch.bfloat16), (mfa.Lion, {}, torch.float32), (mfa.Adagrad, {}, torch.float32),
         (mfa.AdamW8bit, dict(min_8bit_size=64), torch.float32),
         (mfa.AdamW8bit, dict(min_8bit_size=64, bf16_stochastic_round=True), torch.bfloat16),
         (mfa.Adam8bit, dict(min_8bit_size=64, weight_decay=0.1), torch.bfloat16)]


def run(cls, kw, dtype, on: bool, change) -> tuple[torch.optim.Optimizer, list]:
    model = make_model(dtype)
    torch.manual_seed(7)  # the stochastic-rounding seeds
    opt = cls(model.parameters(), lr=1e-2, step_in_backward=on, **kw)
    target = model[2].weight
    gen = torch.Generator().manual_seed(3)
    for i in range(6):
        x = torch.randn(4, 16, generator=gen).to(dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if i == 2:
            change(opt, target)
    return opt, list(model.parameters())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("cls,kw,dtype", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_change_between_steps_gives_the_plain_result(cls, kw, dtype, change):
    ref, pr = run(cls, kw, dtype, False, change)
    got, pg = run(cls, kw, dtype, True, change)
    for p, q in zip(pg, pr):
        assert torch.equal(bits(p), bits(q)), p.shape
        sa, sb = got.state[p], ref.state[q]
        assert sorted(sa) == sorted(sb)
        for k, v in sa.items():
            assert torch.equal(bits(v), bits(sb[k])) if isinstance(v, torch.Tensor) else v == sb[k], k
    # The fast path served the steps after the first (and again after the change sent a param
    # back through the full path): otherwise this compared the full path with itself.
    plans = got.__dict__.get("_one_plans", {})
    assert len(plans) == len(pg)
    assert sum(entry[0].uses for entry in plans.values()) >= len(pg)


def test_stochastic_rounding_groups_are_planned_with_each_steps_key():
    """A plan holds each param's state dict; every planned step makes its key from the param's
    ``sr_seed`` and the step (as in step()), so the planned steps round as the plain step does."""
    ref, pr = run(mfa.AdamW, dict(bf16_stochastic_round=True), torch.bfloat16, False, halve_lr)
    got, pg = run(mfa.AdamW, dict(bf16_stochastic_round=True), torch.bfloat16, True, halve_lr)
    for p, q in zip(pg, pr):
        assert torch.equal(bits(p), bits(q)) and got.state[p]["sr_seed"] == ref.state[q]["sr_seed"]
    plans = got.__dict__.get("_one_plans", {})
    assert len(plans) == len(pg) and all(entry[0].uses >= 4 for entry in plans.values())


def test_a_bad_grad_after_planned_steps_raises_naming_the_param():
    layer = torch.nn.Linear(8, 8, bias=False)
    opt = mfa.AdamW([layer.weight], step_in_backward=True)
    for _ in range(2):
        layer(torch.randn(2, 8)).sum().backward()
    assert opt._one_plans
    before = bits(layer.weight).clone()
    layer.weight.grad_dtype = None  # lets autograd accumulate into a grad of another dtype (torch 2.13)
    layer.weight.grad = torch.zeros(8, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(8, 8\), float32, cpu\): "
                                         r"grad dtype torch.float16 does not match; expected torch.float32"):
        layer(torch.randn(2, 8)).sum().backward()
    assert torch.equal(bits(layer.weight), before) and int(opt.state[layer.weight]["step"]) == 2


def test_a_bad_8bit_state_after_fast_steps_raises_naming_the_param():
    layer = torch.nn.Linear(16, 16, bias=False)
    opt = mfa.AdamW8bit([layer.weight], step_in_backward=True, min_8bit_size=64)
    for _ in range(2):
        layer(torch.randn(2, 16)).sum().backward()
    before = bits(layer.weight).clone()
    opt.state[layer.weight]["exp_avg_absmax"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(16, 16\), float32, cpu\): "
                                         r"optimizer state 'exp_avg_absmax' is .*expected shape \(1,\)"):
        layer(torch.randn(2, 16)).sum().backward()
    assert torch.equal(bits(layer.weight), before) and int(opt.state[layer.weight]["step"]) == 2


def test_removing_the_hooks_or_loading_drops_the_plans():
    """A plan holds its param and states: load_state_dict and remove_hooks let them go."""
    layer = torch.nn.Linear(8, 8)
    opt = mfa.AdamW(layer.parameters(), step_in_backward=True)
    for _ in range(2):
        layer(torch.randn(2, 8)).sum().backward()
    assert len(opt._one_plans) == 2
    opt.load_state_dict(opt.state_dict())
    assert not opt.__dict__.get("_one_plans")
    layer(torch.randn(2, 8)).sum().backward()
    assert len(opt._one_plans) == 2
    in_backward.remove_hooks(opt)
    assert not opt.__dict__.get("_one_plans")


@pytest.mark.parametrize("zero", [0.0, -0.0])
def test_packed_scalars_keep_the_sign_of_a_zero(zero):
    """The memo of packed scalars (backends.packed_scalars) takes AdamHyper's equality, in which
    -0.0 == 0.0; the kernels read the bits, so each sign gets its own entry."""
    other = -zero
    for wd in (other, zero):
        for lr in (1e-3, other, zero):
            hp = AdamHyper(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, step=3, adam_w_mode=False)
            assert backends.packed_scalars("adam", hp) == RULES["adam"].pack(hp)
    assert math.copysign(1.0, zero) != math.copysign(1.0, other)


def test_packed_scalars_follow_a_replaced_rule(monkeypatch):
    """The memo counts only for the rule object that packed an entry: a rule replaced in
    contract.RULES (the self-check's host-scalar tests do this) is packed afresh, and the memo
    serves the original again once it is back."""
    import dataclasses

    from mps_fused_adam import backends
    from mps_fused_adam.numerics import contract
    hp = contract.AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 3)
    original = contract.RULES["adam"]
    good = backends.packed_scalars("adam", hp)
    assert good == original.pack(hp)

    def buggy(h):
        return contract.adam_scalars(h)._replace(d2=1.0)
    monkeypatch.setitem(contract.RULES, "adam", dataclasses.replace(original, scalars=buggy))
    bad = backends.packed_scalars("adam", hp)
    assert bad == contract.RULES["adam"].pack(hp) and bad != good
    monkeypatch.setitem(contract.RULES, "adam", original)
    assert backends.packed_scalars("adam", hp) == good
