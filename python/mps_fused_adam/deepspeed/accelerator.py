"""The MPS accelerator for DeepSpeed: DeepSpeed's own, extended only where it must be.

DeepSpeed 0.19.6 and later carry a complete ``MPS_Accelerator`` (memory statistics from ``torch.mps``,
gloo with CPU staging of MPS tensors in its comm backend, ``pin_memory`` a no-op). Releases 0.14
to 0.19.5 carry a stub (no comm backend, ``None`` memory statistics, fp32 only, ``stream()`` that
returns ``None``, ``pin_memory`` that raises for MPS). :func:`mps_accelerator` subclasses
whichever one is installed and adds:

* always: one device. A Mac has one GPU, and every local rank (``deepspeed --num_gpus 2``,
  torchrun with two processes) gets it: ``device_name(i)`` is ``"mps:0"`` for every ``i``, where
  DeepSpeed's own answers ``"mps:1"`` for local rank 1 (a device that does not exist).
  ``IntTensor`` etc. create tensors on the MPS device (``FusedAdam`` keeps its overflow buffer in
  ``get_accelerator().IntTensor([0])``; DeepSpeed's legacy ``torch.IntTensor`` constructors would
  put it on the CPU).
* always: CPU staging of MPS tensors for gloo that copies back outputs only
  (:mod:`.staging`; DeepSpeed 0.19's own staging copies inputs back too and corrupts ZeRO-3's
  reduce-scatter).
* for a stub: the complete method set of :class:`_CompleteMPS`.

The op builders are redirected by ``install()`` for every accelerator, so they are not repeated
here. Only the decision logic runs on Linux (in the pseudo-MPS tests, with ``torch.mps`` replaced
by stand-ins and the device mapped to the CPU); untested on Apple hardware.
"""
from __future__ import annotations

import contextlib
import platform

import torch

from . import staging
from .staging import install_cpu_staging

__all__ = ["mps_accelerator", "deepspeed_mps_is_complete", "install_cpu_staging", "macos_at_least",
           "set_device_type"]


def set_device_type(device_type: str) -> None:
    """The torch device type the accelerator's tensors live on: ``"mps"`` (always, outside tests).

    The pseudo-MPS test mode sets ``"cpu"``, so that DeepSpeed's real ZeRO code runs through this
    very accelerator on a machine without MPS (tests/support/deepspeed_support/pseudo_mps.py).
    """
    if device_type not in ("mps", "cpu"):
        raise ValueError(f"device_type must be 'mps' or 'cpu', got {device_type!r}")
    staging.DEVICE_TYPE = device_type


def macos_at_least(major: int, minor: int = 0) -> bool:
    """Whether this process runs on macOS ``major.minor`` or newer (False elsewhere)."""
    mps = getattr(torch.backends, "mps", None)
    check = getattr(mps, "is_macos_or_newer", None)
    if check is not None:
        return bool(check(major, minor))
    release = platform.mac_ver()[0]
    if not release:
        return False
    parts = [int(x) for x in release.split(".")[:2]] + [0]
    return (parts[0], parts[1]) >= (major, minor)


def deepspeed_mps_is_complete() -> bool:
    """True when the installed DeepSpeed's MPS support is the complete one (0.19.6 and later):
    its comm backend stages MPS tensors through the CPU for gloo. The stub releases lack it."""
    import importlib
    # importlib, not `import deepspeed.comm.torch as m`: that resolves the name `torch` on
    # deepspeed.comm, which is the torch package itself.
    return hasattr(importlib.import_module("deepspeed.comm.torch"), "stage_on_cpu")


class _DeviceTensorType:
    """``torch.IntTensor``-style constructor that puts the tensor on the MPS device."""

    def __init__(self, dtype: torch.dtype, device: str | None = None) -> None:
        self.dtype = dtype
        self.device = staging.DEVICE_TYPE if device is None else device

    def __call__(self, *args):
        # As torch.IntTensor(...): no argument, an empty tensor; sizes (ints, or one torch.Size),
        # an uninitialised tensor of that shape; one sequence (or tensor), a copy of its data.
        if not args:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        if len(args) == 1 and not isinstance(args[0], (int, torch.Size)):
            return torch.tensor(args[0], dtype=self.dtype, device=self.device)
        return torch.empty(*args, dtype=self.dtype, device=self.device)

    def __repr__(self) -> str:
        return f"<{self.dtype} tensor type on {self.device}>"


def _device_index(device_index) -> int:
    # DeepSpeed passes the local rank (sometimes as the LOCAL_RANK string) or a torch.device.
    if isinstance(device_index, torch.device):
        return device_index.index or 0
    if isinstance(device_index, str) and ":" in device_index:
        device_index = device_index.rsplit(":", 1)[1]
    try:
        index = int(device_index)
    except (TypeError, ValueError):
        raise ValueError(f"MPS accelerator: device index must be an integer (a local rank), "
                         f"got {device_index!r}") from None
    if index < 0:
        raise ValueError(f"MPS accelerator: device index must be >= 0, got {index}")
    return index


class _OneDevice:
    """Every local rank maps to the one MPS device (mixed in first, for every DeepSpeed release).

    Several processes on one Mac share its GPU; each process has its own Metal command queue.
    """

    def device_name(self, device_index=None):
        kind = staging.DEVICE_TYPE
        if device_index is None:
            return kind
        _device_index(device_index)
        return f"{kind}:0" if kind == "mps" else kind

    def device(self, device_index=None):
        return torch.device(self.device_name(0 if device_index is None else device_index))

    def set_device(self, device_index):
        _device_index(device_index)

    def current_device(self):
        return self.device(0)

    def current_device_name(self):
        return self.device_name(0)

    def device_count(self):
        return 1

    def on_accelerator(self, tensor):
        return tensor.device.type == staging.DEVICE_TYPE

    # DeepSpeed restores the device RNG through these for activation checkpointing's recompute
    # (runtime/activation_checkpointing: _set_cuda_rng_state); DeepSpeed's MPS accelerator
    # returns None from both, so the recompute drew other random numbers than the forward pass.
    def lazy_call(self, callback):
        return callback()

    def default_generator(self, device_index=None):
        return _AcceleratorGenerator(self)


