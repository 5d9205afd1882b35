"""Every kernel of fused_adam.metallib on a Metal device, held against the Python reference.

The device-independent half of the raw-Metal harness (issue 27): it lays out the buffers, runs
each case's steps through a :class:`Device`, computes the expected values with the package's
reference (``reference.py``, ``reference_lowbit.py``) and compares. Two devices implement the
interface: :class:`EmulatorDevice` here (the host emulator, ``tests/support/metal_emulator.cpp``, on
Linux in every test run) and ``metal_pyobjc.MetalDevice`` (a real Metal device through pyobjc:
the only Apple-only code). The ``.mm`` itself is driven by :func:`run_case` with an
:class:`ExtSubmit`, which hands the same buffers to ``_metal.step`` as (handle, offset, numel).

What the cases cover (:func:`cases`): every kernel the metallib exports (each rule and mode, every
dtype pair, 8-bit, 4-bit, stochastic rounding), three steps each, sizes with a tail (not a multiple of
4, and for 8-bit and 4-bit not of the 256- or 128-element block; an odd 4-bit size: a padding nibble), each tensor at a byte offset inside its own
buffer with guard bytes around it, one tensor split into several dispatches through ``base``,
real grids (several threadgroups per dispatch, a partial last threadgroup, more threads than one
threadgroup may hold: ``GRID_LAYOUTS``), and NaN/Inf in gradients and parameters.

How a kernel is judged (:func:`compare`), as the self-check judges a backend: a float tensor lies
within the contract's GPU bound ``8 * eps(dtype) * max|ref|`` (DESIGN.md section 2) and has NaN
and infinities exactly where the reference has them; a code tensor (8-bit and 4-bit states) is identical;
no byte outside a tensor changes. Reported per kernel: the share of bit-identical elements (a NaN
where the reference has NaN counts as identical: its sign and payload are not in the contract)
and the worst error in ulps of the stored dtype.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch

# The package pieces the harness rests on, imported in one place.
from mps_fused_adam.numerics import lowbit, lowbit4
from mps_fused_adam.numerics.contract import AdamHyper, example
from mps_fused_adam.backends.mps import KERNELS, METAL_RULES, dispatch_plan, pack_params
from mps_fused_adam.numerics.reference import reference_step_
from mps_fused_adam.numerics.reference_lowbit import reference_adam4bit_, reference_adam8bit_, reference_adam_sr_

BOUND = 8.0  # the contract's GPU bound, in units of eps(dtype) * max|ref|
GUARD = 64  # bytes of canary before and after every tensor
CANARY = 0xA5
STEPS = 3
REQUIRE_ENV = "MFA_REQUIRE_METAL"
LOWBIT = {"adam8bit": lowbit.BLOCK, "adam4bit": lowbit4.BLOCK4}  # block-wise rules: elements per block
_SHORT = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat", torch.uint8: "uchar"}


class KernelUnavailable(Exception):
    """A kernel this device cannot run. ``documented`` says whether the reason is one of the
    device's documented limits (bfloat without Metal 3.1), which MFA_REQUIRE_METAL=1 accepts."""

    def __init__(self, reason: str, documented: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.documented = documented


@dataclass
class Buffer:
    """A shared-storage buffer: ``handle`` is what a dispatch binds (an ``id<MTLBuffer>`` as an
    integer, or a host address on the emulator); ``host`` is its contents as uint8."""

    handle: int
    host: torch.Tensor
    keep: Any = None  # the object that owns the memory (an MTLBuffer)


@dataclass
class Dispatch:
    bindings: list[tuple[Buffer, int]]  # (buffer, byte offset) for buffer indices 0 .. k-1
    scalars: bytes  # index k
    base: int  # index k + 1
    n: int  # index k + 2
    threads: int
    group: int


class Device(Protocol):
    name: str

    def describe(self) -> list[str]: ...
    def kernel_names(self) -> set[str]: ...
    def prepare(self, kernel: str) -> None: ...  # raises KernelUnavailable
    def new_buffer(self, nbytes: int) -> Buffer: ...
    def run(self, kernel: str, dispatches: Sequence[Dispatch]) -> None: ...  # one command buffer, waited on


# --------------------------------------------------------------------------- cases

@dataclass(frozen=True)
class Case:
    kernel: str
    rule: str  # adam, lion, adagrad, adam_sr, adam8bit, adam4bit
    pdtype: torch.dtype
    sdtype: torch.dtype
    n: int
    mode: tuple  # (key, value) pairs: the rule's switches
    offsets: tuple[int, ...]  # element offset of each bound tensor inside its buffer
    chunk_threads: int  # threads per dispatch: n / (4 * chunk_threads) dispatches through base
    specials: bool
    seed: int
    group: int = 256  # threads per threadgroup (less where a dispatch has fewer threads)

    @property
    def label(self) -> str:
        mode = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.mode)
        return (f"{self.kernel} n={self.n} {mode} offsets={list(self.offsets)} chunk={self.chunk_threads} "
                f"group={self.group}")


