"""Edge cases where a step or a load used to be silently different from the optimizer a class
stands in for (torch.optim, DeepSpeed): each checked beside that optimizer on the same input."""
from __future__ import annotations

import contextlib
import re
import warnings

import pytest
import torch

import mps_fused_adam as mfa

def one_step(opt_cls, state_dict=None, wd=0.5, **kw):
    """A param of 1.0 with weight decay ``wd``, one step of grad 0.1 (after loading ``state_dict``)."""
    p = torch.nn.Parameter(torch.ones(1))
    opt = opt_cls([p], lr=0.1, weight_decay=wd, **kw)
    if state_dict is not None:
        opt.load_state_dict(state_dict)
    p.grad = torch.full((1,), 0.1)
    opt.step()
    return float(p.detach()), opt


def fresh_state_dict(opt_cls, **kw):
    p = torch.nn.Parameter(torch.ones(1))
    opt = opt_cls([p], lr=0.1, weight_decay=0.5, **kw)
    return opt.state_dict()  # no state yet: only the groups (and their decay mode) move


# --- 3. The weight-decay mode a load brings ------------------------------------------------------

@pytest.mark.parametrize("saved_by", [torch.optim.Adam, mfa.Adam])
def test_adamw_loading_an_adam_state_dict_keeps_decoupled_decay(saved_by):
    sd = fresh_state_dict(saved_by)
    assert sd["param_groups"][0]["decoupled_weight_decay"] is False
    theirs, topt = one_step(torch.optim.AdamW, sd)
    ours, oopt = one_step(mfa.AdamW, sd)
    assert topt.param_groups[0]["decoupled_weight_decay"] is True
    assert oopt.param_groups[0]["decoupled_weight_decay"] is True
    l2, _ = one_step(torch.optim.Adam, sd)  # what the loaded mode would have run
    assert ours == pytest.approx(theirs, abs=1e-6) and abs(theirs - l2) > 0.01


@pytest.mark.parametrize("saved_by", [torch.optim.AdamW, mfa.AdamW])
def test_adam_loading_an_adamw_state_dict_takes_its_decoupled_decay(saved_by):
    sd = fresh_state_dict(saved_by)
    theirs, _ = one_step(torch.optim.Adam, sd)
    ours, _ = one_step(mfa.Adam, sd)
    l2, _ = one_step(torch.optim.Adam)
    assert ours == pytest.approx(theirs, abs=1e-6) and abs(theirs - l2) > 0.01


# --- 4. A param twice in a group -----------------------------------------------------------------

@pytest.mark.parametrize("n", [5, 3_000_000])
@pytest.mark.parametrize("ours_cls,torch_cls", [(mfa.AdamW, torch.optim.AdamW), (mfa.Adagrad, torch.optim.Adagrad),
                                                (mfa.AdamW8bit, None)])
