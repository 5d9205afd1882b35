"""Per-tensor cost of the step path (``python -m mps_fused_adam.bench --overhead``).

A group of many tiny tensors whose grads are new tensors every step (``zero_grad(set_to_none=True)``,
torch's default), stepped three ways, interleaved, median kept:

- with its real backend, and the ``_cpu`` kernel alone on addresses gathered beforehand: the
  difference is the step path's cost;
- with a backend that does nothing: what is left is the step path (validation, bucketing,
  gathering addresses, bumping autograd's version counters);
- the version-counter bump alone (``backends/versions.py``), the part of the step path that
  tells autograd the params changed, on the same tensors.

The MPS tiers run the same
path: tier 1 (``_metal``) is measured with a stand-in extension that does nothing, on CPU tensors
(on an MPS tensor the same code reads the buffer handle where it reads a host address here), and
tiers 2-3 (torch's ShaderLibrary, one Python-level dispatch per tensor) with stand-in kernels that
do nothing. New grads are made outside the timed region.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator

import torch

from .. import AdamW, CPUAdam, backends
from ..numerics.contract import RULES, AdamHyper
from ..backends.mps import MetalExtBackend, ShaderLibraryBackend, KERNELS
from ..backends.versions import bump


class _NoopBackend:
    name = "no-op"

    def update(self, *args: Any) -> None:
        pass


class _NoopMetalExt:
    """The ``_metal`` extension's call surface, doing nothing."""

    def load(self, *args: Any) -> None:
        pass

    def step(self, *args: Any) -> None:
        pass


class _NoopLibrary:
    """A ShaderLibrary whose kernels do nothing."""

    def __dir__(self) -> list[str]:
        return list(KERNELS.values())

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name not in KERNELS.values():
            raise AttributeError(name)
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _backend_for_cpu(backend: Any) -> Iterator[None]:
    """Route CPU tensors to ``backend`` for the duration (the choice is per device type)."""
    saved = backends._chosen.get("cpu")
    backends._chosen["cpu"] = backend
    try:
        yield
    finally:
        if saved is None:
            backends._chosen.pop("cpu", None)
        else:
            backends._chosen["cpu"] = saved


def _metal_ext_backend() -> MetalExtBackend:
    backend = MetalExtBackend.__new__(MetalExtBackend)  # skips loading a metallib the stand-in ignores
    backend._ext = _NoopMetalExt()
    from ..backends.mps import mps_buffer
    backend._buffer_of = mps_buffer
    return backend


def _step_times(opt: torch.optim.Optimizer, params: list, size: int, dtype: torch.dtype, repeats: int,
                backend: Any = None) -> tuple[list[float], list[float]]:
    """Wall-clock and calling-thread CPU seconds of ``repeats`` steps, new grads before each."""
    ctx = _backend_for_cpu(backend) if backend is not None else contextlib.nullcontext()
    wall, cpu = [], []
    with ctx:
        for _ in range(repeats):
            opt.zero_grad(set_to_none=True)
            for p in params:
                p.grad = torch.full((size,), 1e-3, dtype=dtype)
            t0, c0 = time.perf_counter(), time.thread_time()
            opt.step()
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
    return wall, cpu


def _kernel_times(opt: torch.optim.Optimizer, params: list, repeats: int) -> list[float]:
    from .. import _cpu
    states = [opt.state[p] for p in params]
    pd, sd = params[0].dtype, states[0]["exp_avg"].dtype
    rule = RULES["adam"]
    args = ("adam", [p.data_ptr() for p in params], [p.grad.data_ptr() for p in params],
            [[s[name].data_ptr() for s in states] for name in rule.states],
            [p.numel() for p in params], backends._DTYPE_CODES[pd], backends._DTYPE_CODES[sd],
            rule.pack(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 10)), torch.get_num_threads())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _cpu.step(*args)
        times.append(time.perf_counter() - t0)
    return times


def _bump_times(params: list, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bump(params)
        times.append(time.perf_counter() - t0)
    return times


def overhead_section(count: int = 1000, size: int = 16, repeats: int = 200) -> list[dict]:
    """Print and return microseconds per tensor of each optimizer/tier's step path.

    Shared machines deschedule a process for milliseconds at a time, longer than a step of 1,000
    tiny tensors, so two statistics are kept: the fastest wall-clock step (the least disturbed),
    and the median CPU time of the calling thread (time it was not running does not count)."""
    rows = []
    cases = [("AdamW fp32", AdamW, torch.float32), ("CPUAdam bf16, fp32 states", CPUAdam, torch.bfloat16)]
    print(f"Per-tensor cost of the step path: {count} tensors of {size} elements, grads new every step, "
          f"{repeats} steps each")
    print("| optimizer | backend | step - kernel: fastest wall, us/tensor | step path: fastest wall | "
          "step path: median thread CPU |")
    print("|---|---|---|---|---|")
    us = 1e6 / count
    for label, cls, dtype in cases:
        params = [torch.nn.Parameter(torch.randn(size).to(dtype)) for _ in range(count)]
        opt = cls(params)
        tiers: list[tuple[str, Any]] = [
            ("cpu", None), ("no-op", _NoopBackend()), ("metal tier, stand-in _metal", _metal_ext_backend()),
            ("load_metallib tier, stand-in kernels", ShaderLibraryBackend("load_metallib", _NoopLibrary()))]
        for tier, backend in tiers:
            wall, cpu = _step_times(opt, params, size, dtype, repeats, backend)
            if backend is None and not backends.get_backend("cpu").name == "cpu":
                continue  # the kernel-alone time needs the compiled _cpu kernel, which did not load here
            if backend is None:
                kernel = min(_kernel_times(opt, params, repeats))
                row = dict(optimizer=label, backend=tier, step_minus_kernel_us=(min(wall) - kernel) * us)
                print(f"| {label} | {tier} (kernel alone {kernel * us:.2f}) | {row['step_minus_kernel_us']:.2f} | | |",
                      flush=True)
            else:
                row = dict(optimizer=label, backend=tier, fastest_us=min(wall) * us,
                           median_cpu_us=statistics.median(cpu) * us)
                print(f"| {label} | {tier} | | {row['fastest_us']:.2f} | {row['median_cpu_us']:.2f} |", flush=True)
            rows.append(row)
        bumps = _bump_times(params, repeats)
        row = dict(optimizer=label, backend="version-counter bump alone", fastest_us=min(bumps) * us,
                   median_us=statistics.median(bumps) * us)
        print(f"| {label} | {row['backend']} (median {row['median_us']:.3f}) | | {row['fastest_us']:.3f} | |",
              flush=True)
        rows.append(row)
    return rows
