"""The Apple-only half of the raw-Metal harness: a real Metal device through pyobjc, no torch MPS.

:class:`MetalDevice` is ``metal_harness.Device`` on ``MTLCreateSystemDefaultDevice()``: the
wheel's ``fused_adam.metallib``, one pipeline per kernel, shared-storage buffers, one command
buffer per step, waited on. ``python tests/support/metal_pyobjc.py --mm METALLIB`` runs the ``.mm``
(``_metal.load`` / ``_metal.step``) on buffers made here, on torch's MPS stream, and prints JSON
lines (tests/test_metal_harness.py runs it in a child process, so that an abort inside torch is
reported, not lost). Every selector, function and constant used here is checked against
pyobjc-framework-Metal's metadata (test_pyobjc_calls_match_metadata). Untested on Apple hardware.
"""
from __future__ import annotations

import json
import platform
import struct
import sys

# pyobjc exists only on macOS: pytest never collects this file (not test_*.py), and
# tests/test_metal_harness.py imports it, or runs it, only after checking for macOS and pyobjc
# (on Linux through tests/support/fake_pyobjc.py's stand-in modules).
import Foundation
import Metal
import objc
import torch

from metal_harness import Buffer, ExtSubmit, KernelUnavailable, failures, report_text, run_all

FAMILIES = {"Apple5": Metal.MTLGPUFamilyApple5, "Apple6": Metal.MTLGPUFamilyApple6,
            "Apple7": Metal.MTLGPUFamilyApple7, "Apple8": Metal.MTLGPUFamilyApple8,
            "Apple9": Metal.MTLGPUFamilyApple9, "Metal3": Metal.MTLGPUFamilyMetal3}


def macos() -> tuple[int, int]:
    """(major, minor) of macOS; (0, 0) elsewhere."""
    parts = [int(x) for x in platform.mac_ver()[0].split(".") if x.isdigit()] + [0, 0]
    return parts[0], parts[1]


class MetalDevice:
    def __init__(self, metallib: str) -> None:
        # The default device can be nil in a process that does not link CoreGraphics (torch
        # itself picks from MTLCopyAllDevices): then the first of all devices.
        dev, how = Metal.MTLCreateSystemDefaultDevice(), "MTLCreateSystemDefaultDevice()"
        if dev is None:
            dev, how = next(iter(Metal.MTLCopyAllDevices() or []), None), "MTLCopyAllDevices()[0]"
        if dev is None:
            raise RuntimeError("no Metal device: MTLCreateSystemDefaultDevice() and MTLCopyAllDevices() found none")
        self.dev, self.name, self.how = dev, str(dev.name()), how
        self.families = {k: bool(dev.supportsFamily_(v)) for k, v in FAMILIES.items()}
        lib, err = dev.newLibraryWithURL_error_(Foundation.NSURL.fileURLWithPath_(metallib), None)
        if lib is None:
            raise RuntimeError(f"cannot load {metallib}: {err}")
        self.lib, self.queue, self.pipelines = lib, dev.newCommandQueue(), {}

    def bfloat_documented(self) -> bool:
        """Whether bfloat is documented for this device: Metal 3.1 (macOS 14) on a Metal 3 GPU."""
        return macos() >= (14, 0) and self.families["Metal3"]

    def describe(self) -> list[str]:
        fams = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in self.families.items())
        return [f"device: {self.name} (from {self.how}, registryID {self.dev.registryID()}, unified memory "
                f"{bool(self.dev.hasUnifiedMemory())}), macOS {platform.mac_ver()[0]}, {platform.machine()}",
                f"GPU families: {fams}; bfloat (Metal 3.1 on a Metal 3 GPU): "
                f"{'documented' if self.bfloat_documented() else 'not documented'}"]

    def kernel_names(self) -> set[str]:
        return {str(n) for n in self.lib.functionNames()}

    def prepare(self, kernel: str) -> None:
        if kernel in self.pipelines:
            return
        fn = self.lib.newFunctionWithName_(kernel)
        pso, err = (None, "no such function") if fn is None else \
            self.dev.newComputePipelineStateWithFunction_error_(fn, None)
        if pso is None:
            raise KernelUnavailable(f"no pipeline for {kernel}: {err}", "bfloat" in kernel and not self.bfloat_documented())
        self.pipelines[kernel] = pso

    def new_buffer(self, nbytes: int) -> Buffer:
        buf = self.dev.newBufferWithLength_options_(nbytes, Metal.MTLResourceStorageModeShared)
        if buf is None:
            raise MemoryError(f"newBufferWithLength:{nbytes} returned nil")
        return Buffer(objc.pyobjc_id(buf), torch.frombuffer(buf.contents().as_buffer(nbytes), dtype=torch.uint8), buf)

    def run(self, kernel: str, dispatches) -> None:
        pso = self.pipelines[kernel]
        cb = self.queue.commandBuffer()
        enc = cb.computeCommandEncoder()
        enc.setComputePipelineState_(pso)
        for d in dispatches:
            k = len(d.bindings)
            for i, (buf, off) in enumerate(d.bindings):
                enc.setBuffer_offset_atIndex_(buf.keep, off, i)
            for i, blob in ((k, d.scalars), (k + 1, struct.pack("<Q", d.base)), (k + 2, struct.pack("<Q", d.n))):
                enc.setBytes_length_atIndex_(blob, len(blob), i)
            group = min(d.group, pso.maxTotalThreadsPerThreadgroup())
            enc.dispatchThreads_threadsPerThreadgroup_(Metal.MTLSize(d.threads, 1, 1), Metal.MTLSize(group, 1, 1))
        enc.endEncoding()
        cb.commit()
        cb.waitUntilCompleted()
        if cb.status() != Metal.MTLCommandBufferStatusCompleted:
            raise AssertionError(f"{kernel}: command buffer status {cb.status()}: {cb.error()}")


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def mm_main(metallib: str, selected=None) -> None:
    """The ``.mm`` on this device: a stream probe first (``stream``: "ok" or what failed), then
    the harness (``selected`` cases, default all) through ``_metal.step`` (``report``, ``failures``)."""
    if not torch.backends.mps.is_available():
        return say(stream="torch.backends.mps.is_available() is False")
    try:
        torch.mps.synchronize()  # creates torch's default MPS stream and waits on it; allocates nothing
    except Exception as exc:  # noqa: BLE001 - reported verbatim
        return say(stream=f"torch.mps.synchronize() raised {type(exc).__name__}: {exc}")
    say(stream="ok")
    from mps_fused_adam import _metal
    from mps_fused_adam.backends.mps import KERNELS
    device = MetalDevice(metallib)
    _metal.load(metallib, sorted(KERNELS.values()))
    reports = run_all(device, ExtSubmit(_metal, torch.mps.synchronize), selected)
    say(report=report_text(device, reports), failures=failures(reports))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--mm"] or len(sys.argv) != 3:
        sys.exit("usage: python tests/support/metal_pyobjc.py --mm METALLIB")
    mm_main(sys.argv[2])