ADAM_MODES = [dict(adam_w_mode=w, bias_correction=b, maximize=x) for w in (True, False)
              for b in (True, False) for x in (False, True)]


def _offsets(count: int, seed: int) -> tuple[int, ...]:
    # Distinct small offsets, odd ones included (a half tensor at 2 bytes past a 4-aligned start).
    return tuple((seed + 3 * i) % 7 for i in range(count))


# Real grids, for every kernel: GRID_N elements are 1,501 threads, past the 1,024 threads one
# threadgroup may hold on any Apple GPU. (chunk threads per dispatch, threadgroup width): one
# dispatch of six threadgroups of 256, the last of 221; two dispatches (1,024 and 477 threads:
# 8-bit and 4-bit dispatches start on a block) of threadgroups of 96, each ending in a partial one; one
# dispatch of threadgroups of 1,024, the limit itself, then 477.
GRID_N = 6003
GRID_LAYOUTS = ((1 << 30, 256), (1024, 96), (1 << 30, 1024))


def cases() -> list[Case]:
    """Every kernel of KERNELS, each in several modes, sizes and layouts."""
    out: list[Case] = []
    seed = 0

    def add(rule, pd, sd, n, mode, chunk, specials=True, group=256):
        nonlocal seed
        seed += 1
        k = 2 + len(METAL_RULES[rule].states)
        out.append(Case(KERNELS[(rule, pd, sd)], rule, pd, sd, n, tuple(sorted(mode.items())),
                        _offsets(k, seed), chunk, specials and n >= 8, seed, group))

    pairs = [(p, s) for (r, p, s) in KERNELS if r == "adam"]
    for pd, sd in pairs:
        for mode in ADAM_MODES:
            add("adam", pd, sd, 67, mode, 8)  # 3 dispatches (32, 32, 3 elements): a tail thread
        for mode in (ADAM_MODES[0], ADAM_MODES[5]):
            add("adam", pd, sd, 5, mode, 1)  # two dispatches of one thread; no specials
            add("adam", pd, sd, 4099, mode, 256)  # 5 dispatches
        for rule in ("lion", "adagrad"):
            for maximize, wd in ((False, 0.1), (True, 0.0)):
                for n, chunk in ((5, 1), (67, 8), (4099, 256)):
                    add(rule, pd, sd, n, dict(maximize=maximize, weight_decay=wd), chunk)
    for sd in (torch.float32, torch.bfloat16):
        for mode in (ADAM_MODES[0], ADAM_MODES[3], ADAM_MODES[5]):
            for n, chunk in ((5, 1), (67, 8), (4099, 256)):
                add("adam_sr", torch.bfloat16, sd, n, mode, chunk)
    for pd in (torch.float32, torch.float16, torch.bfloat16):
        for mode in (ADAM_MODES[0], ADAM_MODES[5]):
            for sr in ((False, True) if pd is torch.bfloat16 else (False,)):
                # 8-bit dispatches must start on a block: chunks of 64 threads (256 elements).
                for n, chunk in ((5, 64), (257, 64), (1000, 64)):
                    add("adam8bit", pd, torch.uint8, n, dict(mode, sr=sr), chunk)
                # 4-bit: blocks of 128 (chunks of 32 threads); odd sizes end in a padding nibble.
                for n, chunk in ((5, 32), (129, 32), (1001, 64)):
                    add("adam4bit", pd, torch.uint8, n, dict(mode, sr=sr), chunk)
    # The grids, for every kernel the cases above run (a rule they do not know has no inputs here).
    for rule, pd, sd in dict.fromkeys((c.rule, c.pdtype, c.sdtype) for c in list(out)):
        if rule in ("lion", "adagrad"):
            mode = dict(maximize=False, weight_decay=0.1)
        elif rule in LOWBIT:
            mode = dict(ADAM_MODES[0], sr=pd is torch.bfloat16)
        else:
            mode = ADAM_MODES[0]
        for chunk, group in GRID_LAYOUTS:
            add(rule, pd, sd, GRID_N, mode, chunk, group=group)
    return out


