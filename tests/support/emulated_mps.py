"""Stand-ins for the Apple-only pieces, built from the shipped kernel source.

- :func:`build_emulator` compiles ``metal/fused_adam.metal`` as C++ (through ``metal_compat.h``)
  together with ``metal_emulator.cpp`` and loads it with ctypes: :class:`Emulator`.
- :class:`FakeMetalExt` has the call surface of the ``_metal`` extension (src/metal/metal_adam.mm):
  ``load(metallib_path, kernel_names)`` and ``step(kernel_name, tensors, scalars)``, ``tensors``
  being ``[params, grads, state lists...]`` of ``(buffer handle, byte offset, numel)`` triples; on
  CPU tensors the handle is the host address, so it runs the emulator where the real one encodes
  a Metal dispatch. It reaches PyTorch's stream through a :class:`FakeTorchMps` as the ``.mm``
  reaches it through torch::mps: queue taken on the calling thread, ``dispatch_sync``, the same
  queue checked inside the block, then one encoder on that stream's command buffer, no commit.
- :class:`FakeTorchMps` has torch::mps's hooks as the macOS wheels' ``libtorch_cpu.dylib`` shows
  them (tests/test_apple_artifacts.py): before ``HOOKS_CURRENT_STREAM_MIN_TORCH`` (2.15) all three
  take the default stream; from it on the calling thread's current stream (``torch.mps.stream``/
  ``set_stream``), and ``getCommandBuffer``/``commitStream`` abort off that stream's queue
  (``dispatch_assert_queue``).
- :class:`FakeMpsApi` has ``load_metallib`` and ``compile_shader`` returning a :class:`FakeLibrary`
  whose kernels bind positional arguments the way torch's ``_mps_MetalKernel.__call__`` does
  (torch/csrc/mps/Module.cpp: tensor -> buffer at its storage offset, int -> int64, float -> fp32,
  list of ints -> int64 array; keyword ``threads``/``group_size``). ``compile_shader`` compiles the
  text it is handed, so tier 3 runs exactly the source it read.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

TESTS_DIR = Path(__file__).resolve().parent  # tests/support: metal_compat.h and metal_emulator.cpp
REPO = Path(__file__).resolve().parents[2]
METAL_SOURCE = REPO / "metal" / "fused_adam.metal"
CXXFLAGS = ["-std=c++17", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-Wall", "-Wextra"]

_DTYPE_BY_NAME = {"float": torch.float32, "half": torch.float16, "bfloat": torch.bfloat16}


def find_compiler() -> str:
    for cxx in (os.environ.get("CXX"), "g++", "c++"):
        if cxx and shutil.which(cxx):
            return cxx
    raise RuntimeError("no C++ compiler (g++/c++) on PATH: the host emulator tests need one")


def host_names(source: str, metal_version: int = 310) -> list[str]:
    """Kernel host names a Metal compiler of ``metal_version`` exports from ``source``: the source
    is preprocessed first, so instantiations under a false ``#if`` do not count."""
    proc = subprocess.run(
        [find_compiler(), "-E", "-P", "-x", "c++", f"-D__METAL_VERSION__={metal_version}",
         "-DFUSED_ADAM_HOST_EMULATOR", "-"], input=source, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"preprocessing the kernel source failed:\n{proc.stderr}")
    # Adjacent string literals ("fused_" "adam" ...) are one literal (C++ translation phase 6).
    found = re.findall(r'\[\[\s*host_name\(\s*((?:"[A-Za-z0-9_]*"\s*)+)\)\s*\]\]', proc.stdout)
    return ["".join(re.findall(r'"([A-Za-z0-9_]*)"', lit)) for lit in found]