def test_a_duplicated_param_is_updated_once_per_appearance_as_torch_does(n, ours_cls, torch_cls):
    """torch warns and updates the param once per appearance, one after the other; the 3M case
    raced (three identical runs, three results) when one kernel call held the tensor twice."""
    results = []
    if torch_cls is None:  # 8-bit states: the same param listed once and stepped twice per step is the reference
        torch_cls = _TwiceAdamW8bit
    for cls in (torch_cls, ours_cls, ours_cls):
        torch.manual_seed(0)
        a, b = torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(n))
        warns = contextlib.nullcontext() if cls is _TwiceAdamW8bit else \
            pytest.warns(UserWarning, match="duplicate parameters")  # torch's, from its add_param_group
        with warns:
            opt = cls([a, b, a], lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            a.grad = torch.linspace(-1, 1, n)
            b.grad = torch.ones(n)
            opt.step()
        results.append((a.detach().clone(), b.detach().clone(), int(opt.state[a]["step"])))
    (ta, tb, tsteps), (oa, ob, osteps), (oa2, ob2, _) = results
    assert tsteps == osteps == 6
    assert torch.equal(oa, oa2) and torch.equal(ob, ob2)
    exact = ours_cls is mfa.AdamW8bit  # its reference runs the same kernels
    torch.testing.assert_close(oa, ta, atol=0 if exact else 2e-6, rtol=0)
    torch.testing.assert_close(ob, tb, atol=0 if exact else 2e-6, rtol=0)


class _TwiceAdamW8bit(mfa.AdamW8bit):
    """AdamW8bit over the group without its duplicate, stepped once more for the param listed twice:
    what torch's one-after-the-other updates make of ``[a, b, a]``."""

    def __init__(self, params, **kw):
        a, b, _ = params
        super().__init__([a, b], **kw)
        self._a, self._b = a, b

    def step(self):
        super().step()
        b_grad, self._b.grad = self._b.grad, None
        super().step()
        self._b.grad = b_grad


def test_a_duplicated_param_is_refused_with_step_in_backward():
    a = torch.nn.Parameter(torch.randn(4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(4,\), float32, cpu\) is the "
                                             r"same tensor as param_groups\[0\]\['params'\]\[0\].*takes each param once"):
            mfa.AdamW([a, a], step_in_backward=True)


# --- 5. DeepSpeed's zero_grad --------------------------------------------------------------------

@pytest.mark.parametrize("ours_cls,module,name", [(mfa.FusedAdam, "deepspeed.ops.adam.fused_adam", "FusedAdam"),
                                                  (mfa.FusedLion, "deepspeed.ops.lion.fused_lion", "FusedLion")])
@pytest.mark.parametrize("set_grad_none", [True, False])
def test_zero_grad_sets_grads_to_none_as_deepspeeds_does(ours_cls, module, name, set_grad_none):
    """DeepSpeed 0.19.8's zero_grad(): None with set_grad_none=True, and torch's zero_grad() (whose
    default is None too) with False. A param left out of the next backward is then not stepped."""
    import importlib
    try:
        ds_cls = getattr(importlib.import_module(module), name)
    except Exception as exc:  # DeepSpeed not installed here: CI installs it (MFA_REQUIRE_DEEPSPEED)
        import os
        if os.environ.get("MFA_REQUIRE_DEEPSPEED"):
            raise
        pytest.skip(f"DeepSpeed not importable: {exc!r}")
    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    # DeepSpeed's class without its constructor, which loads its CUDA op; zero_grad is its own.
    theirs = ds_cls.__new__(ds_cls)
    torch.optim.Optimizer.__init__(theirs, ps, dict(lr=0.1))
    theirs.set_grad_none = set_grad_none
    for p in ps:
        p.grad = torch.ones(3)
    theirs.zero_grad()
    assert all(p.grad is None for p in ps)
    ours = ours_cls(ps, lr=0.1, set_grad_none=set_grad_none)
    for p in ps:
        p.grad = torch.ones(3)
    ours.zero_grad()
    assert all(p.grad is None for p in ps)
    # An unused param keeps its value: not stepped by momentum or decay.
    ps[0].grad = torch.ones(3)
    ours.step()
    ours.zero_grad()
    ps[0].grad = torch.ones(3)
    before = ps[1].detach().clone()
    ours.step()
    assert torch.equal(ps[1], before)


# --- 6. Moments without a step count -------------------------------------------------------------

def trained_state_dict(cls, **kw):
    p = torch.nn.Parameter(torch.randn(300))
    opt = cls([p], lr=1e-2, **kw)
    for _ in range(3):
        p.grad = torch.randn(300)
        opt.step()
    return opt.state_dict()


@pytest.mark.parametrize("cls", [torch.optim.AdamW, mfa.AdamW, mfa.Adagrad, mfa.AdamW8bit])
def test_moments_without_a_step_are_refused_at_load(cls):
    """torch 2.13 raises KeyError: 'step' from its load (its __setstate__ reads the step); ours
    refuses the load with a ValueError naming the param, before anything is loaded (it used to
    load the moments and restart the param at step 1)."""
    kw = dict(min_8bit_size=256) if cls is mfa.AdamW8bit else {}
    sd = trained_state_dict(cls, **kw)
    del sd["state"][0]["step"]
    if cls is torch.optim.AdamW:
        p = torch.nn.Parameter(torch.randn(300))
        opt = cls([p], lr=1e-2)
        with pytest.raises(KeyError, match="step"):
            opt.load_state_dict(sd)
        return
    p = torch.nn.Parameter(torch.randn(300))
    opt = cls([p], lr=1e-2, **kw)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state.get(p, {}).items()}
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(300,\), float32, cpu\): the "
                                         r"state dict's state has .* but no 'step'"):
        opt.load_state_dict(sd)
    after = opt.state.get(p, {})  # Adagrad's state is made at construction: left as it was
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], v) if isinstance(v, torch.Tensor) else after[k] == v for k, v in before.items())