def hyper(case: Case, step: int):
    """The hyperparameters of ``case``'s step ``step`` (what the kernel's struct packs)."""
    mode = dict(case.mode)
    if case.rule in ("lion", "adagrad"):
        return example(case.rule).hyper(step, **mode)
    sr = mode.pop("sr", case.rule == "adam_sr")
    adam = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step, **mode)
    key = lowbit.sr_key(0x0123456789ABCDEF + case.seed, step) if sr else None
    if case.rule == "adam_sr":
        return lowbit.AdamSRHyper(adam, key)
    if case.rule in LOWBIT:
        return lowbit.Adam8bitTensorHyper(adam, key)
    return adam


def initial(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the bound tensors but the grad, in buffer order with grad removed; one grad per step)."""
    gen = torch.Generator().manual_seed(case.seed)
    n = case.n
    p = torch.randn(n, generator=gen).to(case.pdtype)
    grads = [torch.randn(n, generator=gen).to(case.pdtype) for _ in range(STEPS)]
    if case.rule == "adam8bit":
        blocks = lowbit.num_blocks(n)
        c1 = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        c2 = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        a1 = 0.1 * torch.rand(blocks, generator=gen) + 0.01
        a2 = 0.01 * torch.rand(blocks, generator=gen) + 1e-4
        states = [c1, c2, a1, a2, lowbit.kernel_table(True), lowbit.kernel_table(False)]
    elif case.rule == "adam4bit":
        blocks = lowbit4.num_blocks4(n)
        c1 = lowbit4.pack_codes4(torch.randint(0, 16, (n,), generator=gen, dtype=torch.uint8))
        c2 = lowbit4.pack_codes4(torch.randint(0, 16, (n,), generator=gen, dtype=torch.uint8))
        a1 = 0.1 * torch.rand(blocks, generator=gen) + 0.01
        a2 = 0.01 * torch.rand(blocks, generator=gen) + 1e-4
        states = [c1, c2, a1, a2, lowbit4.kernel_table4(True), lowbit4.kernel_table4(False)]
    else:
        spec = METAL_RULES[case.rule]
        nonneg = example("adam" if case.rule == "adam_sr" else case.rule).nonnegative
        states = [(0.01 * torch.rand(n, generator=gen) if name in nonneg else 0.1 * torch.randn(n, generator=gen))
                  .to(case.sdtype) for name in spec.states]
    if case.specials:
        g = grads[0]
        if case.rule in LOWBIT:
            # A NaN poisons its whole block (the block scale is a max): keep them in the last block.
            block = LOWBIT[case.rule]
            last = (-(-n // block) - 1) * block
            p[n - 1], g[last] = float("inf"), float("nan")
        else:
            p[3], p[min(9, n - 1)] = float("nan"), float("inf")
            g[1], g[6], g[n - 1] = float("nan"), float("inf"), -float("inf")  # vector body and tail
    return [p, *states], grads


def reference(case: Case, start: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [t.clone() for t in start]
    for step, g in enumerate(grads, start=1):
        hp = hyper(case, step)
        if case.rule in LOWBIT:
            p, c1, c2, a1, a2 = out[:5]
            ref = reference_adam8bit_ if case.rule == "adam8bit" else reference_adam4bit_
            ref(p, g, c1, a1, c2, a2, hp.adam, hp.sr_key)
        elif case.rule == "adam_sr":
            reference_adam_sr_(out[0], g, out[1], out[2], hp.adam, hp.sr_key)
        else:
            reference_step_(case.rule, out[0], g, out[1:], hp)
    return out


# --------------------------------------------------------------------------- running

@dataclass
class Placed:
    buffer: Buffer
    offset: int  # elements
    tensor_like: torch.Tensor  # dtype and numel

    @property
    def byte_offset(self) -> int:
        return GUARD + self.offset * self.tensor_like.element_size()

    def view(self) -> torch.Tensor:
        t = self.tensor_like
        lo = self.byte_offset
        return self.buffer.host[lo:lo + t.numel() * t.element_size()].view(t.dtype)

    def guards_intact(self) -> bool:
        lo = self.byte_offset
        hi = lo + self.tensor_like.numel() * self.tensor_like.element_size()
        host = self.buffer.host
        return bool((host[:lo] == CANARY).all()) and bool((host[hi:] == CANARY).all())


def place(device: Device, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[Placed]:
    out = []
    for t, off in zip(tensors, offsets):
        nbytes = 2 * GUARD + (off + t.numel()) * t.element_size()
        buf = device.new_buffer(nbytes)
        buf.host.fill_(CANARY)
        placed = Placed(buf, off, t)
        placed.view().copy_(t)
        out.append(placed)
    return out


class DirectSubmit:
    """Encodes a step as the harness's own dispatches (several per tensor, through ``base``)."""

    def __init__(self, device: Device) -> None:
        self.device = device

    def __call__(self, case: Case, bound: list[Placed], scalars: bytes) -> None:
        plan = dispatch_plan(case.n, max_threads=case.chunk_threads)
        bindings = [(pl.buffer, pl.byte_offset) for pl in bound]
        self.device.run(case.kernel, [Dispatch(bindings, scalars, base, case.n, threads, min(case.group, threads))
                                      for base, threads in plan])


