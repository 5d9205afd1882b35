"""Backends for MPS tensors: tiers 1 to 3 of docs/metal.md, all running metal/fused_adam.metal.

1. ``_metal`` (Objective-C++ extension): one compute encoder per group on PyTorch's command buffer.
2. ``torch.mps.load_metallib`` on the bundled ``fused_adam.metallib``: the same kernels, one
   Python-level dispatch per tensor (and per 2^32-element chunk).
3. ``torch.mps.compile_shader`` on the bundled ``metal/fused_adam.metal`` source.
(4, the foreach tier, is ``backends.ForeachBackend``; ``backends`` falls back to it.)

Each tier runs kernel by kernel (:class:`_PerKernel`): a kernel whose pipeline does not build, or
that fails its probe (:func:`probe_kernel`, run by ``prepare`` before its first real dispatch), is
unavailable at that tier with the reason; ``backends.chain.TierChain`` sends its tensors to the
next tier and keeps the rest where they are.

The device-specific pieces are parameters of :func:`mps_tiers` so the tests can drive this exact
code on CPU tensors through stand-ins built from the same kernel source (tests/support/emulated_mps.py):
``load_ext`` (imports ``_metal``), ``mps_api`` (the object with ``load_metallib`` and
``compile_shader``, normally ``torch.mps``) and ``package_dir`` (where the bundled files are).

Kernel interface (see the header comment of metal/fused_adam.metal): kernel ``fused_<rule>_<P>_<S>``;
buffers 0 and 1 are param and grad, 2 .. 1+K the rule's K states, then the rule's scalar struct
(``contract.Rule.pack``), ``base`` and ``n`` (64-bit); each thread handles 4 elements from
``base + 4 * thread``. A dispatch covers at most ``MAX_THREADS_PER_DISPATCH`` threads. Nothing
here or in ``_metal`` is specific to a rule: they take kernel names, tensor lists and bytes.
"""
from __future__ import annotations

import os
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from .addressing import addresses, numels
from .kernel import Kernel, describe
from ..numerics.contract import RULES, AdamHyper, resolve, rule as rule_spec

ELEMS_PER_THREAD = 4
# 2^30 threads cover 2^32 elements: thread_position_in_grid is a 32-bit uint, and keeping each
# dispatch's threads * 4 below 2^32 keeps every 32-bit quantity in range on the device.
MAX_THREADS_PER_DISPATCH = 1 << 30
THREADGROUP_SIZE = 256

# torch::mps::get_command_buffer() must close PyTorch's open compute encoder, or the encoder _metal
# opens aborts the process ("A command encoder is already encoding to this command buffer").
# Evidence, the macOS arm64 wheels' libtorch_cpu.dylib (llvm-objdump -d): at::mps::MPSHooks::
# getCommandBuffer calls MPSStream::endKernelCoalescing before MPSStream::commandBuffer in 2.9.0
# (and 2.13.0), not in 2.8.0. tests/test_apple_artifacts.py re-checks this against the wheels.
TIER1_MIN_TORCH = (2, 9)

# The MPS stream torch::mps::get_command_buffer(), get_dispatch_queue() and commit() use, and so
# the stream tier 1 encodes on: from this release on the calling thread's current stream
# (at::mps::getCurrentMPSStream: torch.mps.stream()/set_stream, else the default stream), before it
# always the default stream (at::mps::getDefaultMPSStream). Read from the macOS arm64 wheels'
# libtorch_cpu.dylib (MPSHooks::getCommandBuffer, getDispatchQueue, commitStream; 2.14.1: default,
# 2.15.0: current); tests/test_apple_artifacts.py re-checks every release from TIER1_MIN_TORCH on.
HOOKS_CURRENT_STREAM_MIN_TORCH = (2, 15)

METALLIB_NAME = "fused_adam.metallib"
METAL_SOURCE_NAME = "fused_adam.metal"

