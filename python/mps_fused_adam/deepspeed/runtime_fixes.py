"""Fixes to DeepSpeed's runtime that running ZeRO on the MPS accelerator needs, for every release.

* :func:`rebind_accelerator_methods`: ``deepspeed.runtime.utils`` binds
  ``get_accelerator().memory_reserved`` (and ``max_memory_reserved``) when it is first imported,
  i.e. during ``import deepspeed``, on whatever accelerator DeepSpeed auto-detected. On a Mac with
  DeepSpeed 0.14 to 0.18 that is the stub, whose methods return ``None``, and
  ``see_memory_usage(..., force=True)`` (called by ZeRO 1 to 3 and the bf16 optimizer) then raises
  ``TypeError``. Every module-level binding of a method of a replaced accelerator is rebound to the
  active accelerator's method of the same name.
* :func:`order_host_copies`: on MPS DeepSpeed skips its offload-copy events and stream waits
  (``resolves_data_dependency()`` is True, there are no streams), and gradients go from the device
  to the CPU with ``copy_(..., non_blocking=True)``. A non-blocking copy from MPS to the CPU can
  return before the GPU has written the data, so the CPU could read stale gradients. The ZeRO
  optimizers are wrapped so that the accelerator is synchronised where DeepSpeed waits on CUDA:
  at the end of the gradient reduction (``independent_gradient_partition_epilogue``: CUDA waits on
  its reduction stream and offload-copy events there) and at the start of ``step()`` (before the
  overflow check, the gradient norm and the CPU optimizer read the offloaded gradients).

* :func:`one_device_engine`: DeepSpeed 0.14.4 sets the engine's device to
  ``torch.device(device_name(), local_rank)``, i.e. ``mps:1`` for local rank 1, bypassing the
  accelerator's mapping of every local rank to the one MPS device (later releases ask
  ``device_name(local_rank)``). The engine's device is set from the accelerator afterwards.

This module imports DeepSpeed; it is imported only by ``install()``.
"""
from __future__ import annotations

import functools
import sys
from typing import List

import torch

__all__ = ["rebind_accelerator_methods", "order_host_copies", "one_device_engine"]

# (module, class) pairs of DeepSpeed's ZeRO optimizers, and the methods after/before which the
# device is synchronised.
_ZERO_CLASSES = (
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
)


def rebind_accelerator_methods(accel) -> List[str]:
    """Rebind module-level bound methods of any other accelerator in loaded ``deepspeed`` modules
    to ``accel``'s method of the same name; returns ``module.name`` for each rebinding."""
    from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

    rebound = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == "deepspeed" or mod_name.startswith("deepspeed.")):
            continue
        namespace = getattr(module, "__dict__", None) or {}
        for attr, value in list(namespace.items()):
            owner = getattr(value, "__self__", None)
            if not isinstance(owner, DeepSpeedAccelerator) or owner is accel:
                continue
            replacement = getattr(accel, getattr(value, "__name__", ""), None)
            if replacement is not None:
                namespace[attr] = replacement
                rebound.append(f"{mod_name}.{attr}")
    return rebound


def _is_ours(accel) -> bool:
    return getattr(accel, "mps_fused_adam_complete_base", None) is not None


def _synchronize_after(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        from deepspeed.accelerator import get_accelerator
        accel = get_accelerator()
        if _is_ours(accel):
            accel.synchronize()  # the gradients' device-to-CPU copies have landed
        return result
    wrapper._mps_fused_adam_ordered = True
    return wrapper


def _synchronize_before(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        from deepspeed.accelerator import get_accelerator
        accel = get_accelerator()
        if _is_ours(accel):
            accel.synchronize()
        return method(self, *args, **kwargs)
    wrapper._mps_fused_adam_ordered = True
    return wrapper


def order_host_copies() -> List[str]:
    """Wrap the ZeRO optimizers (once) as the module docstring says; returns what was wrapped.

    The wrappers act only while the active accelerator is this package's MPS accelerator.
    """
    import importlib

    wrapped = []
    for mod_name, cls_name in _ZERO_CLASSES:
        cls = getattr(importlib.import_module(mod_name), cls_name)
        for name, wrap in (("independent_gradient_partition_epilogue", _synchronize_after),
                           ("step", _synchronize_before)):
            method = cls.__dict__.get(name)
            if method is None or getattr(method, "_mps_fused_adam_ordered", False):
                continue
            setattr(cls, name, wrap(method))
            wrapped.append(f"{cls_name}.{name}")
    return wrapped


def one_device_engine() -> List[str]:
    """Wrap ``DeepSpeedEngine._set_distributed_vars`` (once) so that, on this package's MPS
    accelerator, the engine's device is the accelerator's one device for every local rank."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    method = DeepSpeedEngine.__dict__.get("_set_distributed_vars")
    if method is None or getattr(method, "_mps_fused_adam_ordered", False):
        return []

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        from deepspeed.accelerator import get_accelerator
        accel = get_accelerator()
        device = getattr(self, "device", None)
        if _is_ours(accel) and isinstance(device, torch.device) and device.type == accel.device_name():
            self.device = accel.device(device.index or 0)
        return result

    wrapper._mps_fused_adam_ordered = True
    DeepSpeedEngine._set_distributed_vars = wrapper
    return ["DeepSpeedEngine._set_distributed_vars"]
