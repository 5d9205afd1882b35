"""On a real MPS device (Apple Silicon): every Metal tier that loads, and the optimizer classes,
against the reference computed on the CPU. Skipped without MPS, except where MFA_REQUIRE_MPS=1
(the release pipeline's Apple Silicon job), which makes a missing device a failure.

Untested on Apple hardware until that job has run: these tests have only been collected and
skipped on Linux."""
from __future__ import annotations

import pytest
import torch

import mps_fused_adam as mfa
from conftest import DTYPE_PAIRS, pair_id, require_mps
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference import reference_adam_


@pytest.fixture(autouse=True)
def _mps():
    require_mps()


def within_contract(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst difference in units of eps(dtype) * max|ref|; the contract allows 8."""
    scale = torch.finfo(ref.dtype).eps * max(ref.float().abs().max().item(), torch.finfo(torch.float32).tiny)
    return (ours.cpu().float() - ref.float()).abs().max().item() / scale


@pytest.mark.parametrize("tier", [0, 1, 2])
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_each_metal_tier_on_device(tier, pair):
    from mps_fused_adam.backends.mps import mps_tiers
    label, make = mps_tiers()[tier]
    try:
        backend = make()
    except Exception as exc:  # a tier may stand aside (older torch); the next one is tested then
        pytest.skip(f"{label} unavailable here: {exc}")
    n = (1 << 20) + 3
    cpu = [torch.randn(n).to(pair[0]), torch.randn(n).to(pair[0]), torch.zeros(n, dtype=pair[1]),
           torch.zeros(n, dtype=pair[1])]
    dev = [t.to("mps") for t in cpu]
    for step in (1, 2, 3):
        hp = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, step, adam_w_mode=step != 2)
        backend.update("adam", [dev[0]], [dev[1]], [[dev[2]], [dev[3]]], hp)
        reference_adam_(*cpu, hp)
    torch.mps.synchronize()
    for a, b in zip(dev, cpu):
        assert within_contract(a, b) <= 8


def test_adamw_on_mps_matches_reference_and_rejects_bad_input():
    p = torch.nn.Parameter(torch.randn(1000, device="mps"))
    ref = [p.detach().cpu(), None, torch.zeros(1000), torch.zeros(1000)]
    opt = mfa.AdamW([p], lr=1e-2)
    for step in (1, 2):
        p.grad = torch.randn(1000, device="mps")
        ref[1] = p.grad.cpu()
        opt.step()
        reference_adam_(*ref, AdamHyper(1e-2, 0.9, 0.999, 1e-8, 1e-2, step))
    assert within_contract(p.detach(), ref[0]) <= 8
    assert mfa.backend_info()["mps"]["backend"] != "foreach", mfa.backend_info()
    before = p.detach().cpu()
    p.grad_dtype = None
    p.grad = torch.randn(1000, device="mps").half()
    with pytest.raises(ValueError, match="grad dtype torch.float16 does not match"):
        opt.step()
    assert torch.equal(p.detach().cpu(), before) and opt.state[p]["step"] == 2
