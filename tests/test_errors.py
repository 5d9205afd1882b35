"""Bad input: a clear error naming the parameter, what was expected and what was found, and a
step that changes nothing (params, moments, step counts) when anything in it is rejected."""
from __future__ import annotations

import copy

import pytest
import torch

import mps_fused_adam as mfa
from mps_fused_adam.optimizers import validate


def snapshot(opt, params):
    state = {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
             for p in params if p in opt.state}
    return [p.detach().clone() for p in params], state


def assert_unchanged(opt, params, snap):
    values, state = snap
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), v)
    now = snapshot(opt, params)[1]
    assert now.keys() == state.keys()
    for key, entries in state.items():
        for k, v in entries.items():
            assert (torch.equal(v, now[key][k]) if isinstance(v, torch.Tensor) else v == now[key][k])


def two_params_one_step(cls=mfa.AdamW, **kw):
    good = torch.nn.Parameter(torch.randn(8))
    bad = torch.nn.Parameter(torch.randn(4, 4))
    opt = cls([good, bad], **kw)
    good.grad, bad.grad = torch.randn(8), torch.randn(4, 4)
    opt.step()  # both now have state at step 1
    return opt, good, bad


def set_grad(p, g):
    """Assign a grad that torch's own checks would refuse, as a buggy hook or a wrapper might."""
    p.grad_dtype = None  # torch >= 2.9 otherwise refuses a grad of another dtype
    p.grad = g


@pytest.mark.parametrize("bad_grad,match", [
    (lambda: torch.randn(4, 4, dtype=torch.float64),
     r"^param_groups\[0\]\['params'\]\[1\] \(shape \(4, 4\), float32, cpu\): grad dtype torch.float64 does not match; expected torch.float32"),
    (lambda: torch.randn(4, 4).half(), r"grad dtype torch.float16 does not match; expected torch.float32"),
    (lambda: torch.eye(4).to_sparse(), r"sparse gradients are not supported"),
])
@pytest.mark.parametrize("cls", [mfa.AdamW, mfa.Adam, mfa.FusedAdam, mfa.CPUAdam])
def test_bad_grad_rejected_and_nothing_changes(cls, bad_grad, match):
    opt, good, bad = two_params_one_step(cls)
    good.grad = torch.randn(8)
    set_grad(bad, bad_grad())
    params = [good, bad]
    snap = snapshot(opt, params)
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert_unchanged(opt, params, snap)


def test_grad_of_another_shape_rejected():
    # torch refuses to assign a grad of another shape, but a param resized through .data keeps
    # its old grad: the kind of mismatch the optimizer must catch, not silently mis-index.
    opt, good, bad = two_params_one_step()
    good.grad, bad.grad = torch.randn(8), torch.randn(4, 4)
    good.data = torch.randn(2, 4)
    del opt.state[good]
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] \(shape \(2, 4\).*grad shape \(8,\) does not match; expected \(2, 4\)"):
        opt.step()
    assert opt.state[bad]["step"] == 1


def test_grad_on_another_device_message():
    p = torch.randn(3)
    g = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match=r"w \(shape \(3,\), float32, cpu\): grad is on meta; expected cpu"):
        validate.check_param(p, g, "w", None)


def test_cpu_adam_rejects_other_devices():
    p = torch.nn.Parameter(torch.empty(3, device="meta"))
    p.grad = torch.empty(3, device="meta")
    opt = mfa.CPUAdam([p])
    with pytest.raises(ValueError, match="expected a cpu tensor, found one on meta"):
        opt.step()


@pytest.mark.parametrize("cls", [mfa.AdamW, mfa.Adam, mfa.FusedAdam, mfa.CPUAdam])
def test_unsupported_param_dtype_rejected_at_construction(cls):
    good, p = torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^param_groups\[0\]\['params'\]\[1\] \(shape \(3,\), float64, cpu\): "
                                         r"dtype torch.float64 is not supported; expected float32, float16 or "
                                         r"bfloat16 \(for float64 parameters use torch.optim.Adam/AdamW\)"):
        cls([good, p])


def test_unsupported_param_dtype_rejected_by_add_param_group():
    model = torch.nn.Linear(2, 2)
    opt = mfa.AdamW(model.parameters())
    counts = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^param_groups\[1\]\['params'\]\[0\] \(shape \(4,\), int64, cpu\): "
                                         r"dtype torch.int64 is not supported; expected float32, float16 or bfloat16$"):
        opt.add_param_group({"params": [counts]})
    assert len(opt.param_groups) == 1  # the rejected group is not kept
    with pytest.raises(ValueError, match=r"^weight \(shape \(2, 2\), float64"):  # named parameters: the name
        mfa.AdamW(torch.nn.Linear(2, 2).double().named_parameters())


