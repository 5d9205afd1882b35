"""Pseudo-MPS mode: DeepSpeed's real ZeRO code on this package's MPS accelerator, without a Mac.

``activate()`` must run before DeepSpeed is imported. It replaces the MPS queries that torch
answers only on a Mac with stand-ins (``torch.backends.mps.is_available`` says True, so DeepSpeed
auto-detects MPS at import exactly as on a Mac; the ``torch.mps`` memory queries return fixed
numbers; ``torch.mps.synchronize`` and ``torch.mps.Event`` record their calls in :data:`LOG`) and
maps the accelerator's device to the CPU (``accelerator.set_device_type("cpu")``). Everything else
is real: ``mps_fused_adam.deepspeed.install()`` builds the very accelerator object a Mac would get
(DeepSpeed's ``MPS_Accelerator`` of the installed release, stub or complete, extended by
``mps_fused_adam``), and DeepSpeed's engine, ZeRO optimizers, comm layer (gloo, with MPS tensors
staged through CPU copies: in this mode every "device" tensor is staged, with real copies) and
memory reports run through it.

What it cannot show: Metal kernels, the MPS allocator, real asynchrony of MPS copies. Not run on
Apple hardware.
"""
from __future__ import annotations

import os
from typing import List

import torch

#: Ordered record of ordering-relevant calls: "sync" (torch.mps.synchronize), "event-record",
#: "event-sync"; the runner adds "backward" and the kernel calls.
LOG: List[str] = []

GiB = 1 << 30
_active = False


class _Event:
    """Stand-in for torch.mps.Event: records what DeepSpeed asks of it."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        LOG.append("event-record")

    def wait(self, *args, **kwargs):
        LOG.append("event-wait")

    def synchronize(self):
        LOG.append("event-sync")

    def query(self):
        return True


def _synchronize(*args, **kwargs):
    LOG.append("sync")


def activate(macos=(14, 5)) -> None:
    """Enter pseudo-MPS mode (idempotent). Call before importing DeepSpeed."""
    global _active
    if _active:
        return
    mps = torch.backends.mps
    mps.is_available = lambda: True
    mps.is_macos_or_newer = lambda major, minor: tuple(macos) >= (major, minor)
    torch.mps.recommended_max_memory = lambda: 16 * GiB
    torch.mps.driver_allocated_memory = lambda: 3 * GiB
    torch.mps.current_allocated_memory = lambda: 1 * GiB
    torch.mps.set_per_process_memory_fraction = lambda fraction: None
    torch.mps.empty_cache = lambda: None
    torch.mps.synchronize = _synchronize
    torch.mps.Event = _Event
    # torch.mps.manual_seed is a no-op without MPS; the RNG state of the CPU stands in.
    torch.mps.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.mps.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.mps.seed = lambda: torch.initial_seed()
    os.environ.pop("DS_ACCELERATOR", None)  # let DeepSpeed auto-detect "MPS", as on a Mac

    from mps_fused_adam.deepspeed import accelerator
    accelerator.set_device_type("cpu")
    _active = True


def active() -> bool:
    return _active
