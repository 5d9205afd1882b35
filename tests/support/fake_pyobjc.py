"""Stand-ins for pyobjc's ``Metal``, ``Foundation`` and ``objc`` modules, backed by the host emulator.

So that the Apple-only driver (tests/support/metal_pyobjc.py) runs on Linux too: the same selectors
(pyobjc spelling), buffers in host memory (``objc.pyobjc_id`` gives their address, as it gives
an ``id<MTLBuffer>`` on a Mac), and an encoder that records ``setBuffer:offset:atIndex:`` and
``setBytes:length:atIndex:`` and runs each ``dispatchThreads:threadsPerThreadgroup:`` through the
emulator when the command buffer is committed, with what was bound at that index then. Only what
the driver calls; Metal's behaviour is not claimed beyond that.
"""
from __future__ import annotations

import ctypes
import types
from collections import namedtuple
from pathlib import Path
from typing import Any

MTLSize = namedtuple("MTLSize", "width height depth")
FAMILIES = {"MTLGPUFamilyApple5": 1005, "MTLGPUFamilyApple6": 1006, "MTLGPUFamilyApple7": 1007,
            "MTLGPUFamilyApple8": 1008, "MTLGPUFamilyApple9": 1009, "MTLGPUFamilyMetal3": 5001}


class _Contents:
    def __init__(self, array) -> None:
        self._array = array

    def as_buffer(self, count: int) -> memoryview:
        return memoryview(self._array).cast("B")[:count]


class FakeBuffer:
    def __init__(self, nbytes: int) -> None:
        self.array = (ctypes.c_ubyte * nbytes)()
        self.address = ctypes.addressof(self.array)

    def contents(self) -> _Contents:
        return _Contents(self.array)


class FakeEncoder:
    def __init__(self, cb: "FakeCommandBuffer") -> None:
        self.cb, self.pso, self.bound, self.ended = cb, None, {}, False

    def setComputePipelineState_(self, pso) -> None:
        self.pso = pso

    def setBuffer_offset_atIndex_(self, buf: FakeBuffer, offset: int, index: int) -> None:
        self.bound[index] = buf.address + offset

    def setBytes_length_atIndex_(self, data: bytes, length: int, index: int) -> None:
        assert len(data) == length, "setBytes: the length is not the data's"
        self.bound[index] = bytes(data)  # copied now, as Metal does

    def dispatchThreads_threadsPerThreadgroup_(self, grid: MTLSize, group: MTLSize) -> None:
        assert not self.ended and self.pso is not None
        name, k = self.pso.name, self.cb.device.emu.buffer_count[self.pso.name]
        bound = dict(self.bound)
        missing = [i for i in range(k + 3) if i not in bound]
        assert not missing, f"{name}: nothing bound at {missing}"
        assert all(isinstance(bound[i], int) for i in range(k)) and all(
            isinstance(bound[i], bytes) for i in range(k, k + 3)), f"{name}: buffers at 0-{k - 1}, bytes at {k}-{k + 2}"
        assert group.width <= self.pso.maxTotalThreadsPerThreadgroup() and (grid.height, grid.depth) == (1, 1)
        base, n = (int.from_bytes(bound[i], "little") for i in (k + 1, k + 2))
        self.cb.work.append(lambda: self.cb.device.emu.dispatch(
            name, tuple(bound[i] for i in range(k)), bound[k], base, n, grid.width, group.width))

    def endEncoding(self) -> None:
        self.ended = True


class FakeCommandBuffer:
    def __init__(self, device: "FakeDevice") -> None:
        self.device, self.work, self._status = device, [], 0

    def computeCommandEncoder(self) -> FakeEncoder:
        return FakeEncoder(self)

    def commit(self) -> None:
        for fn in self.work:
            fn()
        self._status = 4  # MTLCommandBufferStatusCompleted

    def waitUntilCompleted(self) -> None:
        pass

    def status(self) -> int:
        return self._status

    def error(self) -> None:
        return None


class FakeFunction:
    def __init__(self, name: str) -> None:
        self.name = name

    def maxTotalThreadsPerThreadgroup(self) -> int:
        return 1024


class FakeLibrary:
    def __init__(self, names: list[str]) -> None:
        self.names = names

    def functionNames(self) -> list[str]:
        return list(self.names)

    def newFunctionWithName_(self, name: str):
        return FakeFunction(name) if name in self.names else None


class FakeDevice:
    def __init__(self, emu: Any, families: set[int]) -> None:
        self.emu, self.families = emu, families

    def name(self) -> str:
        return "host emulator behind fake pyobjc"

    def registryID(self) -> int:
        return 1

    def hasUnifiedMemory(self) -> bool:
        return True

    def supportsFamily_(self, family: int) -> bool:
        return family in self.families

    def newLibraryWithURL_error_(self, url: str, error: None):
        assert error is None
        return (FakeLibrary(self.emu.kernel_names), None) if Path(url).is_file() else (None, f"no file {url}")

    def newComputePipelineStateWithFunction_error_(self, fn: FakeFunction, error: None):
        return fn, None

    def newCommandQueue(self):
        return types.SimpleNamespace(commandBuffer=lambda: FakeCommandBuffer(self))

    def newBufferWithLength_options_(self, nbytes: int, options: int) -> FakeBuffer:
        assert options == 0, "the harness asks for shared storage"
        return FakeBuffer(nbytes)


def modules(emu: Any, families: tuple[str, ...] = ("MTLGPUFamilyApple5", "MTLGPUFamilyMetal3")) -> dict:
    """``{"Metal": ..., "Foundation": ..., "objc": ...}`` for sys.modules."""
    metal = types.ModuleType("Metal")
    metal.__dict__.update(FAMILIES, MTLSize=MTLSize, MTLResourceStorageModeShared=0,
                          MTLCommandBufferStatusCompleted=4,
                          MTLCreateSystemDefaultDevice=lambda: None,  # as in a process without CoreGraphics
                          MTLCopyAllDevices=lambda: [FakeDevice(emu, {FAMILIES[f] for f in families})])
    foundation = types.ModuleType("Foundation")
    foundation.NSURL = types.SimpleNamespace(fileURLWithPath_=str)
    objc = types.ModuleType("objc")
    objc.pyobjc_id = lambda obj: obj.address
    return {"Metal": metal, "Foundation": foundation, "objc": objc}