class ExtSubmit:
    """Hands a step to the ``_metal`` extension (or its stand-in) as metal_adam.mm takes it:
    one list per buffer index of (handle, byte offset, numel), then waits with ``sync``."""

    def __init__(self, ext: Any, sync: Callable[[], None]) -> None:
        self.ext = ext
        self.sync = sync

    def __call__(self, case: Case, bound: list[Placed], scalars: bytes) -> None:
        # The .mm checks that every tensor of a parameter has the param's numel; the 8-bit block
        # scales and map tables are not per element, so they travel with the param's numel (the
        # kernel takes n from the param, never from them).
        lists = [[(pl.buffer.handle, pl.byte_offset, case.n)] for pl in bound]
        self.ext.step(case.kernel, lists, scalars)
        self.sync()


def run_case(device: Device, case: Case, submit: Callable[[Case, list[Placed], bytes], None]) -> list[torch.Tensor]:
    """``case``'s steps on ``device``; returns the outputs (param and states) read back."""
    start, grads = initial(case)
    bound_tensors = [start[0], grads[0], *start[1:]]
    bound = place(device, bound_tensors, case.offsets)
    for step, g in enumerate(grads, start=1):
        bound[1].view().copy_(g)  # shared storage: the host writes, the next command buffer reads
        submit(case, bound, pack_params(hyper(case, step), case.rule))
    broken = [i for i, pl in enumerate(bound) if not pl.guards_intact()]
    if broken:
        raise AssertionError(f"{case.label}: bytes outside the tensors of buffer indices {broken} changed")
    return [pl.view().clone() for i, pl in enumerate(bound) if i != 1]


# --------------------------------------------------------------------------- comparing

