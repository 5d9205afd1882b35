"""The backends other than the C++ kernel: the fp32 foreach tier (bit-exact on CPU) and the
torch-fused tier used for CUDA/XPU tensors, exercised here on CPU tensors (torch has a CPU fused
Adam), and the per-device selection with its one-time explanations."""
from __future__ import annotations

import pytest
import torch

from conftest import DTYPE_PAIRS, choose_backend_afresh, pair_id
from mps_fused_adam import backends
from mps_fused_adam.backends import ForeachBackend, TorchFusedBackend
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference import reference_adam_


def tensors(pair, n=2053):
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(n, generator=gen).to(pair[0]), torch.randn(n, generator=gen).to(pair[0]),
            torch.zeros(n, dtype=pair[1]), torch.zeros(n, dtype=pair[1])]


def contract_error(ours, ref) -> float:
    scale = torch.finfo(ref.dtype).eps * ref.float().abs().max().item()
    return (ours.float() - ref.float()).abs().max().item() / scale


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_foreach_tier_is_bit_exact(pair):
    ours, ref = tensors(pair), tensors(pair)
    for step in (1, 2, 3):
        hp = AdamHyper(1e-2, 0.9, 0.99, 1e-8, 0.1, step, adam_w_mode=step != 2, maximize=step == 3)
        ForeachBackend().update("adam", [ours[0]], [ours[1]], [[ours[2]], [ours[3]]], hp)
        reference_adam_(*ref, hp)
    for a, b in zip(ours, ref):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
@pytest.mark.parametrize("mode", [dict(), dict(adam_w_mode=False), dict(bias_correction=False),
                                  dict(maximize=True)], ids=["adamw", "l2", "nobc", "maximize"])
def test_torch_fused_tier_within_contract(pair, mode):
    ours, ref = tensors(pair), tensors(pair)
    for step in (1, 2, 3, 4):
        hp = AdamHyper(1e-2, 0.9, 0.99, 1e-8, 0.1, step, **mode)
        TorchFusedBackend().update("adam", [ours[0]], [ours[1]], [[ours[2]], [ours[3]]], hp)
        reference_adam_(*ref, hp)
    for a, b in zip(ours, ref):
        assert contract_error(a, b) <= 8, (a.dtype, contract_error(a, b))
    assert not torch.equal(ours[0], tensors(pair)[0])


def test_tier_selection_explains_each_failure_once(monkeypatch):
    def broken():
        raise ImportError("no kernel here")

    monkeypatch.setattr(backends, "_tiers", lambda device_type: [("first", broken), ("second", broken)])
    first, again, messages = choose_backend_afresh(monkeypatch, "cpu")
    assert first is again and first.name == "foreach"
    assert len(messages) == 2 and "first backend unavailable" in messages[0] and "no kernel here" in messages[0]
    info = backends.backend_info()["cpu"]
    assert info["backend"] == "foreach" and len(info["unavailable"]) == 2
