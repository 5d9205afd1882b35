"""accelerate's ``Accelerator.prepare`` with our optimizers on CPU, beside torch's AdamW: gradient
accumulation through ``accelerator.accumulate`` (the wrapped ``step()`` runs every second
micro-batch), clipping through ``accelerator.clip_grad_norm_``, and ``step_in_backward=True``:
bit for bit the plain step without accumulation, the true gradient norm from
``clip_grad_norm_(params, inf)``, and a clear error for accumulation and for clipping."""
from __future__ import annotations

import pytest
import torch

import integration_support as integration

accelerate = integration.require("accelerate")

import mps_fused_adam as mfa  # noqa: E402
from mps_fused_adam.optimizers import consumed_grads  # noqa: E402

LR, MICRO, STEPS = 3e-3, 8, 4


@pytest.fixture(autouse=True)
def _fresh_state():
    from accelerate.state import AcceleratorState, GradientState
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 4))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(MICRO * STEPS * 2, 16, generator=gen), torch.randint(0, 4, (MICRO * STEPS * 2,), generator=gen)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=MICRO, shuffle=False)
    return model, data


def run(make_opt, accumulation: int = 2, clip: float | None = None):
    """Train through accelerate; returns (weights, losses, optimizer steps, norms, optimizer)."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model, data = model_and_data()
    opt = make_opt(model)
    model, popt, data = acc.prepare(model, opt, data)
    losses, norms, steps = [], [], 0
    for x, y in data:
        with acc.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
            if acc.sync_gradients and clip is not None:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
            popt.step()
            steps += not popt.step_was_skipped and acc.sync_gradients
            popt.zero_grad()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses, steps, norms, opt


def ours(**kw):
    return lambda m: mfa.AdamW(m.parameters(), lr=LR, weight_decay=0.01, **kw)


def torch_adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01)


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_accumulation_and_clipping_against_torch_adamw(clip):
    """Accumulating two micro-batches per step (and clipping to a norm the gradients exceed):
    ours steps when torch's does and ends where it ends, within rounding (a thousandth of one
    step's movement per step: a skipped or doubled step moves weights by about lr)."""
    wa, la, sa, na, _ = run(ours(), clip=clip)
    wb, lb, sb, nb, _ = run(torch_adamw, clip=clip)
    assert sa == sb == len(la) // 2
    assert la == pytest.approx(lb, rel=1e-5)
    assert na == pytest.approx(nb, rel=1e-5)
    if clip is not None:
        assert max(na) > clip  # the clipping did something
    for a, b in zip(wa, wb):
        assert (a - b).abs().max().item() <= sa * 1e-3 * LR


@pytest.mark.parametrize("cls", [mfa.AdamW, mfa.AdamW8bit, mfa.Lion])
def test_step_in_backward_without_accumulation_is_the_plain_step(cls):
    """accumulation 1: each backward is a step, which is what accelerate asks; bit for bit the
    plain run, and clip_grad_norm_(params, inf) through accelerate reports the true norm."""
    make = {mfa.AdamW: lambda **kw: lambda m: mfa.AdamW(m.parameters(), lr=LR, **kw),
            mfa.AdamW8bit: lambda **kw: lambda m: mfa.AdamW8bit(m.parameters(), lr=LR, min_8bit_size=256, **kw),
            mfa.Lion: lambda **kw: lambda m: mfa.Lion(m.parameters(), lr=LR / 10, **kw)}[cls]
    wa, la, sa, na, _ = run(make(), accumulation=1, clip=float("inf"))
    wb, lb, sb, nb, opt = run(make(step_in_backward=True), accumulation=1, clip=float("inf"))
    assert la == lb and sa == sb == len(la)
    assert nb == pytest.approx(na, rel=1e-6) and min(nb) > 0
    assert consumed_grads.grad_norm(opt).item() == pytest.approx(na[-1], rel=1e-6)
    for a, b in zip(wa, wb):
        assert torch.equal(_bits(a), _bits(b))


def test_step_in_backward_refuses_accumulation():
    """accelerate will not step the first micro-batch; the hooks would. Refused from backward."""
    with pytest.raises(RuntimeError, match=r"accelerate's gradient accumulation.*gradient_accumulation_steps=1"):
        run(ours(step_in_backward=True), accumulation=2)


def test_step_in_backward_refuses_clipping():
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(max_norm=1.0.*already stepped and freed"):
        run(ours(step_in_backward=True), accumulation=1, clip=1.0)