def compile_emulator(source_text: str, out_dir: Path, coverage: bool = False,
                     cxx: list[str] | None = None) -> Path:
    """Compile the emulator around ``source_text`` (a .metal source) into ``out_dir`` with the
    compiler command ``cxx`` (default: :func:`find_compiler`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fused_adam.metal").write_text(source_text, encoding="utf-8")
    cxx = list(cxx) if cxx else [find_compiler()]
    flags = CXXFLAGS + (["-O0", "--coverage", "-DEMU_COVERAGE"] if coverage else ["-O2"])
    inc = [f"-I{out_dir}", f"-I{TESTS_DIR}"]
    obj = out_dir / "metal_emulator.o"
    lib = out_dir / "metal_emulator.so"
    for cmd in ([*cxx, *flags, *inc, "-c", str(TESTS_DIR / "metal_emulator.cpp"), "-o", str(obj)],
                [*cxx, *flags, "-shared", str(obj), "-o", str(lib)]):
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out_dir)
        if proc.returncode != 0:
            raise RuntimeError(f"emulator build failed: {' '.join(cmd)}\n{proc.stderr}")
    return lib


class Emulator:
    def __init__(self, lib_path: Path, source_text: str) -> None:
        self.path = lib_path
        self.source = source_text
        lib = self.lib = ctypes.CDLL(str(lib_path))
        lib.emu_params_size.restype = ctypes.c_uint64
        lib.emu_params_size.argtypes = [ctypes.c_char_p]
        lib.emu_buffer_count.restype = ctypes.c_int
        lib.emu_buffer_count.argtypes = [ctypes.c_char_p]
        lib.emu_kernel_count.restype = ctypes.c_int
        lib.emu_kernel_name.restype = ctypes.c_char_p
        lib.emu_kernel_name.argtypes = [ctypes.c_int]
        u64, vp = ctypes.c_uint64, ctypes.c_void_p
        lib.emu_dispatch.restype = ctypes.c_int
        lib.emu_dispatch.argtypes = [ctypes.c_char_p, ctypes.POINTER(vp), ctypes.c_int, ctypes.c_char_p, u64,
                                     u64, u64, u64, u64, ctypes.c_int]
        for fn in (lib.emu_round_half, lib.emu_round_bfloat):
            fn.argtypes = [vp, vp, u64]
        lib.emu_code_of.argtypes = [vp, vp, vp, u64]
        lib.emu_code4_of.argtypes = [vp, vp, vp, u64]
        self.kernel_names = [lib.emu_kernel_name(k).decode() for k in range(lib.emu_kernel_count())]
        # Per kernel: bytes of its rule's Params struct and its buffer count (param, grad, states).
        self.params_size = {k: int(lib.emu_params_size(k.encode())) for k in self.kernel_names}
        self.buffer_count = {k: int(lib.emu_buffer_count(k.encode())) for k in self.kernel_names}
        self.dispatches: list[dict] = []  # every dispatch, for the tests to inspect

    def dispatch(self, name: str, addrs: tuple[int, ...], hyper: bytes, base: int, n: int,
                 threads: int, group: int, reverse: bool = False) -> None:
        """One dispatch of kernel ``name`` over buffers ``addrs`` (param, grad, states)."""
        self.dispatches.append(dict(name=name, base=base, n=n, threads=threads, group=group,
                                    hyper=bytes(hyper), addrs=tuple(addrs)))
        arr = (ctypes.c_void_p * len(addrs))(*addrs)
        rc = self.lib.emu_dispatch(name.encode(), arr, len(addrs), bytes(hyper), len(hyper), base, n,
                                   threads, group, int(reverse))
        if rc != 0:
            raise RuntimeError(f"emulated dispatch of {name} refused (code {rc})")

    def code_of(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The 8-bit kernel's ``code_of`` (its nearest-code search, no floor) of each fp32 in ``x``."""
        return self._codes(self.lib.emu_code_of, x, table)

    def code4_of(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The 4-bit kernel's nearest-code search (``Nibbles4::code1``) of each fp32 in ``x``."""
        return self._codes(self.lib.emu_code4_of, x, table)

    @staticmethod
    def _codes(fn, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        x, table = x.contiguous(), table.contiguous()
        out = torch.empty(x.numel(), dtype=torch.uint8)
        fn(x.data_ptr(), table.data_ptr(), out.data_ptr(), x.numel())
        return out

    def run_tensors(self, p, g, m, v, hyper: bytes, *, base: int = 0, threads: int | None = None,
                    group: int = 256, reverse: bool = False, n: int | None = None, rule: str = "adam") -> None:
        """One dispatch over CPU tensors (param, grad, the rule's states: ``v`` is None for a
        one-state rule) with the kernel their dtypes select."""
        name = f"fused_{rule}_{_short(p.dtype)}_{_short(m.dtype)}"
        n = p.numel() if n is None else n
        if threads is None:
            threads = -(-(n - base) // 4)
        tensors = (p, g, m) if v is None else (p, g, m, v)
        self.dispatch(name, tuple(t.data_ptr() for t in tensors), hyper, base, n, threads, group, reverse)


def _short(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPE_BY_NAME.items()}[dtype]


_cache: dict[str, Emulator] = {}
_tmp_root: list[Path] = []


def build_emulator(source_text: str | None = None, cxx: list[str] | None = None) -> Emulator:
    """The emulator for ``source_text`` (default: the shipped .metal file), built once per process
    and compiler command ``cxx`` (default: :func:`find_compiler`)."""
    text = METAL_SOURCE.read_text(encoding="utf-8") if source_text is None else source_text
    key = hashlib.sha256("\0".join([text, *(cxx or ())]).encode()).hexdigest()
    if key not in _cache:
        if not _tmp_root:
            _tmp_root.append(Path(tempfile.mkdtemp(prefix="mfa-emulator-")))
            # A loaded shared object may be unlinked on Linux; the mapping stays valid.
            atexit.register(shutil.rmtree, _tmp_root[0], ignore_errors=True)
        lib = compile_emulator(text, _tmp_root[0] / key[:16], cxx=cxx)
        _cache[key] = Emulator(lib, text)
    return _cache[key]


class FakeStream:
    """One MPS stream: its serial queue (a token) and what was encoded on its command buffer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue = f"queue of stream {name}"
        self.encoders: list[list[dict]] = []  # one list of dispatches per compute encoder
        self.commits = 0

    def __repr__(self) -> str:
        return f"FakeStream({self.name!r})"


class DispatchAssertQueueFailed(AssertionError):
    """What torch 2.15's getCommandBuffer/commitStream do off their stream's queue: abort."""


class FakeTorchMps:
    """torch::mps's three hooks and the stream API of torch ``version`` (see the module docstring).

    ``blocks_elsewhere=True`` makes ``dispatch_sync`` run blocks on another thread, which GCD may do
    (its documentation promises the calling thread only "as an optimization"); that thread has no
    current stream of its own, so from 2.15 the hooks see the default stream there.
    """

    def __init__(self, version: tuple[int, int] = (2, 13), blocks_elsewhere: bool = False) -> None:
        from mps_fused_adam.backends.mps import HOOKS_CURRENT_STREAM_MIN_TORCH
        self.version = version
        self.follows_current = version >= HOOKS_CURRENT_STREAM_MIN_TORCH
        self.default = FakeStream("default")
        self._all = [self.default]  # every stream made, for encoded()
        self.blocks_elsewhere = blocks_elsewhere
        self._local = threading.local()  # .current (the thread's stream), .queue (the queue it runs on)

    # torch.mps's Python stream API (2.15: torch.mps.Stream, stream(), set_stream, current_stream)
    def current_stream(self) -> FakeStream:
        return getattr(self._local, "current", None) or self.default

    def set_stream(self, stream: FakeStream) -> None:
        self._local.current = stream

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        before = getattr(self._local, "current", None)
        self._local.current = stream
        try:
            yield stream
        finally:
            self._local.current = before

    # torch::mps hooks
    def _hook_stream(self) -> FakeStream:
        return self.current_stream() if self.follows_current else self.default

    def _assert_queue(self, stream: FakeStream) -> None:
        if self.follows_current and getattr(self._local, "queue", None) != stream.queue:
            raise DispatchAssertQueueFailed(f"dispatch_assert_queue({stream.queue}) failed")

    def get_dispatch_queue(self) -> str:
        return self._hook_stream().queue

    def get_command_buffer(self) -> FakeStream:
        stream = self._hook_stream()
        self._assert_queue(stream)
        return stream

    def commit(self) -> None:
        stream = self._hook_stream()
        self._assert_queue(stream)
        stream.commits += 1

    # libdispatch
    def dispatch_sync(self, queue: str, block) -> None:
        def run() -> None:
            before = getattr(self._local, "queue", None)
            self._local.queue = queue
            try:
                block()
            finally:
                self._local.queue = before
        if not self.blocks_elsewhere:
            run()
            return
        errors: list[BaseException] = []
        worker = threading.Thread(target=lambda: _record(run, errors))
        worker.start()
        worker.join()
        if errors:
            raise errors[0]

    def new_stream(self, name: str) -> FakeStream:
        """A stream of the pool (torch.mps.Stream() in 2.15)."""
        stream = FakeStream(name)
        self._all.append(stream)
        return stream

    def encoded(self) -> list[tuple[str, int]]:
        """(stream name, dispatch count) of every encoder so far, over every stream made."""
        return [(s.name, len(e)) for s in self._all for e in s.encoders]


def _record(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as exc:  # handed to the thread that called dispatch_sync
        errors.append(exc)


class FakeMetalExt:
    """The ``_metal`` extension's Python surface, dispatching through the emulator.

    Mirrors metal_adam.mm: ``load`` builds each named kernel's "pipeline" on its own and returns
    ``{name: error}`` for those that failed: a kernel the emulator lacks, every bfloat kernel of a
    device without bfloat (``bfloat=False``, Metal's error text as a device without it gives it is
    not known here: the message says it is a stand-in), and those of ``failing`` (name -> error
    text); ``step`` checks its
    arguments, takes ``torch_mps``'s dispatch queue on the calling thread, and inside
    ``dispatch_sync`` on it (after checking the queue is still this thread's) opens one encoder on
    the command buffer of the stream the hooks give, runs the named kernel over each parameter,
    split into dispatches of at most ``max_threads`` threads by advancing ``base``, threadgroups of
    256, and commits nothing. It knows no rule: names, tensor lists and bytes.
    """

    def __init__(self, emulator: Emulator, max_threads: int = 1 << 30, torch_mps: FakeTorchMps | None = None,
                 bfloat: bool = True, failing: dict[str, str] | None = None) -> None:
        self.emu = emulator
        self.max_threads = max_threads
        self.torch_mps = torch_mps or FakeTorchMps()
        self.loaded: list[str] = []
        self.calls: list[tuple] = []
        self.bfloat = bfloat
        self.failing = dict(failing or {})
        self.pipelines: set[str] = set()

    def load(self, metallib_path: str, kernel_names: list[str]) -> dict[str, str]:
        if not Path(metallib_path).is_file():
            raise RuntimeError(f"cannot load {metallib_path}")
        failed = {}
        for name in kernel_names:
            if name not in self.emu.kernel_names:
                failed[name] = f"mps_fused_adam._metal: {metallib_path} has no kernel {name}"
            elif name in self.failing:
                failed[name] = f"mps_fused_adam._metal: cannot build the pipeline of {name}: {self.failing[name]}"
            elif not self.bfloat and "_bfloat_" in name:
                failed[name] = (f"mps_fused_adam._metal: cannot build the pipeline of {name}: (stand-in) this "
                                "device does not support bfloat")
            else:
                self.pipelines.add(name)
        self.loaded.append(metallib_path)
        return failed

    def step(self, kernel_name: str, tensors: list, scalars: bytes) -> None:
        self.calls.append((kernel_name, tensors, scalars))
        if not self.loaded or kernel_name not in self.pipelines:
            raise ValueError(f"no kernel {kernel_name} was loaded")
        if len(tensors) != self.emu.buffer_count[kernel_name]:
            raise ValueError(f"{kernel_name} takes {self.emu.buffer_count[kernel_name]} tensor lists, got {len(tensors)}")
        if len(scalars) != self.emu.params_size[kernel_name]:
            raise ValueError(f"scalars are {len(scalars)} bytes, {kernel_name}'s struct is "
                             f"{self.emu.params_size[kernel_name]}")
        if any(len(lst) != len(tensors[0]) for lst in tensors):
            raise ValueError("tensor lists differ in length")
        for refs in zip(*tensors):
            if any(t[2] != refs[0][2] for t in refs):
                raise ValueError("tensor sizes differ within one parameter")
        mps = self.torch_mps
        queue = mps.get_dispatch_queue()
        other_stream = False

        def block() -> None:
            nonlocal other_stream
            if mps.get_dispatch_queue() != queue:
                other_stream = True
                return
            encoder: list[dict] = []
            mps.get_command_buffer().encoders.append(encoder)
            for refs in zip(*tensors):
                n = refs[0][2]
                addrs = tuple(handle + offset for handle, offset, _ in refs)
                step = self.max_threads * 4
                for base in range(0, n, step):
                    threads = -(-min(step, n - base) // 4)
                    self.emu.dispatch(kernel_name, addrs, scalars, base, n, threads, min(256, threads))
                    encoder.append(self.emu.dispatches[-1])

        mps.dispatch_sync(queue, block)
        if other_stream:
            raise RuntimeError("mps_fused_adam._metal: PyTorch's queue ran the step on a thread of another MPS "
                               "stream; nothing was encoded")


class FakeKernel:
    """One kernel of a ShaderLibrary, binding arguments as torch's ``_mps_MetalKernel`` does."""

    max_threads_per_threadgroup = 1024

    def __init__(self, emulator: Emulator, name: str) -> None:
        self.emu = emulator
        self.name = name

    def __call__(self, *args, threads=None, group_size=None, arg_casts=None, error_buf_idx=None):
        if arg_casts is not None or error_buf_idx is not None:
            raise NotImplementedError("the kernels need neither arg_casts nor an error buffer")
        bound: dict[int, object] = {}
        for idx, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                bound[idx] = a.data_ptr()  # storage address + storage offset, as mtl_setBuffer
                if threads is None:
                    threads = a.numel()
            elif isinstance(a, bool):
                raise TypeError("bool argument")
            elif isinstance(a, int):
                bound[idx] = struct.pack("<q", a)
            elif isinstance(a, float):
                bound[idx] = struct.pack("<f", a)
            elif isinstance(a, (list, tuple)) and a and all(isinstance(x, int) for x in a):
                bound[idx] = struct.pack(f"<{len(a)}q", *a)
            elif isinstance(a, (list, tuple)) and a and all(isinstance(x, float) for x in a):
                bound[idx] = struct.pack(f"<{len(a)}f", *a)
            else:
                raise TypeError(f"Unsupported argument type {type(a).__name__}")
        if threads is None:
            raise RuntimeError("Number of threads is undefined or has wrong dimension")
        threads = [threads] if isinstance(threads, int) else list(threads)
        group = None if group_size is None else ([group_size] if isinstance(group_size, int) else list(group_size))
        if group is not None and len(group) != len(threads):
            raise RuntimeError("threads and group_size differ in dimension")
        k = self.emu.buffer_count[self.name]  # param, grad and the rule's states
        if len(threads) != 1 or sorted(bound) != list(range(k + 3)):
            raise RuntimeError(f"{self.name} takes {k + 3} arguments over a 1-D grid")
        if any(not isinstance(bound[i], int) for i in range(k)):
            raise TypeError(f"buffers 0-{k - 1} must be tensors")
        base_b, n_b = bound[k + 1], bound[k + 2]
        if len(base_b) != 8 or len(n_b) != 8:
            raise TypeError("base and n must be 64-bit (Python ints)")
        # torch's dispatch without a group size uses the pipeline's maximum.
        grp = group[0] if group is not None else self.max_threads_per_threadgroup
        self.emu.dispatch(self.name, tuple(bound[i] for i in range(k)), bound[k],
                          struct.unpack("<Q", base_b)[0], struct.unpack("<Q", n_b)[0], threads[0], grp)


class FakeLibrary:
    def __init__(self, emulator: Emulator) -> None:
        self._emu = emulator
        self._names = host_names(emulator.source)

    def __dir__(self):
        return list(self._names)

    def __getattr__(self, name: str) -> FakeKernel:
        if name.startswith("_") or name not in self._names:
            raise AttributeError(f"Failed to create function state object for: {name}")
        return FakeKernel(self._emu, name)


class FakeMpsApi:
    """``torch.mps`` as far as tiers 2 and 3 use it."""

    def __init__(self, emulator: Emulator) -> None:
        self.emu = emulator
        self.compiled_sources: list[str] = []
        self.loaded_paths: list[str] = []

    def load_metallib(self, source) -> FakeLibrary:
        path = Path(source)
        if not path.is_file():
            raise RuntimeError(f"Failed to load library from {path}")
        self.loaded_paths.append(str(path))
        return FakeLibrary(self.emu)

    def compile_shader(self, source: str) -> FakeLibrary:
        self.compiled_sources.append(source)
        return FakeLibrary(build_emulator(source))


def make_backend(tier: int, pkg: Path, emu: Emulator, **kw):
    """Tier ``tier`` (1-3) of mps_backends.mps_tiers, its Apple pieces replaced by the stand-ins."""
    from mps_fused_adam.backends.mps import mps_tiers
    ext = kw.pop("ext", None) or FakeMetalExt(emu)
    tiers = mps_tiers(load_ext=lambda: ext, mps_api=kw.pop("api", None) or FakeMpsApi(emu), package_dir=pkg,
                      probe_device="cpu")
    backend = tiers[tier - 1][1]()
    if kw.pop("probe_all", True):  # every kernel probed now, as prepare would before its first use
        from mps_fused_adam.backends.mps import KERNELS
        backend.prepare([k for k in KERNELS if backend.unavailable(k) is None])
    # The tier's probes ran through the stand-ins: the tests count only their own calls.
    ext.calls.clear()
    emu.dispatches.clear()
    return backend


def make_chain(pkg: Path, emu: Emulator, ext: FakeMetalExt | None = None, api: FakeMpsApi | None = None,
               device_type: str = "mps", **kw):
    """What ``get_backend("mps")`` builds (backends.TierChain over tiers 1-3 and foreach), its
    Apple pieces replaced by the stand-ins; probes run on CPU tensors."""
    from mps_fused_adam import backends
    from mps_fused_adam.backends.chain import TierChain
    from mps_fused_adam.backends.mps import mps_tiers
    ext = ext or FakeMetalExt(emu)
    tiers = mps_tiers(load_ext=lambda: ext, mps_api=api or FakeMpsApi(emu), package_dir=pkg, probe_device="cpu", **kw)
    return TierChain(device_type, [*tiers, ("foreach tier", backends.ForeachBackend)],
                     lambda label, make: backends.load_tier(device_type, label, make))