def test_unsupported_param_dtype_set_later_is_caught_at_step():
    p = torch.nn.Parameter(torch.randn(3))
    opt = mfa.AdamW([p])
    p.data = p.data.double()
    p.grad = torch.randn(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="dtype torch.float64 is not supported; expected float32, float16 or bfloat16"):
        opt.step()
    assert p not in opt.state


def _trained(opt_cls, model, **kw):
    opt = opt_cls(model.parameters(), **kw)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return opt


@pytest.mark.parametrize("foreign", [
    (lambda m: _trained(torch.optim.SGD, m, lr=0.1), r"param_groups\[0\] has no 'betas' or 'eps' \(its hyperparameters "
                                                     r"are \[.*'lr'.*'momentum'.*\]\)"),
    (lambda m: _trained(torch.optim.SGD, m, lr=0.1, momentum=0.9), "has no 'betas' or 'eps'"),
    (lambda m: _trained(torch.optim.Adagrad, m), "has no 'betas'"),
    (lambda m: _trained(torch.optim.Adam, m, amsgrad=True), "amsgrad=True, which mps_fused_adam does not implement"),
])
@pytest.mark.parametrize("cls", [mfa.AdamW, mfa.CPUAdam])
def test_load_state_dict_rejects_foreign_optimizers(cls, foreign):
    make, match = foreign
    model = torch.nn.Linear(4, 2)
    ours = _trained(cls, model, lr=1e-3, weight_decay=0.05)
    before = copy.deepcopy(ours.state_dict())
    with pytest.raises(ValueError, match=match):
        ours.load_state_dict(make(torch.nn.Linear(4, 2)).state_dict())
    after = ours.state_dict()
    assert after["param_groups"] == before["param_groups"]  # lr and weight decay are still ours
    for k, st in before["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][k][key]))


def test_load_state_dict_rejects_state_without_moments():
    model = torch.nn.Linear(4, 2)
    sd = _trained(torch.optim.AdamW, model).state_dict()
    del sd["state"][1]["exp_avg_sq"]
    sd["state"][1]["momentum_buffer"] = torch.zeros(2)
    ours = mfa.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"the state of param_groups\[0\]\['params'\]\[1\] \(shape \(2,\), "
                                         r"float32, cpu\) has keys \['exp_avg', 'momentum_buffer', 'step'\]"):
        ours.load_state_dict(sd)
    assert not ours.state


def test_load_state_dict_rejects_moments_of_the_wrong_shape():
    sd = _trained(torch.optim.AdamW, torch.nn.Linear(4, 2)).state_dict()
    sd["state"][0]["exp_avg_sq"] = torch.zeros(8)
    model = torch.nn.Linear(4, 2)
    ours = mfa.AdamW(model.named_parameters(), lr=5e-4)
    with pytest.raises(ValueError, match=r"^weight \(shape \(2, 4\), float32, cpu\): the state dict's 'exp_avg_sq' "
                                         r"has shape \(8,\); expected \(2, 4\)$"):
        ours.load_state_dict(sd)
    assert not ours.state and ours.param_groups[0]["lr"] == 5e-4


@pytest.mark.parametrize("saved_step, shown", [(-1, "-1"), (torch.tensor(-1.0), r"tensor\(-1.0\)"), (2.5, "2.5"),
                                               (float("nan"), "nan"), ("3", "'3'")],
                         ids=["int", "torch-tensor", "fraction", "nan", "str"])
@pytest.mark.parametrize("cls", [mfa.AdamW, mfa.CPUAdam])
def test_loaded_step_that_is_no_count_rejected_at_load(cls, saved_step, shown):
    """A checkpoint whose 'step' is not a count of steps taken (-1, a fraction, NaN, a string;
    ours keep an int, torch's a tensor) is refused by load_state_dict itself, naming the
    parameter and the value, and nothing is loaded (a step count of -1 would reach the kernels as
    1 - beta1**-1)."""
    model = torch.nn.Linear(4, 2)
    sd = copy.deepcopy(_trained(torch.optim.AdamW, model).state_dict())
    sd["state"][0]["step"] = saved_step
    ours = cls(model.named_parameters() if cls is mfa.AdamW else model.parameters())
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    ours.step()
    snap = snapshot(ours, params)
    who = r"weight \(shape \(2, 4\), float32, cpu\)" if cls is mfa.AdamW else \
        r"param_groups\[0\]\['params'\]\[0\] \(shape \(2, 4\), float32, cpu\)"
    with pytest.raises(ValueError, match=rf"^{who}: the state dict's 'step' is {shown}; expected the number "
                                         rf"of steps taken, a non-negative whole number$"):
        ours.load_state_dict(sd)
    assert_unchanged(ours, params, snap)
    assert ours.state[params[0]]["step"] == 1


