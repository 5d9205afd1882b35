"""The gradient norm a caller gets back after ``step_in_backward=True`` consumed the gradients is
torch's own: ``clip_grad_norm_(params, inf)`` and ``consumed_grads.grad_norm(opt)`` equal, bit for
bit, what ``torch.nn.utils.clip_grad_norm_`` returns for the same gradients when nothing is
stepped in backward, whatever order the hooks fired in and with live gradients among them."""
from __future__ import annotations

import math

import pytest
import torch

import mps_fused_adam as mfa
from mps_fused_adam.optimizers import consumed_grads

SHAPES = [(37, 11), (5,), (64, 3), (1,), (129,), (7, 7, 3), (300,), (2, 2)] * 4  # 32 tensors, varied norms


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _loss(params: list[torch.Tensor]) -> torch.Tensor:
    # Scales spread over decades, so the order of the final reduction changes its rounding.
    return sum((p.float() * (1.7 ** (i % 9) - 0.5)).pow(2).sum() * 10.0 ** (i % 5 - 2) for i, p in enumerate(params))


def _torch_norm(dtype: torch.dtype) -> torch.Tensor:
    params = _params(dtype)
    _loss(params).backward()
    return torch.nn.utils.clip_grad_norm_(params, math.inf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_inf_clip_returns_torchs_norm_bit_for_bit(dtype):
    want = _torch_norm(dtype)
    params = _params(dtype)
    opt = mfa.AdamW(params[::2], lr=1e-3, step_in_backward=True)  # odd ones keep live gradients
    _loss(params).backward()
    assert all(p.grad is None for p in params[::2]) and all(p.grad is not None for p in params[1::2])
    got = torch.nn.utils.clip_grad_norm_(params, math.inf)
    assert got.dtype == want.dtype and torch.equal(got, want), (got.item(), want.item())
    # The optimizer's own record: torch's norm over its params alone.
    ref = _params(dtype)
    _loss(ref).backward()
    assert torch.equal(consumed_grads.grad_norm(opt), torch.nn.utils.clip_grad_norm_(ref[::2], math.inf))


def test_hook_order_would_round_differently():
    """The test above can fail: summing the same per-tensor norms in the hooks' (reverse) order
    gives another fp32 total for this problem."""
    params = _params(torch.float32)
    _loss(params).backward()
    norms = [torch.linalg.vector_norm(p.grad, 2.0) for p in params]
    forward = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    backward = torch.linalg.vector_norm(torch.stack(norms[::-1]), 2.0)
    assert not torch.equal(forward, backward), forward.item()
    assert torch.equal(forward, torch.nn.utils.clip_grad_norm_(params, math.inf))


def test_all_consumed_and_huge_norms():
    """Every gradient consumed, with one norm of every size, up to one whose square overflows fp32
    (torch then returns inf, and so do we)."""
    for scale in (1.0, 1e15, 1e20, 1e30):
        ref = _params(torch.float32)
        (_loss(ref[:4]) + ref[4].sum() * scale).backward()
        want = torch.nn.utils.clip_grad_norm_(ref, math.inf)
        params = _params(torch.float32)
        opt = mfa.AdamW(params[:5], lr=1e-3, step_in_backward=True)
        (_loss(params[:4]) + params[4].sum() * scale).backward()
        got = torch.nn.utils.clip_grad_norm_(params[:5], math.inf)
        assert torch.equal(got, want), (scale, got.item(), want.item())
        assert torch.equal(consumed_grads.grad_norm(opt), want)
