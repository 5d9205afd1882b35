"""The MPS accelerator for DeepSpeed: DeepSpeed's own, extended only where it must be.

DeepSpeed 0.19.8 carries a complete ``MPS_Accelerator`` (memory statistics from ``torch.mps``,
gloo with CPU staging of MPS tensors in its comm backend, ``pin_memory`` a no-op). Older releases
carry a stub (no comm backend, ``None`` memory statistics, fp32 only, ``pin_memory`` that raises
for MPS). :func:`mps_accelerator` subclasses whichever one is installed and adds:

* always: ``IntTensor`` etc. that create tensors on the MPS device. ``FusedAdam`` keeps its
  overflow buffer in ``get_accelerator().IntTensor([0])``; DeepSpeed's legacy ``torch.IntTensor``
  constructors would put it on the CPU. (The op builders are redirected by ``install()`` for every
  accelerator, so they are not repeated here.)
* for a stub: the complete method set of :class:`_CompleteMPS`, and CPU staging of MPS tensors
  for gloo collectives (:func:`install_cpu_staging`).

Only the decision logic runs on Linux (with ``torch.mps`` replaced by stand-ins in the tests);
the real run belongs to the Apple Silicon CI job. Untested on Apple hardware.
"""
from __future__ import annotations

import functools
import inspect
import platform

import torch

__all__ = ["mps_accelerator", "deepspeed_mps_is_complete", "install_cpu_staging", "macos_at_least"]


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
    """True when the installed DeepSpeed's MPS support is the complete one (0.19.8 and later):
    its comm backend stages MPS tensors through the CPU for gloo. The stub releases lack it."""
    import importlib
    # importlib, not `import deepspeed.comm.torch as m`: that resolves the name `torch` on
    # deepspeed.comm, which is the torch package itself.
    return hasattr(importlib.import_module("deepspeed.comm.torch"), "stage_on_cpu")


class _DeviceTensorType:
    """``torch.IntTensor``-style constructor that puts the tensor on the MPS device."""

    def __init__(self, dtype: torch.dtype, device: str = "mps") -> None:
        self.dtype = dtype
        self.device = device

    def __call__(self, *args):
        if len(args) == 1 and not isinstance(args[0], int):
            return torch.tensor(args[0], dtype=self.dtype, device=self.device)
        return torch.empty(*args, dtype=self.dtype, device=self.device)

    def __repr__(self) -> str:
        return f"<{self.dtype} tensor type on {self.device}>"


class _CompleteMPS:
    """Methods a stub ``MPS_Accelerator`` lacks or gets wrong (mixed in before it, so they win)."""

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
    # for the MPS backend, so pinning is a no-op.
    def pin_memory(self, tensor, align_bytes=1):
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
    bases = (MPS_Accelerator,) if complete else (_CompleteMPS, MPS_Accelerator)
    attrs = {name: _tensor_type_property(dtype) for name, dtype in _TENSOR_TYPES.items()}
    attrs["__doc__"] = "DeepSpeed's MPS accelerator with mps_fused_adam's extensions."
    attrs["mps_fused_adam_complete_base"] = complete
    cls = type("MPSFusedAdamAccelerator", bases, attrs)
    accel = cls()
    if not complete:
        # The stub's constructor leaves the comm backend unset; DeepSpeed reads the attribute too.
        accel._communication_backend_name = "gloo"
        install_cpu_staging()
    return accel


# Collectives whose tensor arguments are read and/or written: gloo cannot touch MPS memory, so
# each MPS tensor argument is replaced by a CPU copy and copied back after the call completes.
_STAGED_COLLECTIVES = (
    "all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
    "all_gather_into_tensor", "all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single",
    "send", "recv", "isend", "irecv", "gather", "scatter",
)


class _StagedWork:
    def __init__(self, work, copy_back):
        self._work, self._copy_back = work, copy_back

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs) if self._work is not None else None
        self._copy_back()
        return result

    def is_completed(self):
        return self._work is None or self._work.is_completed()


def _needs_staging(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "mps"


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu")


def _staged(func):
    """Wrap a TorchBackend collective: MPS tensors (also inside lists) go through CPU copies."""

    signature = inspect.signature(func)

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        pairs = []

        def stage(arg):
            if _needs_staging(arg):
                cpu = _to_host(arg)
                pairs.append((arg, cpu))
                return cpu
            if isinstance(arg, list) and any(_needs_staging(t) for t in arg):
                return [stage(t) for t in arg]
            return arg

        args = tuple(stage(a) for a in args)
        kwargs = {k: stage(v) for k, v in kwargs.items()}
        work = func(self, *args, **kwargs)
        if not pairs:
            return work

        def copy_back():
            for device_tensor, cpu_tensor in pairs:
                device_tensor.copy_(cpu_tensor)

        # async_op is usually passed positionally, so resolve it against the real signature.
        try:
            async_op = signature.bind(self, *args, **kwargs).arguments.get("async_op", False)
        except TypeError:
            async_op = False
        is_async = func.__name__ in ("isend", "irecv") or bool(async_op)
        if is_async and work is not None:
            return _StagedWork(work, copy_back)
        copy_back()
        return work

    wrapper._mps_fused_adam_staged = True
    return wrapper


def install_cpu_staging(backend_cls=None) -> list[str]:
    """Wrap DeepSpeed's ``TorchBackend`` collectives with CPU staging, once; returns those wrapped.

    Only for DeepSpeed releases whose comm backend lacks its own staging (see
    :func:`deepspeed_mps_is_complete`); with 0.19.8 this is never called by ``install()``.
    ``backend_cls`` defaults to ``deepspeed.comm.torch.TorchBackend``.
    """
    if backend_cls is None:
        from deepspeed.comm.torch import TorchBackend as backend_cls

    wrapped = []
    for name in _STAGED_COLLECTIVES:
        fn = getattr(backend_cls, name, None)
        if fn is None or getattr(fn, "_mps_fused_adam_staged", False):
            continue
        setattr(backend_cls, name, _staged(fn))
        wrapped.append(name)
    return wrapped
