"""On a real MPS device (Apple Silicon): every Metal tier, and the optimizer classes, against the
reference computed on the CPU. Skipped without MPS, except where MFA_REQUIRE_MPS=1 (the release
pipeline's Apple Silicon job), which makes a missing device a failure and strict everything else:
a tier that fails to load or to probe a kernel fails its test with the reason (only the gates of a
torch release that lacks what the tier needs stand a tier aside, and a bfloat pipeline that does
not build is reported as a skip: the raw harness, tests/support/metal_pyobjc.py, fails it where the device
documents bfloat); on torch >= 2.9 with the metallib present tier 1 must be the chosen tier.

Untested on Apple hardware until that job has run: these tests have only been collected and
skipped on Linux."""
from __future__ import annotations

import os
from typing import Optional

import pytest
import torch

import mps_fused_adam as mfa
from conftest import DTYPE_PAIRS, pair_id, require_mps
from mps_fused_adam import backends
from mps_fused_adam.backends import Kernel
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference import reference_adam_


@pytest.fixture(autouse=True)
def _mps():
    require_mps()


def within_contract(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst difference in units of eps(dtype) * max|ref|; the contract allows 8."""
    scale = torch.finfo(ref.dtype).eps * max(ref.float().abs().max().item(), torch.finfo(torch.float32).tiny)
    return (ours.cpu().float() - ref.float()).abs().max().item() / scale


def strict() -> bool:
    return bool(os.environ.get("MFA_REQUIRE_MPS"))


def stands_aside(tier: int) -> Optional[str]:
    """Why tier ``tier`` (0-2) is expected not to load with this torch (its release gate), or None."""
    from mps_fused_adam.backends.mps import TIER1_MIN_TORCH, torch_version
    if tier == 0 and torch_version() < TIER1_MIN_TORCH:
        return f"torch {torch.__version__} is older than tier 1's {TIER1_MIN_TORCH}"
    api = {1: "load_metallib", 2: "compile_shader"}.get(tier)
    if api is not None and not hasattr(torch.mps, api):
        return f"torch {torch.__version__} has no torch.mps.{api}"
    return None


def tier1_required() -> bool:
    """torch >= 2.9 with the bundled metallib: tier 1 must be the chosen tier."""
    from mps_fused_adam.backends.mps import METALLIB_NAME, _package_dir
    return stands_aside(0) is None and (_package_dir() / METALLIB_NAME).is_file()


def not_run(why: str, bfloat_pipeline: bool = False) -> None:
    """Skip, or under MFA_REQUIRE_MPS fail, saying ``why``."""
    if strict() and not bfloat_pipeline:
        pytest.fail(f"{why} (MFA_REQUIRE_MPS is set)")
    pytest.skip(why)


def load_tier(tier: int):
    from mps_fused_adam.backends.mps import mps_tiers
    label, make = mps_tiers()[tier]
    try:
        return make()
    except Exception as exc:
        aside = stands_aside(tier)
        if aside is not None:
            pytest.skip(f"{label} stands aside here ({aside}): {exc}")
        not_run(f"{label} did not load or failed its first-use probe: {exc}")


@pytest.mark.parametrize("tier", [0, 1, 2])
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_each_metal_tier_on_device(tier, pair):
    backend = load_tier(tier)
    kernel = Kernel("adam", *pair)
    try:
        backend.prepare([kernel])  # builds and probes the kernel, as before its first real use
    except Exception as exc:
        why = backend.unavailable(kernel) or repr(exc)
        not_run(f"{backend.name} refuses {kernel}: {why}",
                bfloat_pipeline=pair[0] is torch.bfloat16 and "pipeline was not built" in why)
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
    info = mfa.backend_info()["mps"]
    ran = backends.get_backend("mps").tier_of(Kernel("adam", torch.float32, torch.float32))
    if tier1_required():
        assert ran == "metal", info
    else:
        assert ran == info["backend"] and ran != "foreach", info
    before = p.detach().cpu()
    p.grad_dtype = None
    p.grad = torch.randn(1000, device="mps").half()
    with pytest.raises(ValueError, match="grad dtype torch.float16 does not match"):
        opt.step()
    assert torch.equal(p.detach().cpu(), before) and opt.state[p]["step"] == 2


def test_tier1_is_the_chosen_tier_where_it_can_be():
    """torch >= 2.9 with the bundled metallib: tier 1 must be chosen, and must run every kernel
    but (on a device without bfloat) the bfloat ones; each tier's state is in backend_info()."""
    if not tier1_required():
        not_run(f"tier 1 is not expected here ({stands_aside(0) or 'no bundled metallib'})")
    info = mfa.backend_info()["mps"]
    assert info["backend"] == "metal" and info["unavailable"] == [], info
    from mps_fused_adam.backends.mps import KERNELS
    chain = backends.get_backend("mps")
    chain.prepare(KERNELS)  # every kernel built and probed on this device
    refused = chain.tiers_info()[0]["kernels_unavailable"]
    bad = {k: why for k, why in refused.items() if not ("bfloat16" in k and "pipeline was not built" in why)}
    assert bad == {}, bad
    if refused:
        pytest.skip(f"tier 1 runs every kernel but {len(refused)} bfloat ones, whose pipelines did not build "
                    f"here: {next(iter(refused.values()))}")
