"""The contract's registry and host scalars, and how close contract v2 is to torch.optim.AdamW.

Version 1 of the contract (``(m / bc1) / (sqrt(v / bc2) + eps)``, three divisions) is kept here
only as the baseline that version 2 must not fall behind in agreement with torch.
"""
from __future__ import annotations

import math
import struct

import pytest
from mps_fused_adam.numerics.contract import resolve as contract_resolve
import torch

from mps_fused_adam import backends
from mps_fused_adam.numerics.contract import RULES, AdamHyper, adam_scalars, element_rules, rule
from mps_fused_adam.numerics.reference import REFERENCES
from mps_fused_adam.tools.selfcheck import torch_agreement


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def test_every_rule_is_complete():
    """Each rule of the registry with its own element math has a reference and a foreach form; each
    storage form its per-tensor reference (the foreach tier's form of it) and its base rule."""
    for name, r in RULES.items():
        assert r.name == name and r.states
        if name in element_rules():
            assert name in REFERENCES and name in backends.ForeachBackend.RULES
        else:
            assert r.base in element_rules() and r.reference and contract_resolve(r.reference)
            assert RULES[r.sr_rule].base == r.base
    assert rule("adam").states == ("exp_avg", "exp_avg_sq")
    try:
        rule("lion?")
    except KeyError as e:
        assert "known: adam" in str(e)
    else:
        raise AssertionError("unknown rule accepted")


def test_adam_host_scalars_are_double_rounded_once():
    hp = AdamHyper(lr=3e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=10_000)
    s = adam_scalars(hp)
    bc1, bc2 = 1 - 0.9 ** 10_000, 1 - 0.999 ** 10_000
    assert s.step_size == f32(3e-4 / bc1) and s.d2 == f32(1 / math.sqrt(bc2))
    assert s.decay == f32(1 - 3e-4 * 0.1) and s.one_minus_beta2 == f32(1 - 0.999)
    assert (s.adam_w_mode, s.maximize) == (1, 0)
    l2 = adam_scalars(AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.5, 1, adam_w_mode=False, bias_correction=False))
    assert (l2.step_size, l2.d2, l2.decay, l2.adam_w_mode) == (f32(1e-2), 1.0, 1.0, 0)
    assert len(RULES["adam"].pack(hp)) == 44


def test_adam_bias_correction_that_cannot_be_taken_is_named():
    """Step 0 or beta1 = 1 (1 - beta1**step = 0), beta2 = 1 or above: DeepSpeed's ops pass such
    values through (its kernels write NaN); ours say what is wrong before anything is written."""
    for step, b1, b2 in ((0, 0.9, 0.999), (3, 1.0, 0.999), (3, 0.9, 1.0), (3, 0.9, 1.5)):
        with pytest.raises(ValueError, match=rf"bias correction at step {step} with betas \({b1}, {b2}\)"):
            adam_scalars(AdamHyper(1e-3, b1, b2, 1e-8, 0.0, step))
        adam_scalars(AdamHyper(1e-3, b1, b2, 1e-8, 0.0, step, bias_correction=False))  # no correction, no problem


def _l2_without_decay_params():
    p = torch.tensor([float("inf"), -float("inf"), 1.5, -0.0, 3e-39, -2.0])
    g = torch.tensor([0.25, -0.5, 0.125, -0.0, 1e-3, float("inf")])
    return p, g


def test_l2_mode_without_weight_decay_adds_no_term():
    """torch.optim.Adam (and DeepSpeed's CPU Adam) skip the L2 term at weight_decay=0, so an
    infinite param keeps finite moments; the contract does the same on every CPU-side backend."""
    s = adam_scalars(AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, 1, adam_w_mode=False))
    assert (s.adam_w_mode, s.decay) == (1, 1.0)  # the decoupled form with decay 1: p * 1 is p
    assert adam_scalars(AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.5, 1, adam_w_mode=False)).adam_w_mode == 0
    p0, g0 = _l2_without_decay_params()
    tp = p0.clone().requires_grad_()
    topt = torch.optim.Adam([tp], lr=1e-2, weight_decay=0.0, foreach=False)
    for backend in (backends.get_backend("cpu"), backends.ForeachBackend()):
        p, m, v = p0.clone(), torch.zeros(6), torch.zeros(6)
        ref = [p0.clone(), g0.clone(), torch.zeros(6), torch.zeros(6)]
        for step in (1, 2):
            hp = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, step, adam_w_mode=False)
            backend.update("adam", [p], [g0.clone()], [[m], [v]], hp)
            REFERENCES["adam"](ref[0], ref[1], ref[2:], hp)
        assert torch.equal(p.view(torch.int32), ref[0].view(torch.int32)), backend.name
        assert torch.equal(m, ref[2]) and torch.equal(v, ref[3]), backend.name
        assert p[0] == float("inf") and p[1] == -float("inf"), backend.name
        assert torch.isfinite(m[:2]).all() and torch.isfinite(v[:2]).all(), (backend.name, m, v)
    for _ in (1, 2):
        tp.grad = g0.clone()
        topt.step()
    st = topt.state[tp]
    # torch agrees on what is finite, param and moments alike.
    assert torch.equal(torch.isfinite(tp.detach()), torch.isfinite(ref[0]))
    assert torch.equal(torch.isfinite(st["exp_avg"]), torch.isfinite(ref[2]))
    assert torch.equal(torch.isfinite(st["exp_avg_sq"]), torch.isfinite(ref[3]))


def _contract_v1_adamw_(p, g, m, v, hp):
    """Contract version 1 (before 2026-11), for comparison only: bias corrections divided per
    element, weight decay added to the update."""
    one = lambda x: torch.full_like(p, f32(x))  # noqa: E731
    bc1, bc2 = 1 - hp.beta1 ** hp.step, 1 - hp.beta2 ** hp.step
    m.copy_(one(hp.beta1) * m + one(1 - hp.beta1) * g)
    v.copy_(one(hp.beta2) * v + one(1 - hp.beta2) * g * g)
    denom = torch.sqrt((v / one(bc2)).double()).float() + one(hp.eps)
    update = (m / one(bc1)) / denom + one(hp.weight_decay) * p
    p.copy_(p - one(hp.lr) * update)


def test_agreement_with_torch_adamw_got_no_worse(capsys):
    v1 = torch_agreement(_contract_v1_adamw_, n=20_000)
    v2 = torch_agreement(n=20_000)
    with capsys.disabled():
        print(f"\nagreement with torch.optim.AdamW after 100 fp32 steps, 20K params: v1 {v1}\n  v2 {v2}")
    assert v2["mean_ulps"] <= v1["mean_ulps"] and v2["identical"] >= v1["identical"]
    assert v2["max_in_eps"] <= v1["max_in_eps"]
    assert v2["max_in_eps"] < 8  # the contract's bound for implementations that order math differently
