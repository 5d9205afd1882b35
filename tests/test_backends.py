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


def _each_kernel():
    from mps_fused_adam.backends.mps import KERNELS
    return list(KERNELS)


@pytest.mark.parametrize("make", [backends.CPUBackend, ForeachBackend, TorchFusedBackend],
                         ids=["cpu", "foreach", "torch-fused"])
def test_backends_declare_what_they_run(make):
    """Each backend runs every kernel of the table (every rule, dtype pair, 8-bit; stochastic
    rounding is the sr_keys mode of Adam, which the Metal kernels alone name ``adam_sr``) and
    says why not for anything else; prepare() raises on what it does not run."""
    from mps_fused_adam.backends import Kernel
    backend = make()
    kernels = [k for k in _each_kernel() if k.rule != "adam_sr"]
    assert [k for k in kernels if backend.unavailable(k) is not None] == []
    backend.prepare(kernels)
    f32, bf16 = torch.float32, torch.bfloat16
    assert "no form of rule 'sgd'" in backend.unavailable(Kernel("sgd", f32, f32))
    # The optimizers' stochastic-rounding bucket (rule adam_sr) runs on bf16 params only.
    assert backend.unavailable(Kernel("adam_sr", bf16, f32)) is None
    assert "only bf16 params" in backend.unavailable(Kernel("adam_sr", f32, f32))
    assert "has no adam bfloat16/float16 kernel" in backend.unavailable(Kernel("adam", bf16, torch.float16))
    assert "no kernel for torch.float64 params" in backend.unavailable(Kernel("adam", torch.float64, torch.float64))
    with pytest.raises(RuntimeError, match=r"does not run adam8bit float32/float32"):
        backend.prepare([Kernel("adam", f32, f32), Kernel("adam8bit", f32, f32)])


@pytest.mark.parametrize("make", [backends.CPUBackend, ForeachBackend], ids=["cpu", "foreach"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowbit_rules_through_the_common_update_match_the_references(make, dtype):
    """``update("adam8bit", ...)`` and Adam's ``sr_keys`` mode on the CPU and foreach backends, bit
    for bit the references."""
    from mps_fused_adam.numerics import lowbit
    from mps_fused_adam.numerics.reference_lowbit import reference_adam8bit_, reference_adam_sr_
    gen = torch.Generator().manual_seed(11)
    n = 1000
    p0 = torch.randn(n, generator=gen).to(dtype)
    ours, ref = p0.clone(), p0.clone()
    nb = lowbit.num_blocks(n)
    def zero_states():
        return [torch.full((n,), lowbit.SIGNED_ZERO_CODE, dtype=torch.uint8), torch.zeros(nb),
                torch.full((n,), lowbit.UNSIGNED_ZERO_CODE, dtype=torch.uint8), torch.zeros(nb)]
    so, sr_ = zero_states(), zero_states()
    backend = make()
    for step in (1, 2, 3):
        g = torch.randn(n, generator=gen).to(dtype)
        key = lowbit.sr_key(5, step) if dtype is torch.bfloat16 and step > 1 else None
        hp = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, step)
        backend.update("adam8bit", [ours], [g], [[t] for t in so], hp, sr_keys=None if key is None else [key])
        reference_adam8bit_(ref, g, *sr_, hp, key)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(so, sr_))
    if dtype is torch.bfloat16:
        m, v = torch.zeros(n), torch.zeros(n)
        mr, vr = m.clone(), v.clone()
        for step in (1, 2):
            g = torch.randn(n, generator=gen).to(dtype)
            hp = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, step)
            backend.update("adam", [ours], [g], [[m], [v]], hp, sr_keys=[lowbit.sr_key(9, step)])
            reference_adam_sr_(ref, g, mr, vr, hp, lowbit.sr_key(9, step))
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8)) and torch.equal(v, vr)