def test_negative_step_set_by_hand_rejected_at_the_next_step():
    """A step count set to -1 by hand (not through load_state_dict): the next step refuses it,
    naming the parameter and the value, and writes nothing."""
    model = torch.nn.Linear(4, 2)
    ours = mfa.AdamW(model.named_parameters())
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    ours.step()
    ours.state[params[0]]["step"] = -1
    snap = snapshot(ours, params)
    with pytest.raises(ValueError, match=r"^weight \(shape \(2, 4\), float32, cpu\): optimizer state 'step' is -1 "
                                         r"\(int\); expected the number of steps taken, a non-negative int$"):
        ours.step()
    assert_unchanged(ours, params, snap)
    assert ours.state[params[1]]["step"] == 1


def test_load_state_dict_rejects_what_is_not_a_state_dict():
    ours = mfa.AdamW(torch.nn.Linear(4, 2).parameters())
    with pytest.raises(ValueError, match=r"expected keys 'state' and 'param_groups', found \['weight', 'bias'\]|"
                                         r"found \['bias', 'weight'\]"):
        ours.load_state_dict(torch.nn.Linear(4, 2).state_dict())


def test_named_parameter_in_message():
    model = torch.nn.Linear(3, 2)
    opt = mfa.AdamW(model.named_parameters())
    model.weight.grad = torch.randn(2, 3)
    set_grad(model.bias, torch.randn(2).half())
    with pytest.raises(ValueError, match=r"^bias \(shape \(2,\), float32, cpu\): grad dtype torch.float16"):
        opt.step()


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "Invalid learning rate: -1.0"),
    (dict(eps=-1e-8), "Invalid epsilon value"),
    (dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0: 1.0"),
    (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1"),
    (dict(betas=(0.9, 1.0)), r"^Invalid beta parameter at index 1: 1.0$"),  # torch's message, word for word
    (dict(weight_decay=-0.1), "Invalid weight_decay value"),
])
@pytest.mark.parametrize("cls", [mfa.AdamW, mfa.Adam, mfa.FusedAdam, mfa.CPUAdam])
def test_invalid_hyperparameters(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.randn(2))], **kwargs)
    # torch.optim.AdamW rejects the same values.
    with pytest.raises(ValueError):
        torch.optim.AdamW([torch.nn.Parameter(torch.randn(2))], **kwargs)


def test_invalid_hyperparameter_set_later_is_caught_at_step():
    opt, good, bad = two_params_one_step()
    good.grad, bad.grad = torch.randn(8), torch.randn(4, 4)
    opt.param_groups[0]["lr"] = -0.5
    params = [good, bad]
    snap = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"Invalid learning rate: -0.5 \(in param_groups\[0\]\)"):
        opt.step()
    assert_unchanged(opt, params, snap)


@pytest.mark.parametrize("cls,option", [
    (mfa.AdamW, "amsgrad"), (mfa.Adam, "amsgrad"), (mfa.AdamW, "capturable"), (mfa.Adam, "differentiable"),
    (mfa.FusedAdam, "amsgrad"), (mfa.CPUAdam, "amsgrad"),
])
def test_unsupported_options_rejected(cls, option):
    with pytest.raises(ValueError, match="AMSGrad|does not support"):
        cls([torch.nn.Parameter(torch.randn(2))], **{option: True})


def test_foreach_and_fused_flags_accepted():
    p = torch.nn.Parameter(torch.randn(4))
    mfa.AdamW([p], foreach=True, fused=True)
    mfa.Adam([p], foreach=False, fused=False)


def test_corrupt_checkpoint_state_rejected():
    opt, good, bad = two_params_one_step()
    opt.state[bad]["exp_avg"] = torch.zeros(3)
    good.grad, bad.grad = torch.randn(8), torch.randn(4, 4)
    params = [good, bad]
    snap = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"optimizer state 'exp_avg' is exp_avg \(shape \(3,\).*expected shape \(4, 4\)"):
        opt.step()
    assert_unchanged(opt, params, snap)


def test_fused_adam_rejects_legacy_step_arguments():
    p = torch.nn.Parameter(torch.randn(2))
    p.grad = torch.randn(2)
    with pytest.raises(RuntimeError, match="FusedAdam has been updated"):
        mfa.FusedAdam([p]).step(scale=2.0)
