"""Every optimizer's step entry (step_entry.py): torch's step hooks, their argument rewriting,
the profiler's range and LR schedulers behave as with torch's own wrapper, and with nothing
observing the step torch's record_function is not entered at all."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import mps_fused_adam as mfa

from optim_db import OPTIM_DB

CLASSES = {name: info.make for name, info in OPTIM_DB.items()}  # test_optim_db checks it lists every class


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (300, 17)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps


def _twin(name: str):
    """Two optimizers of one class on equal params; the second never sees a hook."""
    a, b = _params(), _params()
    return CLASSES[name](a), a, CLASSES[name](b), b


class _RecordFunctionCount:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = 0
        real = torch.autograd.profiler.record_function.__enter__

        def enter(rf):
            self.entered += 1
            return real(rf)
        monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", enter)


@pytest.mark.parametrize("name", CLASSES)
def test_step_is_not_rewrapped_by_torch(name):
    opt = CLASSES[name](_params())
    step = type(opt).step
    assert step.hooked is True
    # torch's _patch_step_function would have replaced it by its own wrapper around this one.
    assert step.__wrapped__.__qualname__.endswith(".step")
    assert not hasattr(step.__wrapped__, "hooked")


@pytest.mark.parametrize("name", CLASSES)
def test_no_observer_no_record_function(name, monkeypatch):
    count = _RecordFunctionCount(monkeypatch)
    opt, ps, ref, rps = _twin(name)
    opt.step()
    ref.step()
    assert count.entered == 0
    for p, q, before in zip(ps, rps, _params()):
        assert torch.equal(p, q)
        assert not torch.equal(p, before)  # the step did update


@pytest.mark.parametrize("name", CLASSES)
def test_instance_hooks_run_once_with_torchs_arguments(name, monkeypatch):
    count = _RecordFunctionCount(monkeypatch)
    opt, ps, ref, rps = _twin(name)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o, args, kwargs)))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", o, args, kwargs)))
    opt.step()
    ref.step()
    assert count.entered == 1  # torch's wrapper, with its range, for the hooked optimizer only
    # What torch's own optimizers hand their hooks: the positional arguments include the optimizer.
    torch_opt = torch.optim.SGD(_params(), lr=0.1)
    torch_seen = []
    torch_opt.register_step_pre_hook(lambda o, args, kwargs: torch_seen.append(("pre", args, kwargs)))
    torch_opt.register_step_post_hook(lambda o, args, kwargs: torch_seen.append(("post", args, kwargs)))
    torch_opt.step()
    assert torch_seen == [("pre", (torch_opt,), {}), ("post", (torch_opt,), {})]
    assert [(s[0], s[1], s[2], s[3]) for s in seen] == [("pre", opt, (opt,), {}), ("post", opt, (opt,), {})]
    for p, q in zip(ps, rps):  # the update ran once
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", CLASSES)
def test_global_hooks_and_argument_rewriting(name):
    opt, ps, ref, rps = _twin(name)
    calls = []

    def closure():
        calls.append("closure")
        return torch.tensor(2.5)

    def pre(o, args, kwargs):
        calls.append("pre")
        return args, {"closure": closure}  # torch's contract: a hook may replace the arguments

    h1 = register_optimizer_step_pre_hook(pre)
    h2 = register_optimizer_step_post_hook(lambda o, args, kwargs: calls.append(("post", kwargs["closure"])))
    try:
        loss = opt.step()
    finally:
        h1.remove()
        h2.remove()
    assert loss == 2.5
    assert calls == ["pre", "closure", ("post", closure)]
    ref.step()
    for p, q in zip(ps, rps):
        assert torch.equal(p, q)
    calls.clear()
    opt.step()  # hooks removed: the direct path again, no hook called
    assert calls == []


@pytest.mark.parametrize("name", ["AdamW", "Lion", "AdamW8bit"])
def test_profiler_range(name):
    opt = CLASSES[name](_params())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    names = [e.name for e in prof.events()]
    assert f"Optimizer.step#{type(opt).__name__}.step" in names


@pytest.mark.parametrize("name", ["AdamW", "Adagrad", "AdamW8bit"])
def test_lr_scheduler_sees_the_step(name):
    opt = CLASSES[name](_params())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        for _ in range(2):
            opt.step()
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(CLASSES[name](_params()).param_groups[0]["lr"] / 4)


def test_legacy_arguments_still_rejected():
    opt = mfa.FusedAdam(_params())
    with pytest.raises(RuntimeError, match="FusedAdam has been updated"):
        opt.step(grads=[1])
    lion = mfa.FusedLion(_params())
    with pytest.raises(RuntimeError, match="FusedLion has been updated"):
        lion.step(scale=2.0)


@pytest.mark.parametrize("base", [mfa.AdamW, mfa.FusedAdam, mfa.Lion])
def test_subclass_overriding_step_runs_hooks_once(base):
    """A user's subclass whose ``step`` calls ``super().step()``: torch wraps the subclass's step
    (its _patch_step_function), so the hooks run there, once per step. (torch's own AdamW runs
    them twice in such a subclass once an AdamW of its own has been made, which wraps the base
    class's step too; ours never do.)"""
    base([torch.nn.Parameter(torch.ones(1))])  # the base class's own instance, made first
    class Mine(base):
        def step(self, closure=None):
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(4))
    opt = Mine([p], lr=1e-2)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    for _ in range(2):
        p.grad = torch.ones(4)
        opt.step()
    assert calls == ["pre", "post", "pre", "post"]


@pytest.mark.parametrize("name", CLASSES)
def test_compiled_step_runs_eagerly_with_the_same_bits(name):
    """``torch.compile(opt.step)`` and a compiled function that calls ``step`` (PyTorch's
    optimizer tutorial) run our step eagerly: the same params and states, bit for bit, as the
    plain step of a twin optimizer. Dynamo used to trace into the step and call an extension
    method without its ``self`` (a TypeError on the second step, once a plan existed)."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):  # proves Dynamo ran: the function's own tensor op is a graph
        graphs.append(gm)
        return gm.forward

    opt, a, twin, b = _twin(name)
    seen = torch.zeros(1)

    @torch.compile(backend=backend)
    def compiled_step():
        seen.add_(1)
        opt.step()

    for step in range(3):
        compiled_step()
        twin.step()
        for p, q in zip(a, b):
            g = torch.Generator().manual_seed(100 + step)
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
    assert graphs and seen.item() == 3
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key, value in twin.state[q].items():
            mine = opt.state[p][key]
            assert torch.equal(mine, value) if torch.is_tensor(value) else mine == value, key
    torch._dynamo.reset()