def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns mapped to integers in value order, so their difference counts ulps."""
    if t.dtype is torch.uint8:
        return t.to(torch.int64)
    bits = t.view({4: torch.int32, 2: torch.int16}[t.element_size()]).to(torch.int64)
    top = 1 << (8 * t.element_size() - 1)
    return torch.where(bits < 0, -(bits + top), bits)


@dataclass
class TensorStats:
    elements: int = 0
    identical: int = 0
    worst_ulps: float = 0.0
    worst_in_eps: float = 0.0  # |ours - ref| / (eps(dtype) * max|ref|), finite references
    problems: list[str] = field(default_factory=list)


def compare(name: str, ours: torch.Tensor, ref: torch.Tensor, stats: TensorStats) -> None:
    """Adds ``ours`` against ``ref`` to ``stats`` (problems: what breaks the contract)."""
    same = (_ordered(ours) == _ordered(ref))
    if ref.is_floating_point():
        nan_o, nan_r = ours.isnan(), ref.isnan()
        same |= nan_o & nan_r
        ulps = torch.where(nan_o | nan_r, 0, (_ordered(ours) - _ordered(ref)).abs()).float()
        if (nan_o != nan_r).any():
            stats.problems.append(f"{name}: NaN at {(nan_o != nan_r).nonzero().flatten()[:5].tolist()} "
                                  "where the reference has none, or the reverse")
            ulps = torch.where(nan_o != nan_r, math.inf, ulps)
        inf_o, inf_r = ours.isinf(), ref.isinf()
        if (inf_o != inf_r).any() or (ours[inf_r] != ref[inf_r]).any():
            stats.problems.append(f"{name}: infinities differ from the reference's")
        finite = ref.isfinite() & ours.isfinite()
        r = ref.float()
        scale = torch.finfo(ref.dtype).eps * max(r[finite].abs().max().item() if finite.any() else 0.0,
                                                 torch.finfo(torch.float32).tiny)
        err = (ours.float() - r)[finite].abs().max().item() if finite.any() else 0.0
        ratio = err / scale
        if ratio > BOUND:
            stats.problems.append(f"{name}: max|ours - ref| = {err:.3g} = {ratio:.3g} eps*max|ref| > {BOUND:g}")
        stats.worst_in_eps = max(stats.worst_in_eps, ratio)
    else:
        ulps = (_ordered(ours) - _ordered(ref)).abs().float()
        if not same.all():
            stats.problems.append(f"{name}: {int((~same).sum())} of {same.numel()} codes differ")
    stats.elements += same.numel()
    stats.identical += int(same.sum())
    stats.worst_ulps = max(stats.worst_ulps, ulps.max().item() if ulps.numel() else 0.0)


def output_names(case: Case) -> list[str]:
    return ["param", *METAL_RULES[case.rule].states[:4 if case.rule in LOWBIT else None]]


@dataclass
class KernelReport:
    kernel: str
    cases: int = 0
    stats: TensorStats = field(default_factory=TensorStats)
    skipped: str | None = None
    documented_skip: bool = False

    @property
    def ok(self) -> bool:
        return self.skipped is None and self.cases > 0 and not self.stats.problems

    def line(self) -> str:
        if self.skipped is not None:
            kind = "skipped (device limit)" if self.documented_skip else "SKIPPED"
            return f"{self.kernel:32s} {kind}: {self.skipped}"
        s = self.stats
        share = 100.0 * s.identical / max(s.elements, 1)
        return (f"{self.kernel:32s} {self.cases:3d} cases {s.elements:7d} elements  identical {share:7.3f}%  "
                f"worst {s.worst_ulps:g} ulp  {s.worst_in_eps:.3g}/{BOUND:g} of the bound  "
                f"{'ok' if self.ok else 'FAIL: ' + '; '.join(s.problems[:3])}")


def run_all(device: Device, submit: Callable | None = None, selected: Iterable[Case] | None = None,
            kernels: Iterable[str] | None = None) -> dict[str, KernelReport]:
    """Every case on ``device`` (``submit``: :class:`DirectSubmit` unless given); one report per kernel."""
    submit = submit or DirectSubmit(device)
    todo = list(selected if selected is not None else cases())
    names = sorted(set(kernels) if kernels is not None else set(KERNELS.values()))
    reports = {k: KernelReport(k) for k in names}
    available = device.kernel_names()
    for k in names:
        if k not in available:
            reports[k].skipped = f"the library has no function {k}"
            continue
        try:
            device.prepare(k)
        except KernelUnavailable as exc:
            reports[k].skipped, reports[k].documented_skip = exc.reason, exc.documented
    for case in todo:
        rep = reports[case.kernel]
        if rep.skipped is not None:
            continue
        start, grads = initial(case)
        want = reference(case, start, grads)
        try:
            got = run_case(device, case, submit)
        except Exception as exc:  # noqa: BLE001 - a failing case is reported; the other kernels still run
            rep.stats.problems.append(f"{case.label}: {type(exc).__name__}: {exc}")
            continue
        rep.cases += 1
        for name, a, b in zip(output_names(case), got, want):
            before = len(rep.stats.problems)
            compare(name, a, b, rep.stats)
            rep.stats.problems[before:] = [f"{case.label}: {p}" for p in rep.stats.problems[before:]]
    return reports


def failures(reports: dict[str, KernelReport], require: bool | None = None) -> list[str]:
    """What fails the run: a kernel that broke the contract, or, where ``require`` (default:
    MFA_REQUIRE_METAL=1), a kernel skipped for a reason other than the device's documented limits."""
    if require is None:
        require = os.environ.get(REQUIRE_ENV) == "1"
    out = []
    for rep in reports.values():
        if rep.skipped is not None:
            if require and not rep.documented_skip:
                out.append(f"{rep.kernel}: skipped ({rep.skipped}) and {REQUIRE_ENV}=1")
        elif not rep.ok:
            out.append(rep.line())
    return out