def test_lion_pytorchs_state_dict_has_no_step_and_still_loads():
    from lion_pytorch import Lion as TheirLion
    p = torch.nn.Parameter(torch.randn(8))
    theirs = TheirLion([p], lr=1e-3)
    p.grad = torch.randn(8)
    theirs.step()
    sd = theirs.state_dict()
    assert "step" not in sd["state"][0]
    q = torch.nn.Parameter(p.detach().clone())
    ours = mfa.Lion([q], lr=1e-3)
    ours.load_state_dict(sd)
    assert torch.equal(ours.state[q]["exp_avg"], sd["state"][0]["exp_avg"])


# --- 11. What a bad loaded group or a freed storage says -----------------------------------------

@pytest.mark.parametrize("cls", [mfa.AdamW, mfa.Lion, mfa.Adagrad, mfa.AdamW8bit])
@pytest.mark.parametrize("key,value,what", [("lr", "fast", "learning rate"),
                                            ("weight_decay", None, "weight_decay value")])
def test_a_loaded_non_number_hyperparameter_fails_naming_the_group(cls, key, value, what):
    """torch's AdamW fails at the step too, with a TypeError that names no group."""
    q = torch.nn.Parameter(torch.randn(4))
    theirs = torch.optim.AdamW([q])
    sd = theirs.state_dict()
    sd["param_groups"][0][key] = value
    theirs.load_state_dict(sd)
    q.grad = torch.ones(4)
    with pytest.raises(TypeError):
        theirs.step()
    p = torch.nn.Parameter(torch.randn(4))
    opt = cls([p, torch.nn.Parameter(torch.randn(4))], lr=1e-2)
    sd = opt.state_dict()
    sd["param_groups"][0][key] = value
    opt.load_state_dict(sd)
    p.grad = torch.ones(4)
    with pytest.raises(TypeError, match=rf"^Invalid {what}: {value!r} is a {type(value).__name__}, not a number "
                                        rf"\(in param_groups\[0\]\)$"):
        opt.step()
    assert int(opt.state.get(p, {}).get("step", 0)) == 0  # nothing stepped


# A state exists before the first step only for Adagrad (made at construction).
FREED = [(cls, freed, warm) for cls in (mfa.AdamW, mfa.Lion, mfa.Adagrad, mfa.CPUAdam, mfa.AdamW8bit)
         for freed in ("param", "grad", "state") for warm in (0, 2)
         if not (freed == "state" and warm == 0 and cls is not mfa.Adagrad)]


@pytest.mark.parametrize("cls,freed,warm", FREED, ids=[f"{c.__name__}-{f}-{'planned' if w else 'first-step'}"
                                                         for c, f, w in FREED])
