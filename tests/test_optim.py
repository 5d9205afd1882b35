"""The optimizer classes on CPU tensors: torch parity, param groups, schedulers, closures,
state dicts in both directions, dtype policies, non-contiguous and skipped tensors."""
from __future__ import annotations

import copy

import pytest
import torch

import mps_fused_adam as mfa
from conftest import public_optimizer_names
from optim_db import OPTIM_DB
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference import reference_adam_


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


@pytest.mark.parametrize("src,dst,saved_dtype,want_dtype", [
    (mfa.CPUAdam, mfa.AdamW, torch.float32, torch.bfloat16),
    (torch.optim.AdamW, mfa.CPUAdam, torch.bfloat16, torch.float32),
], ids=["CPUAdam-fp32-to-AdamW", "torch.AdamW-bf16-to-CPUAdam"])
def test_loaded_states_take_the_destinations_state_dtype(src, dst, saved_dtype, want_dtype):
    """A checkpoint's moments are cast to the loading optimizer's state dtype (AdamW: the param's
    bf16; CPUAdam: fp32), not kept in the saved dtype; the next step then matches the reference
    started from the saved moments rounded to that dtype, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    n = 1000
    a = torch.nn.Parameter(torch.randn(n, generator=gen).bfloat16())
    kw = dict(lr=1e-2, weight_decay=0.01)
    oa = src([a], **kw)
    for _ in range(2):
        a.grad = torch.randn(n, generator=gen).bfloat16()
        oa.step()
    saved = copy.deepcopy(oa.state_dict())
    st_saved = next(iter(saved["state"].values()))
    assert st_saved["exp_avg"].dtype == saved_dtype and st_saved["exp_avg_sq"].dtype == saved_dtype
    b = torch.nn.Parameter(a.detach().clone())
    ob = dst([b], **kw)
    ob.load_state_dict(saved)
    st = ob.state[b]
    for name in ("exp_avg", "exp_avg_sq"):
        assert st[name].dtype == want_dtype, f"{name}: {st[name].dtype}, want {want_dtype}"
        assert torch.equal(st[name], st_saved[name].to(want_dtype))
    # One step from there against the reference on the same starting values.
    g = torch.randn(n, generator=gen).bfloat16()
    ref = [b.detach().clone(), g.clone(), st_saved["exp_avg"].to(want_dtype), st_saved["exp_avg_sq"].to(want_dtype)]
    b.grad = g
    ob.step()
    reference_adam_(*ref, AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.01, 3))
    assert st["exp_avg"].dtype == want_dtype and int(st["step"]) == 3
    assert torch.equal(b.detach().view(torch.int16), ref[0].view(torch.int16))
    assert torch.equal(st["exp_avg"], ref[2]) and torch.equal(st["exp_avg_sq"], ref[3])
    assert not torch.equal(b.detach(), a.detach())


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


def _conv_pair(seed=0):
    """A channels_last conv (its weight is not contiguous, so its group takes the full path every
    step) and a copy."""
    torch.manual_seed(seed)
    a = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    b = copy.deepcopy(a)
    return a, b


def _same_grads(a, b, gen):
    for pa, pb in zip(a.parameters(), b.parameters()):
        g = torch.randn(pa.shape, generator=gen)
        pa.grad = g.clone().to(memory_format=torch.channels_last) if pa.dim() == 4 else g.clone()
        pb.grad = g.clone().to(memory_format=torch.channels_last) if pb.dim() == 4 else g.clone()


@pytest.mark.parametrize("how", ["replaced by {}", "cleared", "param swapped in place"])
def test_full_path_sees_state_and_param_changes_as_torch(how):
    """Groups that take the full validation every step (a non-contiguous param here) look states
    up through a cache: an emptied or replaced state dict, or another param put in the group's
    list in place, must act as in torch (fresh state), not reuse what was cached."""
    a, b = _conv_pair()
    oa = mfa.Adam(a.parameters(), lr=0.1)
    ob = torch.optim.Adam(b.parameters(), lr=0.1, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        _same_grads(a, b, gen)
        oa.step()
        ob.step()
        if i == 1:
            if how == "replaced by {}":
                oa.state[a.weight] = {}
                ob.state[b.weight] = {}
            elif how == "cleared":
                oa.state[a.bias].clear()
                ob.state[b.bias].clear()
            else:
                new_a = torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(5)))
                new_b = torch.nn.Parameter(new_a.detach().clone())
                oa.param_groups[0]["params"][1] = a.bias = new_a
                ob.param_groups[0]["params"][1] = b.bias = new_b
    for pa, pb in zip((a.weight, a.bias), (b.weight, b.bias)):
        torch.testing.assert_close(pa.detach(), pb.detach(), rtol=1e-5, atol=1e-6)
        assert int(oa.state[pa]["step"]) == int(ob.state[pb]["step"])
        torch.testing.assert_close(oa.state[pa]["exp_avg"], ob.state[pb]["exp_avg"], rtol=1e-5, atol=1e-7)


_MODE_CASES = [(src, dst, decoupled)
               for src, dst in [(torch.optim.Adam, mfa.Adam), (mfa.Adam, torch.optim.Adam), (torch.optim.AdamW, mfa.Adam),
                                (mfa.AdamW, torch.optim.Adam), (mfa.Adam, mfa.FusedAdam), (mfa.FusedAdam, mfa.Adam)]
               for decoupled in (True, False) if decoupled or src not in (torch.optim.AdamW, mfa.AdamW)]


@pytest.mark.parametrize("src,dst,decoupled", _MODE_CASES,
                         ids=[f"{s.__module__.split('.')[0]}.{s.__name__}-{d.__module__.split('.')[0]}.{d.__name__}-"
                              f"{'decoupled' if c else 'l2'}" for s, d, c in _MODE_CASES])
def test_weight_decay_mode_travels_with_the_state_dict(src, dst, decoupled):
    """torch keeps the mode in each group (``decoupled_weight_decay``), DeepSpeed's signature in
    ``adam_w_mode``; a loaded state dict brings its mode, as torch -> torch does."""
    def make(cls, params):
        if cls in (torch.optim.AdamW, mfa.AdamW):
            return cls(params, lr=1e-2, weight_decay=0.5)
        if cls is mfa.FusedAdam:
            return cls(params, lr=1e-2, weight_decay=0.5, adam_w_mode=decoupled)
        return cls(params, lr=1e-2, weight_decay=0.5, decoupled_weight_decay=decoupled)
    a, b, c = make_model(), make_model(), make_model()
    b.load_state_dict(a.state_dict())
    c.load_state_dict(a.state_dict())
    oa = make(src, a.parameters())
    train(a, oa, steps=2)
    b.load_state_dict(a.state_dict())
    c.load_state_dict(a.state_dict())
    # The destination is built with the other mode; the loaded dict must set it back.
    ob = (dst(b.parameters(), lr=1e-2, weight_decay=0.5, adam_w_mode=not decoupled) if dst is mfa.FusedAdam else
          dst(b.parameters(), lr=1e-2, weight_decay=0.5, decoupled_weight_decay=not decoupled))
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    oc = torch.optim.Adam(c.parameters(), lr=1e-2, weight_decay=0.5, decoupled_weight_decay=decoupled,
                          foreach=False)
    oc.load_state_dict(_as_torch_state_dict(oa.state_dict()))
    train(b, ob, steps=2, seed=1)
    train(c, oc, steps=2, seed=1)
    assert_params_close(b, c)


def _as_torch_state_dict(sd):
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
        if "adam_w_mode" in g:  # FusedAdam's (DeepSpeed's) key, which torch does not read
            g["decoupled_weight_decay"] = g.pop("adam_w_mode")
        g.pop("bf16_stochastic_round", None)
    return sd


def test_load_state_dict_runs_torchs_hooks_in_torchs_order():
    """Pre-hooks see (and may replace) the dict before anything is checked or loaded; post-hooks
    run once everything, our re-taken states included, is loaded; each once, as in torch."""
    results = {}
    for cls in (torch.optim.AdamW, mfa.AdamW, mfa.AdamW8bit):
        model = make_model()
        opt = cls(model.parameters(), lr=1e-2)
        train(model, opt, steps=2)
        sd = copy.deepcopy(opt.state_dict())
        calls = []

        def pre(o, state_dict):
            calls.append("pre")
            renamed = copy.deepcopy(state_dict)
            for st in renamed["state"].values():
                st["exp_avg"] = st.pop("momentum")  # a checkpoint with its own key names
                st["exp_avg"].zero_()
            return renamed

        def post(o):
            calls.append("post")
            for st in o.state.values():
                st["exp_avg_sq"].fill_(1.0)

        for st in sd["state"].values():
            st["momentum"] = st.pop("exp_avg")
        fresh = cls(model.parameters(), lr=1e-2)
        fresh.register_load_state_dict_pre_hook(pre)
        fresh.register_load_state_dict_post_hook(post)
        fresh.load_state_dict(sd)
        results[cls] = (calls, [(float(st["exp_avg"].abs().max()), float(st["exp_avg_sq"].min()))
                                for st in fresh.state.values()])
    assert results[mfa.AdamW] == results[torch.optim.AdamW] == results[mfa.AdamW8bit]  # small params: fp32 moments
    assert results[mfa.AdamW][0] == ["pre", "post"] and results[mfa.AdamW][1][0] == (0.0, 1.0)


# Each class with the constructor options it keeps as attributes (tests/optim_db.py: ``kept``).
DEEPCOPY_CASES = {name: (lambda ps, info=info: info.cls(ps, **info.kept))
                  for name, info in OPTIM_DB.items() if info.kept is not None}


def test_every_optimizer_class_is_deep_copied():
    """Every public class (a new rule's too) has deep-copy arguments in optim_db, except Adam,
    Adam8bit and Adam4bit, which AdamW, AdamW8bit and AdamW4bit cover (same class body, another
    default); all are of the one step path (optimizers/fused.py)."""
    from mps_fused_adam.optimizers.fused import _FusedOptimizer
    names = public_optimizer_names()
    assert all(issubclass(getattr(mfa, n), _FusedOptimizer) for n in names)
    assert sorted([*DEEPCOPY_CASES, "Adam", "Adam4bit", "Adam8bit"]) == names


@pytest.mark.parametrize("make", DEEPCOPY_CASES.values(), ids=DEEPCOPY_CASES.keys())
def test_deepcopy_and_pickle_keep_constructor_options(make, tmp_path):
    """Options kept as attributes (DeepSpeed's and lion_pytorch's signatures) survive
    copy.deepcopy and torch.save/torch.load, and the copy trains as the original does."""
    model = make_model()
    opt = make(model.parameters())
    train(model, opt, steps=2)
    torch.save((model, opt), tmp_path / "both.pt")
    for twin_model, twin in (copy.deepcopy((model, opt)), torch.load(tmp_path / "both.pt", weights_only=False)):
        for k in type(opt)._config_attributes:
            assert getattr(twin, k) == getattr(opt, k), k
    # Both copies (each optimizer on its copied model's params) train on as the original does.
    twins = [copy.deepcopy((model, opt)), torch.load(tmp_path / "both.pt", weights_only=False)]
    train(model, opt, steps=2, seed=1)
    for twin_model, twin in twins:
        train(twin_model, twin, steps=2, seed=1)
        for pa, pb in zip(model.parameters(), twin_model.parameters()):
            assert torch.equal(pa, pb)


def test_malformed_step_count_rejected_before_any_group_is_written():
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = mfa.AdamW([{"params": [a]}, {"params": [b]}], lr=1e-2)
    for p in (a, b):
        p.grad = torch.ones(4)
    opt.step()
    opt.state[b]["step"] = None
    before = [a.detach().clone(), opt.state[a]["exp_avg"].clone(), opt.state[a]["step"]]
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\].*'step' is None"):
        opt.step()
    assert torch.equal(a.detach(), before[0]) and torch.equal(opt.state[a]["exp_avg"], before[1])
    assert opt.state[a]["step"] == before[2]


def test_fused_adam_ignores_grad_scaler_as_deepspeed():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = mfa.FusedAdam([p], lr=1e-2)
    opt.step(grad_scaler=object())  # DeepSpeed's FusedAdam.step never reads it
    assert not torch.equal(p.detach(), torch.ones(3))
    with pytest.raises(RuntimeError, match="FusedAdam has been updated"):
        opt.step(scale=2.0)


def test_zero_tensor_grad_steps_as_zeros():
    """A ZeroTensor grad (torch's zeros without memory, address 0) is stepped as the zeros it
    stands for, as torch's optimizers take it, on the full path and on a planned step alike, and
    never handed to the kernel as an address: bit for bit the step of a dense zero grad, and
    within the contract's bound of torch.optim.AdamW given the same ZeroTensor."""
    ours = [torch.nn.Parameter(torch.linspace(-1, 1, 4)) for _ in range(2)]
    dense = [torch.nn.Parameter(torch.linspace(-1, 1, 4)) for _ in range(2)]
    theirs = [torch.nn.Parameter(torch.linspace(-1, 1, 4)) for _ in range(2)]
    opts = mfa.AdamW(ours, lr=1e-2), mfa.AdamW(dense, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)
    for i in range(4):  # step 1 creates state; steps 2-4 would be planned; ZeroTensors in 3 and 4
        for ps, zero in ((ours, torch._efficientzerotensor(4)), (dense, torch.zeros(4)),
                         (theirs, torch._efficientzerotensor(4))):
            ps[0].grad = torch.full((4,), 0.5 + i)
            ps[1].grad = zero if i >= 2 else torch.full((4,), 0.25)
        for opt in opts:
            opt.step()
    for a, b, c in zip(ours, dense, theirs):
        assert torch.equal(a.detach(), b.detach())
        torch.testing.assert_close(a.detach(), c.detach(), rtol=0, atol=8 * torch.finfo(torch.float32).eps)
    assert opts[0].state[ours[1]]["step"] == 4