# Storage dtype names as the kernels' host names spell them.
_DTYPE_NAMES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat", torch.uint8: "uchar"}
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The rules the Metal kernels run: every rule of contract.RULES (the name is kept for the tests).
METAL_RULES = RULES


def _dtypes(names: Optional[tuple[str, ...]], default: tuple[torch.dtype, ...]) -> tuple[torch.dtype, ...]:
    return default if names is None else tuple(getattr(torch, n) for n in names)


# (rule, param dtype, state dtype) -> kernel host name ``fused_<rule>_<P>_<S>``, for the dtypes
# each rule's entry names (by default fp32, fp16, bf16 params with fp32 or same-dtype states;
# adam_sr: bf16 params; 8-bit Adam: uint8 codes).
KERNELS = {
    Kernel(r, p, s): f"fused_{r}_{_DTYPE_NAMES[p]}_{_DTYPE_NAMES[s]}"
    for r, spec in RULES.items() for p in _dtypes(spec.param_dtypes, PARAM_DTYPES)
    for s in _dtypes(spec.state_dtypes, (torch.float32, p))
}
_BY_NAME = {name: k for k, name in KERNELS.items()}
# The kernel every tier must run to be used at all: its first-use probe is this kernel's.
BASE_KERNEL = Kernel("adam", torch.float32, torch.float32)


# torch compiles tier 3's source with fast math when this is set to a non-zero value (torch 2.13:
# setFastMathEnabled: on macOS 14; math mode fast and fast FP32 functions on macOS 15 and newer).
FAST_MATH_ENV = "PYTORCH_MPS_FAST_MATH"