def test_a_freed_storage_names_the_param_and_nothing_is_written(cls, freed, warm):
    """It used to reach the kernel, which said "tensor 0 has address 0" after the step counts (and,
    on a first step, the new states) were written."""
    torch.manual_seed(0)
    ok, p = torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(300))
    opt = cls([{"params": [ok]}, {"params": [p]}], lr=1e-2)
    for _ in range(warm):
        ok.grad, p.grad = torch.randn(300), torch.randn(300)
        opt.step()
    ok.grad, p.grad = torch.randn(300), torch.randn(300)
    before = ok.detach().clone(), {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[ok].items()}
    p_step = opt.state.get(p, {}).get("step")
    target = {"param": p, "grad": p.grad}.get(freed)
    if target is None:
        target = next(v for v in opt.state[p].values() if isinstance(v, torch.Tensor))
    target.untyped_storage().resize_(0)
    what = {"param": "the param", "grad": "its grad", "state": "its state"}[freed]
    with pytest.raises(ValueError, match=rf"^param_groups\[1\]\['params'\]\[0\] \(shape \(300,\), float32, cpu\): "
                                         rf"{what}.* has no memory \(address 0"):
        opt.step()
    assert opt.state.get(p, {}).get("step") == p_step  # no step counted, no state made
    assert torch.equal(ok, before[0])  # the other group's param: not written either
    assert {k: v for k, v in opt.state[ok].items() if not isinstance(v, torch.Tensor)} == \
        {k: v for k, v in before[1].items() if not isinstance(v, torch.Tensor)}


# --- The 8-bit classes: modes, checkpoints of torch and bitsandbytes, min_8bit_size, steps --------

def test_adam8bit_takes_a_loaded_adamw_state_dicts_decoupled_decay_as_torch_adam_does():
    sd = fresh_state_dict(torch.optim.AdamW)
    theirs, _ = one_step(torch.optim.Adam, sd)
    ours, opt = one_step(mfa.Adam8bit, sd)
    l2, _ = one_step(torch.optim.Adam)
    assert opt.param_groups[0]["adam_w_mode"] is True
    assert ours == pytest.approx(theirs, abs=1e-6) and abs(theirs - l2) > 0.01


def test_adamw8bit_loading_an_adam_state_dict_keeps_decoupled_decay_as_torch_adamw_does():
    sd = fresh_state_dict(torch.optim.Adam)
    theirs, _ = one_step(torch.optim.AdamW, sd)
    ours, opt = one_step(mfa.AdamW8bit, sd)
    assert opt.param_groups[0]["adam_w_mode"] is True
    assert ours == pytest.approx(theirs, abs=1e-6)


def test_a_torch_adamw_checkpoint_is_quantized_on_load():
    """The fp32 moments of a param of at least min_8bit_size elements become 8-bit codes (2.03
    bytes of state per element, not 8), as the next step would store them; training goes on
    close to torch's AdamW resumed from the same checkpoint."""
    from mps_fused_adam.numerics.reference_lowbit import dequantize
    from mps_fused_adam.optimizers.eight_bit import state_bytes_per_param
    torch.manual_seed(0)
    n = 4096 * 4
    p = torch.nn.Parameter(torch.randn(n))
    small = torch.nn.Parameter(torch.randn(100))
    theirs = torch.optim.AdamW([p, small], lr=1e-3)
    for _ in range(100):
        p.grad, small.grad = torch.randn(n), torch.randn(100)
        theirs.step()
    sd = theirs.state_dict()
    q, q_small = torch.nn.Parameter(p.detach().clone()), torch.nn.Parameter(small.detach().clone())
    ours = mfa.AdamW8bit([q, q_small], lr=1e-3)
    ours.load_state_dict(sd)
    st = ours.state[q]
    assert "exp_avg" not in st and st["exp_avg_codes"].dtype is torch.uint8 and st["step"] == 100
    assert ours.state[q_small]["exp_avg"].dtype is torch.float32  # below min_8bit_size: fp32, as ever
    assert state_bytes_per_param(ours) < 2.2
    m, v = sd["state"][0]["exp_avg"], sd["state"][0]["exp_avg_sq"]
    scale_m = m.abs().view(-1, 256).amax(1).repeat_interleave(256)
    assert ((dequantize(st["exp_avg_codes"], st["exp_avg_absmax"], True) - m).abs() <= 0.02 * scale_m).all()
    assert (dequantize(st["exp_avg_sq_codes"], st["exp_avg_sq_absmax"], False) > 0).all()  # v > 0 stays > 0
    start = p.detach().clone()
    for _ in range(5):
        g = torch.randn(n)
        p.grad, q.grad = g, g.clone()
        small.grad = q_small.grad = torch.ones(100)
        theirs.step()
        ours.step()
    moved = (p - start).abs().max()
    assert (q - p).abs().max() < 0.05 * moved