class _AcceleratorGenerator:
    """The device's default generator as DeepSpeed uses it (``get_state``/``set_state``), through
    the accelerator's own RNG state functions (``torch.mps.get_rng_state`` on a Mac)."""

    def __init__(self, accel) -> None:
        self._accel = accel

    def get_state(self):
        return self._accel.get_rng_state()

    def set_state(self, state):
        self._accel.set_rng_state(state)
        return self

    def manual_seed(self, seed):
        self._accel.manual_seed(seed)
        return self


class _CompleteMPS:
    """Methods a stub ``MPS_Accelerator`` lacks or gets wrong (mixed in before it, so they win)."""

    # ZeRO enters `with get_accelerator().stream(...)` unguarded; the stub returns None.
    def stream(self, stream):
        return contextlib.nullcontext()

    @property
    def Event(self):
        return torch.mps.Event

    def communication_backend_name(self):
        # MPS has no collective backend; gloo runs on CPU copies (install_cpu_staging).
        return "gloo"

    def is_synchronized_device(self):
        # One in-order command queue, no user-visible streams.
        return True

    def use_host_timers(self):
        return True

    def resolves_data_dependency(self):
        return True

    def handles_memory_backpressure(self):
        return True

    def memory_cached(self, device_index=None):
        return torch.mps.driver_allocated_memory()

    def max_memory_cached(self, device_index=None):
        return torch.mps.driver_allocated_memory()

    def memory_reserved(self, device_index=None):
        return torch.mps.driver_allocated_memory()

    def max_memory_reserved(self, device_index=None):
        return torch.mps.driver_allocated_memory()

    def memory_stats(self, device_index=None):
        # torch.mps has no caching-allocator statistics; report what it has under CUDA's key names.
        return {
            "allocated_bytes.all.current": torch.mps.current_allocated_memory(),
            "reserved_bytes.all.current": torch.mps.driver_allocated_memory(),
        }

    def total_memory(self, device_index=None):
        # Unified memory: Metal's recommended working set is the GPU's usable budget.
        return torch.mps.recommended_max_memory()

    def available_memory(self, device_index=None):
        return self.total_memory() - torch.mps.driver_allocated_memory()

    def is_bf16_supported(self):
        # bfloat arithmetic in Metal needs Metal 3.1, i.e. macOS 14.
        return macos_at_least(14, 0)

    def is_fp16_supported(self):
        return True

    def is_fp64_supported(self):
        return False

    def supported_dtypes(self):
        dtypes = [torch.float, torch.half]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def initial_seed(self, *args):
        return torch.initial_seed()

    def range_push(self, msg, *args, **kwargs):
        return

    def range_pop(self, *args, **kwargs):
        return

    # Unified memory: host tensors are already visible to the GPU; torch's pin_memory() raises
    # for the MPS backend, so pinning is a no-op. The signature takes both DeepSpeed's older
    # (tensor, align_bytes) and 0.19's (tensor, make_copy=True, match_shape=True) keywords.
    def pin_memory(self, tensor, align_bytes=1, *, make_copy=True, match_shape=True):
        return tensor

    def is_pinned(self, tensor):
        return tensor.device.type == "cpu"

    def _torch_pin_memory(self, tensor):
        return tensor

    def _torch_is_pinned(self, tensor):
        return tensor.device.type == "cpu"


_TENSOR_TYPES = {
    "BFloat16Tensor": torch.bfloat16, "ByteTensor": torch.uint8, "DoubleTensor": torch.float64,
    "FloatTensor": torch.float32, "HalfTensor": torch.float16, "IntTensor": torch.int32,
    "LongTensor": torch.int64,
}


def _tensor_type_property(dtype: torch.dtype) -> property:
    return property(lambda self: _DeviceTensorType(dtype), doc=f"Constructor of {dtype} tensors on MPS.")


def mps_accelerator(complete: bool | None = None):
    """A new instance of DeepSpeed's ``MPS_Accelerator`` extended as the module docstring says.

    ``complete`` says whether DeepSpeed's own class is complete; ``None`` detects it. Passing
    ``False`` forces the stub path (the tests use this to exercise it with DeepSpeed 0.19.8).
    """
    from deepspeed.accelerator.mps_accelerator import MPS_Accelerator

    if complete is None:
        complete = deepspeed_mps_is_complete()
    bases = (_OneDevice, MPS_Accelerator) if complete else (_OneDevice, _CompleteMPS, MPS_Accelerator)
    attrs = {name: _tensor_type_property(dtype) for name, dtype in _TENSOR_TYPES.items()}
    attrs["__doc__"] = "DeepSpeed's MPS accelerator with mps_fused_adam's extensions."
    attrs["mps_fused_adam_complete_base"] = complete
    cls = type("MPSFusedAdamAccelerator", bases, attrs)
    accel = cls()
    if not complete:
        # The stub's constructor leaves the comm backend unset; DeepSpeed reads the attribute too.
        accel._communication_backend_name = "gloo"
    install_cpu_staging()  # also for 0.19: its own staging copies inputs back (see .staging)
    return accel