def report_text(device: Device, reports: dict[str, KernelReport]) -> str:
    return "\n".join([*device.describe(), *(r.line() for r in reports.values())])


# --------------------------------------------------------------------------- the host emulator

class EmulatorDevice:
    """The host emulator (tests/emulated_mps.Emulator) behind the :class:`Device` interface:
    buffers are host memory, a dispatch runs the kernel source compiled as C++. It also checks
    what Metal requires of a dispatch: a device buffer's offset aligned to its element type."""

    name = "host emulator"

    def __init__(self, emu: Any) -> None:
        self.emu = emu
        self.runs = 0

    def describe(self) -> list[str]:
        return [f"device: {self.name} (metal/fused_adam.metal compiled as C++17, tests/support/metal_emulator.cpp)",
                "GPU families: none (not a GPU); bfloat: emulated (metal_compat.h)"]

    def kernel_names(self) -> set[str]:
        return set(self.emu.kernel_names)

    def prepare(self, kernel: str) -> None:
        pass

    def new_buffer(self, nbytes: int) -> Buffer:
        host = torch.empty(nbytes, dtype=torch.uint8)
        return Buffer(host.data_ptr(), host, host)

    def run(self, kernel: str, dispatches: Sequence[Dispatch]) -> None:
        self.runs += 1
        for d in dispatches:
            if len(d.bindings) != self.emu.buffer_count[kernel]:
                raise AssertionError(f"{kernel} binds {self.emu.buffer_count[kernel]} buffers, got {len(d.bindings)}")
            for i, ((_, off), size) in enumerate(zip(d.bindings, element_sizes(kernel))):
                if off % size:
                    raise AssertionError(f"{kernel}: buffer {i} at byte offset {off}, not a multiple of {size}")
            addrs = tuple(buf.handle + off for buf, off in d.bindings)
            self.emu.dispatch(kernel, addrs, d.scalars, d.base, d.n, d.threads, d.group)


def element_sizes(kernel: str) -> list[int]:
    """Element size of each buffer index of ``kernel`` (what its offset must be a multiple of)."""
    rule, pd, sd = next(key for key, name in KERNELS.items() if name == kernel)
    psize = torch.empty(0, dtype=pd).element_size()
    if rule in LOWBIT:
        return [psize, psize, 1, 1, 4, 4, 4, 4]
    return [psize, psize] + [torch.empty(0, dtype=sd).element_size()] * len(METAL_RULES[rule].states)


def pack_u64(x: int) -> bytes:
    return struct.pack("<Q", x)