def test_min_8bit_size_is_checked_the_same_in_the_constructor_and_add_param_group():
    """bitsandbytes 0.50 takes the value as a threshold at its first step ('4096' raises a
    TypeError there, 1.5 and True pass as numbers); ours refuses each the same way in both places."""
    for value in ("4096", 1.5, True, 0):
        with pytest.raises(ValueError, match=rf"^AdamW8bit: min_8bit_size must be a positive element count "
                                             rf"\(an int\), got {re.escape(repr(value))}$"):
            mfa.AdamW8bit([torch.nn.Parameter(torch.ones(2))], min_8bit_size=value)
        opt = mfa.AdamW8bit([torch.nn.Parameter(torch.ones(2))])
        with pytest.raises(ValueError, match=rf"^param_groups\[1\]: min_8bit_size must be a positive element count "
                                             rf"\(an int\), got {re.escape(repr(value))}$"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "min_8bit_size": value})
        assert len(opt.param_groups) == 1


def _bnb_trained_state_dict(bnb):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4096)), torch.nn.Parameter(torch.randn(64))]
    opt = bnb.optim.AdamW8bit(ps, lr=1e-3)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    return ps, opt.state_dict()


@pytest.mark.parametrize("cls", [mfa.AdamW8bit, mfa.AdamW4bit])
def test_a_bitsandbytes_state_dict_loaded_directly_names_the_conversion(cls):
    from conftest import require_bitsandbytes
    from mps_fused_adam.bnb_compat import from_bitsandbytes
    bnb = require_bitsandbytes()
    ps, sd = _bnb_trained_state_dict(bnb)
    ours = cls([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-3)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(4096,\), float32, cpu\): the "
                                         r"state dict is in bitsandbytes' layout .*mps_fused_adam\.bnb_compat\."
                                         r"from_bitsandbytes\(state_dict\)"):
        ours.load_state_dict(sd)
    assert not ours.state
    ours.load_state_dict(from_bitsandbytes(sd))
    assert ours.state[ours.param_groups[0]["params"][0]]["step"] == 3


@pytest.mark.parametrize("cls", [mfa.AdamW8bit, mfa.Adam8bit])
def test_8bit_state_dict_steps_are_torchs_tensors_and_int_steps_still_load(cls):
    sd = trained_state_dict(cls, min_8bit_size=256)
    theirs = trained_state_dict(torch.optim.AdamW)
    step, torch_step = sd["state"][0]["step"], theirs["state"][0]["step"]
    assert isinstance(step, torch.Tensor) and step.dim() == 0 and step.dtype == torch_step.dtype and float(step) == 3
    p = torch.nn.Parameter(torch.randn(300))
    opt = cls([p], lr=1e-2, min_8bit_size=256)
    opt.load_state_dict(sd)
    assert opt.state[p]["step"] == 3 and type(opt.state[p]["step"]) is int  # the live count stays an int
    sd["state"][0]["step"] = 3  # a checkpoint of an earlier version (int steps)
    opt.load_state_dict(sd)
    assert opt.state[p]["step"] == 3
