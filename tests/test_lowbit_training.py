"""Evidence that the low-bit options train (issue 12, item 4): a small MLP regresses a fixed
teacher network with fp32 AdamW, AdamW8bit, bf16 + stochastic rounding, bf16 with plain rounding
and 8-bit states + bf16 stochastic rounding, on deterministic seeds.

The literature's ordering (Dettmers et al. 2021; Zamirai et al. 2020): 8-bit states and
stochastic-rounding bf16 land near fp32 AdamW; plain round-to-nearest bf16 stalls once the
updates fall below half a bf16 ulp of the weights (here lr 1e-3 on weights of order 1, whose ulp
is 2^-7 to 2^-8: most updates round away). benchmarks/lowbit.py runs the longer version.
"""
from __future__ import annotations

import pytest
import torch

import mps_fused_adam as mfa

STEPS = 300
LR = 1e-3


def make_task(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 32, generator=gen)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    with torch.no_grad():
        for t in teacher.parameters():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
        y = teacher(x)
    return x, y


def make_student(seed: int = 1) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    student = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    with torch.no_grad():
        for t in student.parameters():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.5 + 0.5)  # weights of order 1
    return student


def train(kind: str, steps: int = STEPS, seed: int = 1) -> list[float]:
    """Loss curve (fp32 evaluation of the current weights) of one configuration."""
    torch.manual_seed(seed)  # the stochastic-rounding seeds come from torch's RNG
    x, y = make_task()
    model = make_student(seed)
    dtype = torch.bfloat16 if kind.startswith("bf16") or kind == "8bit-bf16-sr" else torch.float32
    model = model.to(dtype)
    params = list(model.parameters())
    if kind == "fp32":
        opt = mfa.AdamW(params, lr=LR, weight_decay=0.0)
    elif kind == "8bit":
        opt = mfa.AdamW8bit(params, lr=LR, weight_decay=0.0, min_8bit_size=1024)
    elif kind == "bf16-sr":
        opt = mfa.AdamW(params, lr=LR, weight_decay=0.0, bf16_stochastic_round=True)
    elif kind == "bf16":
        opt = mfa.AdamW(params, lr=LR, weight_decay=0.0)
    elif kind == "8bit-bf16-sr":
        opt = mfa.AdamW8bit(params, lr=LR, weight_decay=0.0, min_8bit_size=1024, bf16_stochastic_round=True)
    else:
        raise ValueError(kind)
    if kind.startswith("8bit"):
        assert "exp_avg_codes" not in opt.state  # states appear at the first step
    losses = []
    xd, yd = x.to(dtype), y.to(dtype)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xd).float(), yd.float())
        loss.backward()
        opt.step()
        with torch.no_grad():
            fp32 = [p.float() for p in params]
            h = torch.tanh(x @ fp32[0].T + fp32[1])
            losses.append(torch.nn.functional.mse_loss(h @ fp32[2].T + fp32[3], y).item())
    if kind.startswith("8bit"):
        big = opt.state[params[0]]
        assert big["exp_avg_codes"].dtype == torch.uint8  # the 4096-element weight really is 8-bit
    return losses


@pytest.fixture(scope="module")
def curves():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {k: train(k) for k in ("fp32", "8bit", "bf16-sr", "bf16", "8bit-bf16-sr")}
    finally:
        torch.set_num_threads(old)


def test_ordering_the_literature_predicts(curves):
    final = {k: sum(v[-10:]) / 10 for k, v in curves.items()}
    start = curves["fp32"][0]
    print("\nfinal loss (mean of the last 10 steps), relative to fp32 AdamW:")
    for k, v in final.items():
        print(f"  {k:13s} {v:.4f}  {v / final['fp32'] - 1:+.1%}")
    assert final["fp32"] < 0.5 * start  # the task is learnt
    # 8-bit states and stochastic-rounding bf16 within 15% of fp32 AdamW's final loss, either side
    # (measured here: 8-bit -12.7%, bf16-sr -3.1%, both -12.9%) ...
    for k in ("8bit", "bf16-sr", "8bit-bf16-sr"):
        assert abs(final[k] / final["fp32"] - 1) <= 0.15, (k, final)
    # ... and plain-rounding bf16 far worse than all of them (measured: 3.3x fp32's loss).
    assert final["bf16"] >= 1.5 * max(final[k] for k in ("fp32", "8bit", "bf16-sr", "8bit-bf16-sr")), final


def test_runs_are_reproducible():
    a = train("bf16-sr", steps=5)
    b = train("bf16-sr", steps=5)
    assert a == b
