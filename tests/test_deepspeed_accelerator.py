"""The MPS accelerator shim's logic, with the MPS queries replaced by stand-ins.

No MPS device exists here: ``torch.backends.mps.is_available``, the ``torch.mps`` memory queries
and the macOS version check are monkeypatched, and "MPS tensors" for the CPU-staging wrapper are
CPU tensors marked as such. The real run belongs to the Apple Silicon CI job (untested on Apple
hardware).
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "support" / "deepspeed_support"))
import dsenv  # noqa: E402

GiB = 1 << 30


@pytest.fixture
def fake_mps(monkeypatch):
    """Stand-ins for the MPS queries: 16 GiB recommended, 3 GiB held by the driver, 1 GiB allocated."""
    state = {"macos": (14, 0)}
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer",
                        lambda major, minor: state["macos"] >= (major, minor), raising=False)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 16 * GiB, raising=False)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 3 * GiB, raising=False)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 1 * GiB, raising=False)
    return state


@pytest.fixture
def accel_module(monkeypatch):
    dsenv.require_deepspeed()
    from mps_fused_adam.deepspeed import accelerator
    staged = []
    # mps_accelerator() wraps DeepSpeed's comm backend process-wide; record the call instead.
    monkeypatch.setattr(accelerator, "install_cpu_staging", lambda: staged.append(True) or [])
    accelerator._staging_calls = staged
    return accelerator


def test_complete_deepspeed_is_extended_only_for_tensor_types(accel_module, fake_mps):
    from deepspeed.accelerator.mps_accelerator import MPS_Accelerator
    assert accel_module.deepspeed_mps_is_complete()  # DeepSpeed 0.19.8
    acc = accel_module.mps_accelerator()
    assert isinstance(acc, MPS_Accelerator) and acc.mps_fused_adam_complete_base is True
    # DeepSpeed's own methods are kept where they are complete.
    for name in ("total_memory", "memory_stats", "is_bf16_supported", "communication_backend_name"):
        assert getattr(type(acc), name) is getattr(MPS_Accelerator, name), name
    assert acc.total_memory() == 16 * GiB
    # DeepSpeed's own staging copies inputs back over outputs (issue 13, item 3): ours goes around it.
    assert accel_module._staging_calls == [True]
    # FusedAdam's overflow buffer: get_accelerator().IntTensor([0]) must land on the MPS device.
    int_t = acc.IntTensor
    assert (int_t.dtype, int_t.device) == (torch.int32, "mps")
    assert acc.LongTensor.dtype == torch.int64 and acc.BFloat16Tensor.dtype == torch.bfloat16
    on_cpu = accel_module._DeviceTensorType(torch.int32, "cpu")
    assert torch.equal(on_cpu([0]), torch.tensor([0], dtype=torch.int32))
    assert on_cpu(3).shape == (3,) and on_cpu(3).dtype == torch.int32


def _stub_base():
    """A stand-in for a pre-0.19 DeepSpeed MPS accelerator stub (as in DeepSpeed 0.14)."""
    from deepspeed.accelerator.mps_accelerator import MPS_Accelerator

    class Stub(MPS_Accelerator):
        def __init__(self):
            self._name = "mps"
            self._communication_backend_name = None

        def stream(self, stream):
            return None

        @property
        def Event(self):
            return None

        def memory_reserved(self, device_index=None):
            return None

        def device_name(self, device_index=None):
            return "mps" if device_index is None else f"mps:{device_index}"

        def total_memory(self, device_index=None):
            return None

        def available_memory(self, device_index=None):
            return None

        def memory_stats(self, device_index=None):
            return None

        def is_bf16_supported(self):
            return False

        def is_fp16_supported(self):
            return False

        def supported_dtypes(self):
            return [torch.float]

        def communication_backend_name(self):
            return self._communication_backend_name

        def pin_memory(self, tensor, align_bytes=1):
            return tensor.pin_memory()

    return Stub


@pytest.mark.parametrize("macos,bf16", [((14, 0), True), ((13, 6), False)])
def test_stub_is_completed(accel_module, fake_mps, monkeypatch, macos, bf16):
    import deepspeed.accelerator.mps_accelerator as ds_mps
    monkeypatch.setattr(ds_mps, "MPS_Accelerator", _stub_base())
    fake_mps["macos"] = macos
    acc = accel_module.mps_accelerator(complete=False)
    assert acc.mps_fused_adam_complete_base is False
    assert acc.communication_backend_name() == "gloo" and acc._communication_backend_name == "gloo"
    assert acc.total_memory() == 16 * GiB
    assert acc.available_memory() == 13 * GiB
    assert acc.memory_stats() == {"allocated_bytes.all.current": 1 * GiB, "reserved_bytes.all.current": 3 * GiB}
    assert acc.memory_reserved() == 3 * GiB
    assert acc.is_bf16_supported() is bf16
    assert acc.is_fp16_supported() is True
    assert acc.supported_dtypes() == ([torch.float, torch.half, torch.bfloat16] if bf16 else [torch.float, torch.half])
    t = torch.ones(3)
    assert acc.pin_memory(t) is t and acc.is_pinned(t)
    # DeepSpeed 0.19's callers pass pin_memory(t, make_copy=False); older ones align_bytes.
    assert acc.pin_memory(t, make_copy=False) is t and acc.pin_memory(t, align_bytes=64) is t
    assert acc.IntTensor.device == "mps"
    assert accel_module._staging_calls == [True], "the stub path must stage MPS tensors for gloo"
    # ZeRO enters `with get_accelerator().stream(...)` unguarded (issue 13, item 2).
    with acc.stream(None):
        pass
    assert acc.Event is torch.mps.Event


@pytest.mark.parametrize("complete", [True, False])
def test_every_local_rank_gets_the_one_device(accel_module, fake_mps, monkeypatch, complete):
    """Issue 13, item 5: DeepSpeed asks for device_name(LOCAL_RANK); a Mac has one GPU."""
    if not complete:
        import deepspeed.accelerator.mps_accelerator as ds_mps
        monkeypatch.setattr(ds_mps, "MPS_Accelerator", _stub_base())
    acc = accel_module.mps_accelerator(complete=complete)
    for rank in (0, 1, 3, "1", torch.device("mps", 1)):
        assert acc.device_name(rank) == "mps:0", rank
        assert acc.device(rank) == torch.device("mps", 0)
        acc.set_device(rank)  # accepted, nothing to switch
    assert acc.device_name() == "mps" and acc.current_device_name() == "mps:0"
    assert acc.current_device() == torch.device("mps", 0) and acc.device_count() == 1
    assert acc.on_accelerator(torch.ones(1)) is False  # a CPU tensor
    with pytest.raises(ValueError, match=r"device index must be >= 0, got -1"):
        acc.device_name(-1)
    with pytest.raises(ValueError, match=r"device index must be an integer \(a local rank\), got 'gpu'"):
        acc.set_device("gpu")


def test_macos_at_least_falls_back_to_platform(monkeypatch):
    from mps_fused_adam.deepspeed import accelerator
    monkeypatch.delattr(torch.backends.mps, "is_macos_or_newer", raising=False)
    monkeypatch.setattr(accelerator.platform, "mac_ver", lambda: ("14.2.1", ("", "", ""), "arm64"))
    assert accelerator.macos_at_least(14, 0) and not accelerator.macos_at_least(15, 0)
    monkeypatch.setattr(accelerator.platform, "mac_ver", lambda: ("", ("", "", ""), ""))
    assert not accelerator.macos_at_least(14, 0)  # not macOS at all


class _FakeWork:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True
        return True

    def is_completed(self):
        return self.waited


class _FakeBackend:
    """Collectives that double their tensor arguments in place and record what they were given."""

    seen: list = []

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        _FakeBackend.seen.append(tensor)
        tensor.mul_(2)
        return _FakeWork() if async_op else None

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        _FakeBackend.seen.append(tensor)
        for t in tensor_list:
            t.copy_(tensor)
        return _FakeWork() if async_op else None


def test_cpu_staging_wrapper(monkeypatch):
    """MPS tensors reach gloo as CPU copies and get the results back (after wait() when async)."""
    from mps_fused_adam.deepspeed import staging as accelerator
    monkeypatch.setattr(accelerator, "needs_staging",
                        lambda t: isinstance(t, torch.Tensor) and getattr(t, "on_mps", False))
    monkeypatch.setattr(accelerator, "to_host", lambda t: t.clone())

    class Backend(_FakeBackend):
        pass

    assert sorted(accelerator.install_cpu_staging(Backend)) == ["all_gather", "all_reduce"]
    assert accelerator.install_cpu_staging(Backend) == []  # idempotent
    b = Backend()

    dev = torch.tensor([1.0, 2.0])
    dev.on_mps = True
    assert b.all_reduce(dev) is None
    assert _FakeBackend.seen[-1] is not dev  # the collective saw a host copy
    assert torch.equal(dev, torch.tensor([2.0, 4.0]))  # and the result came back

    # async_op given positionally: results are copied back on wait(), not before.
    dev2 = torch.tensor([5.0])
    dev2.on_mps = True
    work = b.all_reduce(dev2, None, None, True)
    assert torch.equal(dev2, torch.tensor([5.0]))
    assert work.wait() is True and torch.equal(dev2, torch.tensor([10.0]))

    outs = [torch.zeros(1), torch.zeros(1)]
    for o in outs:
        o.on_mps = True
    src = torch.tensor([7.0])
    b.all_gather(outs, src)  # host source, device outputs inside a list
    assert all(torch.equal(o, torch.tensor([7.0])) for o in outs)

    host = torch.tensor([3.0])
    b.all_reduce(host)
    assert _FakeBackend.seen[-1] is host and torch.equal(host, torch.tensor([6.0]))  # no staging for CPU


def test_install_selects_mps_accelerator_when_mps_is_present(tmp_path):
    """install() in a process whose MPS queries say 'available': DeepSpeed gets the extended MPS
    accelerator, with our builders and every other op unavailable. DS_ACCELERATOR=cpu is respected."""
    dsenv.require_deepspeed()
    code = textwrap.dedent("""
        import os, torch
        torch.backends.mps.is_available = lambda: True
        torch.backends.mps.is_macos_or_newer = lambda major, minor: (14, 5) >= (major, minor)
        torch.mps.recommended_max_memory = lambda: 8 << 30
        torch.mps.driver_allocated_memory = lambda: 1 << 30
        torch.mps.current_allocated_memory = lambda: 1 << 29
        import mps_fused_adam.deepspeed as mfd
        from mps_fused_adam.deepspeed.ops import FUSED_ADAM_OP, CPU_ADAM_OP
        report = mfd.install()
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        print("ACCEL", report["accelerator"], type(acc).__name__)
        if report["accelerator"] == "mps":
            assert acc.create_op_builder("FusedAdamBuilder").load() is FUSED_ADAM_OP
            assert acc.create_op_builder("CPUAdamBuilder").load() is CPU_ADAM_OP
            from deepspeed.ops.op_builder.mps import FusedAdamBuilder as Original
            assert issubclass(acc.get_op_builder("FusedAdamBuilder"), Original)
            assert acc.create_op_builder("ShareMemCommBuilder").is_compatible() is False
            assert acc.total_memory() == 8 << 30 and acc.is_bf16_supported()
            assert acc.IntTensor.device == "mps"
            assert mfd.install() == report and get_accelerator() is acc  # idempotent
        print("OK")
    """)
    env = dsenv.no_compiler_env(tmp_path)
    env.pop("DS_ACCELERATOR", None)
    out = dsenv.run_python(["-c", code], env, timeout=300).stdout
    assert "ACCEL mps MPSFusedAdamAccelerator" in out and "OK" in out
    env["DS_ACCELERATOR"] = "cpu"
    out = dsenv.run_python(["-c", code], env, timeout=300).stdout
    assert "ACCEL cpu CPU_Accelerator" in out and "OK" in out


def test_tensor_types_construct_as_torchs(accel_module):
    """get_accelerator().IntTensor(...) answers as torch.IntTensor(...) does, on the device."""
    on_cpu = accel_module._DeviceTensorType(torch.int32, "cpu")
    for args in ((), ([0],), ([1, 2],), (torch.Size([2, 3]),), (2, 3), (4,)):
        ours, torchs = on_cpu(*args), torch.IntTensor(*args)
        assert ours.shape == torchs.shape and ours.dtype == torch.int32, args
        if torchs.numel() and args and not isinstance(args[0], (int, torch.Size)):
            assert torch.equal(ours, torchs), args


@pytest.mark.parametrize("complete", [True, False])
def test_activation_checkpointing_restores_the_rng(accel_module, fake_mps, monkeypatch, complete):
    """DeepSpeed's activation checkpointing restores the device RNG through lazy_call and
    default_generator (_set_cuda_rng_state); DeepSpeed's MPS accelerator returns None from both,
    so the recompute drew other numbers. With torch.mps's RNG mapped onto the CPU's here."""
    import deepspeed.accelerator.mps_accelerator as ds_mps
    from deepspeed.runtime.activation_checkpointing.checkpointing import _set_cuda_rng_state
    if not complete:
        monkeypatch.setattr(ds_mps, "MPS_Accelerator", _stub_base())
    monkeypatch.setattr(torch.mps, "get_rng_state", torch.get_rng_state, raising=False)
    monkeypatch.setattr(torch.mps, "set_rng_state", torch.set_rng_state, raising=False)
    monkeypatch.setattr(torch.mps, "manual_seed", torch.manual_seed, raising=False)
    acc = accel_module.mps_accelerator(complete=complete)
    monkeypatch.setattr("deepspeed.runtime.activation_checkpointing.checkpointing.get_accelerator", lambda: acc)
    saved = acc.get_rng_state().clone()
    first = torch.rand(5)
    _set_cuda_rng_state(saved)
    assert torch.equal(torch.rand(5), first)
    assert acc.lazy_call(lambda: 7) == 7
    assert torch.equal(acc.default_generator(0).get_state(), acc.get_rng_state())