def fast_math_note(backend_name: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """What ``PYTORCH_MPS_FAST_MATH`` changes for the MPS backend ``backend_name`` (for ``backend_info``).

    Tiers 1 and 2 run the prebuilt metallib (compiled with -fno-fast-math -ffp-contract=off), so
    the variable cannot reach them. Tier 3 is compiled by torch with its options: sqrt and division
    stay correctly rounded there (``metal::precise::`` forms) and the source switches contraction
    off, but fast math may still change NaN/Inf handling and fp32 subnormals. None for backends that
    are not ours (foreach: torch's own ops)."""
    if backend_name in ("metal", "load_metallib"):
        return "not applicable: prebuilt metallib, compiled with -fno-fast-math -ffp-contract=off"
    if backend_name != "compile_shader":
        return None
    value = environ.get(FAST_MATH_ENV, "").strip()
    if value in ("", "0"):
        return f"off ({FAST_MATH_ENV} unset): the source's IEEE math as compiled by torch"
    return (f"on ({FAST_MATH_ENV}={value}): sqrt and division stay correctly rounded "
            "(metal::precise::), but NaN/Inf handling and fp32 subnormals may differ from the "
            "contract; on macOS 14 (Metal 3.1) whether contraction stays off is not established "
            "(untested on Apple hardware). Unset it for the contract's results.")


def kernel_calls(rule: str, params, grads, states, hp, sr_keys=None):
    """The Metal kernel calls ``(rule, params, grads, states, hyper)`` of one backend call: itself
    (a call in the kernels' own form included: ``AdamSRHyper``/``Adam8bitTensorHyper``), or, for
    a storage form in the optimizers' form (``backends``' docstring) and for Adam's ``sr_keys``
    mode (its ``sr_rule``), one call per tensor (the key is per tensor) with ``Rule.hyper(hp,
    key)``, a block-quantized rule's states in its Metal buffer order (``Rule.states``: the
    states by name, then its tables)."""
    if hasattr(hp, "adam"):
        yield rule, params, grads, states, hp
        return
    if sr_keys is not None:
        rule = rule_spec(rule).sr_rule or rule
    spec = rule_spec(rule)
    if spec.base is None:
        yield rule, params, grads, states, hp
        return
    blocks, tables = spec.blocks, []
    order = range(len(states)) if blocks is None else [blocks.names.index(n) for n in spec.states[:len(blocks.names)]]
    for i, (p, g, *st) in enumerate(zip(params, grads, *states)):
        if blocks is not None and (not tables or tables[0].device != p.device):
            tables = list(resolve(blocks.tables)(p.device))
        yield (rule, [p], [g], [[st[k]] for k in order] + [[t] for t in tables],
               spec.hyper(hp, None if sr_keys is None else sr_keys[i]))


def kernel_name(rule: str, param_dtype: torch.dtype, state_dtype: torch.dtype) -> str:
    return KERNELS[(rule, param_dtype, state_dtype)]


def pack_params(hp: AdamHyper, rule: str = "adam") -> bytes:
    """The rule's scalar struct as the kernels read it (Adam: 44 bytes, little-endian as on every
    Apple GPU)."""
    return rule_spec(rule).pack(hp)  # a KeyError naming the known rules


def params_as_words(packed: bytes) -> list[int]:
    """``packed`` as the int64 list torch's ShaderLibrary call turns into the same bytes.

    torch binds a list of Python ints as an array of int64 with setBytes, so little-endian words
    reproduce the struct (plus padding to 8 bytes the kernel never reads), exactly, with no float
    round trip and no dependence on the ``arg_casts`` option.
    """
    padded = packed + b"\0" * (-len(packed) % 8)
    return list(struct.unpack(f"<{len(padded) // 8}q", padded))


def dispatch_plan(numel: int, max_threads: int = MAX_THREADS_PER_DISPATCH) -> list[tuple[int, int]]:
    """``(base, threads)`` of each dispatch that covers a tensor of ``numel`` elements."""
    plan = []
    step = max_threads * ELEMS_PER_THREAD
    for base in range(0, numel, step):
        count = min(step, numel - base)
        plan.append((base, -(-count // ELEMS_PER_THREAD)))
    return plan


def mps_buffer(t: torch.Tensor) -> tuple[int, int, int]:
    """``(MTLBuffer handle, byte offset, numel)``: for an MPS tensor the storage's data pointer is
    its ``id<MTLBuffer>`` (PyTorch's MPS allocator stores it there); on a CPU tensor the same
    expression gives the host address, which is what the emulated ``_metal`` of the tests uses."""
    return (t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(), t.numel())


def mps_buffers(tensors: Sequence[torch.Tensor], numels: Sequence[int]) -> list[tuple[int, int, int]]:
    """:func:`mps_buffer` of each tensor of one dtype, with one attribute read per tensor where it
    can: c10 computes ``data_ptr()`` as the storage's data pointer plus ``storage_offset() *
    itemsize`` on every device (``TensorImpl::data_impl``, torch/include/c10/core/TensorImpl.h), so
    the handle is the address minus the byte offset. The addresses come from the optimizer's step
    plan when it has read them this step (``backends.addresses``); an empty tensor, whose
    ``data_ptr()`` is null, takes the long way."""
    if not tensors:
        return []
    size = tensors[0].element_size()
    return [(a - o * size, o * size, n) if n else mps_buffer(t)
            for t, a, o, n in zip(tensors, addresses(tensors), map(torch.Tensor.storage_offset, tensors), numels)]


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _package_dir() -> Path:
    return Path(__file__).resolve().parent.parent


def find_metal_source(package_dir: Path) -> Path:
    """The bundled ``.metal`` source: in the installed package, else in a source checkout."""
    candidates = [package_dir / "metal" / METAL_SOURCE_NAME,
                  package_dir.parent.parent / "metal" / METAL_SOURCE_NAME]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"no {METAL_SOURCE_NAME} in {' or '.join(str(c.parent) for c in candidates)}")


def missing_metallib(path: Path) -> FileNotFoundError:
    """The error tiers 1 and 2 raise without the bundled metallib, saying the usual cause: a
    source build on a Mac whose Metal compiler does not run (cmake/apple_metal.cmake warns and
    builds without it), after which tier 3 compiles the bundled source instead."""
    return FileNotFoundError(
        f"bundled metallib missing: {path} (a source build without the Metal toolchain has none: "
        "its build warned; tier 3 compiles the bundled .metal source instead. For the prebuilt "
        "kernels install Xcode's Metal toolchain, e.g. xcodebuild -downloadComponent MetalToolchain, "
        "and reinstall)")


def _forms(kernel: Kernel) -> tuple[Kernel, ...]:
    """The Metal kernels that one backend kernel may run: a rule on bf16 params also runs as its
    ``sr_rule`` (Adam as ``adam_sr``: its ``sr_keys`` mode, :func:`kernel_calls`), so a tier takes
    such a bucket only when it runs both."""
    spec = RULES.get(kernel.rule)
    sr = spec.sr_rule if spec is not None else None
    if sr is not None and sr != kernel.rule and kernel.param_dtype is torch.bfloat16:
        return kernel, Kernel(sr, kernel.param_dtype, kernel.state_dtype)
    return (kernel,)


class _PerKernel:
    """What tiers 1 to 3 share: each kernel is available on its own. One whose pipeline did not
    build, or whose probe (:func:`probe_kernel`, run by :meth:`prepare` before the kernel's first
    real dispatch) failed, is refused with the reason; the others run."""

    name: str
    probe_device: str | torch.device = "mps"

    def _init_kernels(self, refused: Mapping[Kernel, str], probe_device: str | torch.device) -> None:
        self._refused: dict[Kernel, str] = dict(refused)
        self._probed: set[Kernel] = set()
        self.probe_device = probe_device

    def unavailable(self, kernel: Kernel) -> Optional[str]:
        kernel = Kernel(*kernel)
        for form in _forms(kernel):
            if form not in KERNELS:
                return f"the Metal kernels have no {describe(form)} form"
            why = self._refused.get(form)
            if why is not None:
                return why if form == kernel else f"its stochastic-rounding kernel ({describe(form)}) {why}"
        return None

    def _build(self, kernel: Kernel) -> Optional[str]:
        """Why ``kernel``'s pipeline cannot be had on this tier, or None (built)."""
        return None

    def prepare(self, kernels: Iterable[Kernel]) -> None:
        """Builds and probes each kernel (and its other forms: :func:`_forms`) not yet probed, every
        one of them (a failure refuses that kernel only); then raises, naming each, if any of
        ``kernels`` is unavailable here."""
        refused = []
        for kernel in dict.fromkeys(Kernel(*k) for k in kernels):
            for form in _forms(kernel):
                if form in KERNELS and form not in self._refused and form not in self._probed:
                    why = self._build(form) or probe_kernel(self, form, self.probe_device)
                    if why is None:
                        self._probed.add(form)
                    else:
                        self._refused[form] = why
            why = self.unavailable(kernel)
            if why is not None:
                refused.append(f"{describe(kernel)}: {why}")
        if refused:
            raise RuntimeError(f"{self.name} does not run " + "; ".join(refused))

    def kernels_unavailable(self) -> dict[str, str]:
        """Kernel (``describe``) -> why, for each kernel this tier refuses so far."""
        return {describe(k): why for k, why in self._refused.items()}


class MetalExtBackend(_PerKernel):
    """Tier 1: the ``_metal`` extension; one call per group, one encoder, no host sync."""

    name = "metal"

    def __init__(self, ext: Any, metallib: Path, buffer_of: Callable = mps_buffer,
                 probe_device: str | torch.device = "mps") -> None:
        if not metallib.is_file():
            raise missing_metallib(metallib)
        # Raises with Metal's own error text if the library is unusable, or if the loaded
        # libtorch lacks the torch::mps functions; a pipeline that fails to build is returned
        # with Metal's error and costs only its kernel.
        failed = ext.load(str(metallib), sorted(KERNELS.values())) or {}
        self._init_kernels({_BY_NAME[name]: f"its pipeline was not built: {why}" for name, why in failed.items()
                            if name in _BY_NAME}, probe_device)
        self._ext = ext
        self._buffer_of = buffer_of

    def update(self, rule: str, params, grads, states, hp, sr_keys=None) -> None:
        for call in kernel_calls(rule, params, grads, states, hp, sr_keys):
            self.run_kernel(*call)

    def run_kernel(self, rule: str, params, grads, states, hp) -> None:
        """One kernel of KERNELS with its own arguments (a storage form's ``Rule.hyper`` and, when
        block-quantized, its Metal buffers, ``Rule.states``): what the probes run."""
        b = self._buffer_of
        if b is mps_buffer:  # the same triples, fewer reads per tensor
            n = numels(params)  # grads and states have their param's shape (validated)
            buffers = [mps_buffers(lst, n) for lst in (params, grads, *states)]
        else:
            buffers = [[b(t) for t in lst] for lst in (params, grads, *states)]
        self._ext.step(kernel_name(rule, params[0].dtype, states[0][0].dtype), buffers, pack_params(hp, rule))


class ShaderLibraryBackend(_PerKernel):
    """Tiers 2 and 3: a torch ShaderLibrary (``load_metallib`` / ``compile_shader``) of our kernels.

    torch's kernel call binds positional arguments to buffer indices in order: tensors with their
    storage offset, Python ints as int64 and lists of ints as int64 arrays (torch/csrc/mps/Module.cpp).
    A kernel the library lacks (a source compiled without bfloat) or whose pipeline torch cannot
    create is unavailable here, the others run.
    """

    def __init__(self, name: str, library: Any, max_threads: int = MAX_THREADS_PER_DISPATCH,
                 probe_device: str | torch.device = "mps") -> None:
        available = set(dir(library))
        self.name = name
        self._init_kernels({k: f"the library lacks kernel {n}" for k, n in KERNELS.items() if n not in available},
                           probe_device)
        self._lib = library
        self._fns: dict[tuple[str, torch.dtype, torch.dtype], Any] = {}
        self._max_threads = max_threads

    def _kernel(self, key: tuple[str, torch.dtype, torch.dtype]) -> tuple[Any, int]:
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = getattr(self._lib, KERNELS[key])
        return fn, min(THREADGROUP_SIZE, int(getattr(fn, "max_threads_per_threadgroup", THREADGROUP_SIZE)))

    def _build(self, kernel: Kernel) -> Optional[str]:
        try:  # torch creates the pipeline state here ("Failed to create function state object")
            self._kernel(kernel)
        except Exception as exc:
            return f"its pipeline was not built: {exc!r}"
        return None

    def update(self, rule: str, params, grads, states, hp, sr_keys=None) -> None:
        for call in kernel_calls(rule, params, grads, states, hp, sr_keys):
            self.run_kernel(*call)

    def run_kernel(self, rule: str, params, grads, states, hp) -> None:
        """One kernel of KERNELS with its own arguments (see MetalExtBackend.run_kernel)."""
        fn, group = self._kernel((rule, params[0].dtype, states[0][0].dtype))
        words = params_as_words(pack_params(hp, rule))
        for tensors in zip(params, grads, *states):
            n = tensors[0].numel()
            for base, threads in dispatch_plan(n, self._max_threads):
                fn(*tensors, words, base, n, threads=threads, group_size=min(group, threads))


# 67 threads of 4 elements and a tail of 1; for 8-bit states one whole block of 256 and a short one,
# for 4-bit states two whole blocks of 128, a short one and an odd count (a padding nibble).
PROBE_ELEMENTS = 269
PROBE_SEED = 0x5EED  # the stochastic-rounding seed of the probes' second step


def _probe_inputs(kernel: Kernel, n: int) -> tuple[list[torch.Tensor], list[Any], Callable[..., None]]:
    """``(tensors, hypers, reference)`` of ``kernel``'s probe: param, grad and the kernel's state
    tensors (in kernel order) on the CPU, the hyperparameters of each step (each rule's two
    example modes, the second also with maximize; a storage form those of its base rule with and
    without a key: the key on both steps where the rule takes only bf16 params, else on the
    second for bf16 params), and ``reference(tensors, hp)``, which steps CPU tensors in place."""
    from ..numerics import lowbit
    from ..numerics.contract import example
    from ..numerics.reference import REFERENCES
    rule, pdt, sdt = kernel
    spec = RULES[rule]
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen).to(pdt), torch.randn(n, generator=gen).to(pdt)
    ex = example(spec.base or rule)
    hypers = [ex.hyper(1, **ex.modes[0]), ex.hyper(2, **{"maximize": True, **ex.modes[1]})]
    if spec.blocks is not None:
        fresh = dict(zip(spec.blocks.names, resolve(spec.blocks.new_states)((n,), "cpu")))
        states = [fresh[name] for name in spec.states[:len(fresh)]] + list(resolve(spec.blocks.tables)("cpu"))
    else:
        states = [((0.01 * torch.rand(n, generator=gen)) if name in ex.nonnegative else
                   (0.1 * torch.randn(n, generator=gen))).to(sdt) for name in spec.states]
    if spec.base is None:
        return [p, g, *states], hypers, lambda t, hp: REFERENCES[rule](t[0], t[1], t[2:], hp)
    keyed = [pdt is torch.bfloat16 and (i > 0 or spec.param_dtypes is not None) for i in range(len(hypers))]
    hypers = [spec.hyper(hp, lowbit.sr_key(PROBE_SEED, hp.step) if k else None) for hp, k in zip(hypers, keyed)]
    reference = resolve(spec.reference)
    names = spec.blocks.names if spec.blocks is not None else spec.states
    at = [2 + spec.states.index(name) for name in names]  # the reference's state order in ``tensors``
    return [p, g, *states], hypers, lambda t, hp: reference(t[0], t[1], *(t[k] for k in at), hp.adam, hp.sr_key)


def _differs(got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """How ``got`` breaks the contract against ``want``: codes must be equal; values within
    ``8 * eps(dtype) * max|ref|``, with NaN only where the reference has NaN."""
    if not want.is_floating_point():
        wrong = int((got != want).sum())
        return f"{wrong} of {want.numel()} codes differ" if wrong else None
    got, ref = got.float(), want.float()
    nan = got.isnan() & ~ref.isnan()
    if bool(nan.any()):
        return f"NaN at {int(nan.sum())} of {ref.numel()} elements"
    bound = 8 * torch.finfo(want.dtype).eps * max(float(ref.abs().max()), torch.finfo(torch.float32).tiny)
    diff = float(torch.where(ref.isnan(), 0.0, (got - ref).abs()).max())
    return None if diff <= bound else f"{diff:.3g} away from the reference (the contract's bound: {bound:.3g})"


@lru_cache(maxsize=None)
def _probe_case(kernel: Kernel, n: int) -> tuple[tuple[torch.Tensor, ...], tuple[Any, ...], tuple[torch.Tensor, ...]]:
    """``kernel``'s probe inputs, hyperparameters and reference results, computed once per
    process (every tier probes the same kernel against the same reference)."""
    start, hypers, reference = _probe_inputs(kernel, n)
    want = [t.clone() for t in start]
    for hp in hypers:
        reference(want, hp)
    return tuple(start), tuple(hypers), tuple(want)


def probe_kernel(backend: Any, kernel: Kernel, device: str | torch.device, n: int = PROBE_ELEMENTS) -> Optional[str]:
    """Two steps of ``kernel`` through ``backend.run_kernel`` (the kernel with its own arguments) on
    ``n`` elements on ``device`` against the reference on the CPU: None when every output agrees (:func:`_differs`), else what failed.

    Each Metal tier runs it for a kernel before the kernel's first real dispatch (``prepare``), so
    that a kernel which builds but cannot run (a torch whose ShaderLibrary binds arguments
    otherwise than 2.13's; a GPU that computes it wrongly) is refused, and its tensors go to the
    next tier, instead of training wrong. Untested on Apple hardware."""
    kernel = Kernel(*kernel)
    start, hypers, want = _probe_case(kernel, n)
    what = f"its first-use probe ({len(hypers)} steps of {n} elements on {device})"
    try:
        ours = [t.to(device, copy=True) for t in start]
        for hp in hypers:
            backend.run_kernel(kernel.rule, [ours[0]], [ours[1]], [[t] for t in ours[2:]], hp)
        got = [t.cpu() for t in ours]  # waits for the GPU
    except Exception as exc:
        return f"{what} failed: {exc!r}"
    spec = RULES[kernel.rule]
    # A block-quantized rule's tables are read-only inputs, not outputs.
    names = ["param", *spec.states[:len(spec.states) if spec.blocks is None else len(spec.blocks.names)]]
    for name, k in zip(names, [0, *range(2, len(start))]):
        wrong = _differs(got[k], want[k])
        if wrong is not None:
            return f"{what} gave a {name} {wrong}"
    return None


def probe(backend: Any) -> None:
    """The first-use probe of a tier: :data:`BASE_KERNEL` must pass :meth:`prepare`, or the tier
    is refused like one that does not load and the next one is used. Raises ``RuntimeError``
    saying what failed."""
    backend.prepare([BASE_KERNEL])


def mps_tiers(*, load_ext: Callable[[], Any] | None = None, mps_api: Any = None,
              package_dir: Path | None = None, buffer_of: Callable = mps_buffer,
              torch_version: Callable[[], tuple[int, int]] = torch_version,
              probe_device: str = "mps") -> list[tuple[str, Callable[[], Any]]]:
    """Tiers 1-3 as ``(label, factory)`` in preference order; each factory raises why it can't
    load, or why it cannot run (:func:`probe`). Each tier probes every other kernel in its
    ``prepare``; the probes run on ``probe_device`` (the stand-ins of the tests: CPU tensors)."""
    pkg = package_dir if package_dir is not None else _package_dir()

    def api() -> Any:
        return mps_api if mps_api is not None else torch.mps

    def import_ext() -> Any:
        from .. import _metal  # ImportError: not built (non-Apple wheel) or not loadable
        return _metal

    def tier1() -> MetalExtBackend:
        if torch_version() < TIER1_MIN_TORCH:
            raise RuntimeError(
                f"torch {torch.__version__} is older than {'.'.join(map(str, TIER1_MIN_TORCH))}: its "
                "torch::mps::get_command_buffer() leaves PyTorch's own encoder open (no endKernelCoalescing)")
        ext = (load_ext or import_ext)()
        return MetalExtBackend(ext, pkg / METALLIB_NAME, buffer_of, probe_device)

    def tier2() -> ShaderLibraryBackend:
        load = getattr(api(), "load_metallib", None)
        if load is None:
            raise RuntimeError(f"torch {torch.__version__} has no torch.mps.load_metallib")
        path = pkg / METALLIB_NAME
        if not path.is_file():
            raise missing_metallib(path)
        return ShaderLibraryBackend("load_metallib", load(path), probe_device=probe_device)

    def tier3() -> ShaderLibraryBackend:
        compile_shader = getattr(api(), "compile_shader", None)
        if compile_shader is None:
            raise RuntimeError(f"torch {torch.__version__} has no torch.mps.compile_shader")
        source = find_metal_source(pkg).read_text(encoding="utf-8")
        return ShaderLibraryBackend("compile_shader", compile_shader(source), probe_device=probe_device)

    def probed(make: Callable[[], Any]) -> Callable[[], Any]:
        def factory() -> Any:
            backend = make()
            probe(backend)
            return backend
        return factory

    return [("_metal extension", probed(tier1)), ("torch.mps.load_metallib", probed(tier2)),
            ("torch.mps.compile_shader", probed(tier3))]
