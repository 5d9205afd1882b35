"""Every step bumps autograd's version counter of each param it writes, as torch's optimizers do
(their in-place updates bump it): a graph retained before ``step()`` and run again afterwards
raises torch's "modified by an inplace operation" error instead of silently using the new weights.
Checked for every public class, on the full and the planned step path, behind a backend that
writes nothing (the bump is the step path's, not a kernel's), and for the DeepSpeed op facades."""
from __future__ import annotations

import pytest
import torch

import mps_fused_adam as mfa
from conftest import public_optimizer_names
from mps_fused_adam import backends

INPLACE = "modified by an inplace operation"

# Every public class; the 8-bit ones with a tensor above and one below min_8bit_size.
CLASSES = {name: getattr(mfa, name) for name in public_optimizer_names()}


def retained_then_stepped(opt_cls, steps=3, sizes=(8, 600), **kw):
    """For each step: a backward with retain_graph, the step, then the retained graph's backward
    again. Returns, per step, (version increase of each param, the second backward's error or None)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = opt_cls(params, lr=1e-2, **kw)
    out = []
    for _ in range(steps):
        x = [torch.randn(n) for n in sizes]
        loss = sum((p * p * xi).sum() for p, xi in zip(params, x))
        loss.backward(retain_graph=True)
        before = [p._version for p in params]
        opt.step()
        bumped = [p._version - b for p, b in zip(params, before)]
        try:
            loss.backward()
            error = None
        except RuntimeError as exc:
            error = str(exc)
        opt.zero_grad()
        out.append((bumped, error))
    return out


def test_torch_raises_on_a_graph_retained_across_its_step():
    """The reference behaviour: torch.optim.AdamW's update bumps the counter."""
    for bumped, error in retained_then_stepped(torch.optim.AdamW):
        assert all(b > 0 for b in bumped) and error is not None and INPLACE in error


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_class_raises_as_torch_does(name):
    kw = dict(min_8bit_size=256) if "8bit" in name else {}
    for bumped, error in retained_then_stepped(CLASSES[name], **kw):  # step 1 full path, then planned
        assert all(b > 0 for b in bumped), bumped
        assert error is not None and INPLACE in error, error


class _WritesNothing:
    name = "writes-nothing"

    def update(self, *args, **kwargs):
        pass


@pytest.mark.parametrize("cls", [mfa.AdamW, mfa.Lion, mfa.Adagrad, mfa.CPUAdam])
def test_the_bump_is_the_step_paths_not_a_kernels(cls, monkeypatch):
    """Behind a backend that writes nothing (as the Metal tiers write through buffer handles),
    each stepped param is still bumped once per step, and a param without a grad is not."""
    monkeypatch.setitem(backends._chosen, "cpu", _WritesNothing())
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = cls([a, b], lr=1e-2)
    for step in range(1, 4):
        a.grad = torch.ones(4)
        opt.step()
        assert (a._version, b._version) == (step, 0)


def test_step_in_backward_bumps_too():
    p = torch.nn.Parameter(torch.ones(4))
    opt = mfa.AdamW([p], step_in_backward=True)
    for step in range(1, 4):
        (p * 2).sum().backward()
        assert p._version == step and opt.state[p]["step"] == step


def test_deepspeed_facades_bump_the_tensors_they_are_given():
    """DeepSpeed's optimizers hand their kernels ``p.data`` (a counter of its own), ZeRO its flat
    partitions; a caller that hands the param or a ``.detach()`` view gets the param bumped."""
    from mps_fused_adam.deepspeed import ops, rule_ops
    p = torch.nn.Parameter(torch.ones(8))
    g, m, v = torch.full((8,), 0.1), torch.zeros(8), torch.zeros(8)
    calls = [
        lambda: ops.FUSED_ADAM_OP.multi_tensor_adam(1, None, [[g], [p.detach()], [m], [v]], 1e-2, 0.9, 0.999, 1e-8,
                                                    1, 1, 1, 0.0),
        lambda: ops.CPU_ADAM_OP.adam_update(0, 1, 1e-2, 0.9, 0.999, 1e-8, 0.0, True, p.detach(), g, m, v),
        lambda: rule_ops.FUSED_LION_OP.multi_tensor_lion(1, None, [[g], [p.detach()], [m]], 1e-2, 0.9, 0.99, 1, 0.0),
        lambda: rule_ops.CPU_LION_OP.lion_update(0, 1, 1e-2, 0.9, 0.99, 0.0, p.detach(), g, m),
        lambda: rule_ops.CPU_ADAGRAD_OP.adagrad_update(0, 1, 1e-2, 1e-8, 0.0, p.detach(), g, v),
    ]
    ops.CPU_ADAM_OP.create_adam(0)
    rule_ops.CPU_LION_OP.create_lion(0)
    rule_ops.CPU_ADAGRAD_OP.create_adagrad(0)
    try:
        for i, call in enumerate(calls):
            before = p._version
            call()
            assert p._version > before, i
    finally:
        ops.CPU_ADAM_OP.destroy_adam(0)
        rule_ops.CPU_LION_OP.destroy_lion(0)
        rule_ops.CPU_ADAGRAD_OP.destroy_adagrad(0)
