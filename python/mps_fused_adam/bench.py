"""Benchmark: ``python -m mps_fused_adam.bench [--quick] [--deepspeed] [--plot out.png]``.

CPU section: ours, ``torch.optim.AdamW(fused=True)``, ``torch.optim.AdamW(foreach=True)``,
DeepSpeed's ``DeepSpeedCPUAdam`` (with ``--deepspeed``: its first use JIT-builds for minutes) and
the memory floor (Adam's access pattern, 4 reads and 3 in-place writes, with trivial math, in our
own loop and thread pool). All contenders of a case run interleaved, one step each in turn, and
the median is kept: these machines are noisy, so only ratios within one run mean anything.
Then the MPS section (``bench_mps``), which says "no MPS device" off Apple Silicon.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import CPUAdam, AdamW, backend_info
from .backends import _DTYPE_CODES
from .contract import RULES, AdamHyper
from .timing import bytes_per_elem, interleaved

F32, BF16 = torch.float32, torch.bfloat16
DTYPE_CASES = [("fp32", F32, F32), ("bf16/bf16", BF16, BF16), ("bf16/fp32-states", BF16, F32)]


@dataclass
class Row:
    case: str
    dtypes: str
    threads: int
    contender: str
    ns_per_elem: float
    gbps: float
    of_floor: Optional[float]  # floor time / this time: 1.0 is the memory floor's speed
    vs_torch_fused: Optional[float]  # torch fused time / this time: >1 is faster than torch


def _params(count: int, size: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(size).to(dtype))
        p.grad = (torch.randn(size) * 1e-2).to(dtype)
        params.append(p)
    return params


def _floor_fn(opt: torch.optim.Optimizer, params, pdtype, sdtype) -> Callable[[], None]:
    from . import _cpu
    states = [opt.state[p] for p in params]
    ptrs = ([p.data_ptr() for p in params], [p.grad.data_ptr() for p in params],
            [[s["exp_avg"].data_ptr() for s in states], [s["exp_avg_sq"].data_ptr() for s in states]],
            [p.numel() for p in params])
    codes = (_DTYPE_CODES[pdtype], _DTYPE_CODES[sdtype])
    # The floor takes Adam's scalar struct (and ignores it), so its call is Adam's call.
    blob = RULES["adam"].pack(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1))
    return lambda: _cpu.step("floor", *ptrs, *codes, blob, torch.get_num_threads())


def _contenders(params, pdtype, sdtype, deepspeed: bool) -> dict[str, Callable[[], None]]:
    ours = CPUAdam(params, fp32_optimizer_states=True) if sdtype != pdtype else AdamW(params, weight_decay=0.01)
    ours.step()  # creates the state the floor loop walks over
    found: dict[str, Callable[[], None]] = {"ours": ours.step, "floor": _floor_fn(ours, params, pdtype, sdtype)}
    if sdtype == pdtype:  # torch keeps moments in the param dtype only
        found["torch fused"] = torch.optim.AdamW(params, weight_decay=0.01, fused=True).step
        found["torch foreach"] = torch.optim.AdamW(params, weight_decay=0.01, foreach=True).step
    if deepspeed:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            found["deepspeed cpu_adam"] = DeepSpeedCPUAdam(
                params, weight_decay=0.01, fp32_optimizer_states=sdtype == F32).step
        except Exception as exc:  # report and go on: DeepSpeed is a contender, not a requirement
            print(f"  (DeepSpeedCPUAdam unavailable: {exc!r})")
    return found


def cpu_section(flat: int, many: tuple[int, int], thread_counts: list[int], repeats: int,
                deepspeed: bool) -> list[Row]:
    rows: list[Row] = []
    shapes = [(f"flat {flat / 2**20:g}M", 1, flat), (f"{many[0]} x {many[1] // 1024}K", many[0], many[1])]
    start_threads = torch.get_num_threads()
    try:
        for label, pd, sd in DTYPE_CASES:
            for case, count, size in shapes:
                params = _params(count, size, pd)
                contenders = _contenders(params, pd, sd, deepspeed)
                numel = count * size
                for threads in thread_counts:
                    torch.set_num_threads(threads)
                    t = interleaved(contenders, repeats)
                    for name, secs in t.items():
                        rows.append(Row(case, label, threads, name, secs / numel * 1e9,
                                        bytes_per_elem(pd, sd) * numel / secs / 1e9,
                                        t["floor"] / secs, t["torch fused"] / secs if "torch fused" in t else None))
                    _print_rows(rows[-len(t):])
                del contenders, params
    finally:
        torch.set_num_threads(start_threads)
    return rows


HEADER = "| case | dtypes | threads | contender | ns/elem | GB/s | speed vs floor | speed vs torch fused |"


def _print_rows(rows: list[Row]) -> None:
    for r in rows:
        f = "-" if r.of_floor is None else f"{r.of_floor:.2f}"
        t = "-" if r.vs_torch_fused is None else f"{r.vs_torch_fused:.2f}x"
        print(f"| {r.case} | {r.dtypes} | {r.threads} | {r.contender} | {r.ns_per_elem:.3f} | {r.gbps:.1f} | {f} | {t} |",
              flush=True)


def first_step_seconds() -> dict[str, float]:
    """Seconds from interpreter start to the end of the first step of a 1M-parameter model, in a
    fresh process, split into importing torch, the model's first forward and backward (torch
    imports more on first use), and ours: importing mps_fused_adam plus the first step."""
    code = (
        "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter()\n"
        "m = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 24))\n"
        "m(torch.randn(8, 1000)).sum().backward(); t2 = time.perf_counter()\n"
        "import mps_fused_adam as mfa\n"
        "opt = mfa.AdamW(m.parameters()); opt.step(); t3 = time.perf_counter()\n"
        "print(t3 - t0, t1 - t0, t2 - t1, t3 - t2)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return dict(zip(("total", "import torch", "first forward/backward", "mps_fused_adam"), map(float, out)))


def _plot(rows: list[Row], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = sorted({(r.case, r.dtypes, r.threads) for r in rows}, key=lambda c: (c[1], c[0], c[2]))
    names = list(dict.fromkeys(r.contender for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, len(cases) * 1.2), 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [next((r.ns_per_elem for r in rows if (r.case, r.dtypes, r.threads) == c and r.contender == name), 0)
                for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], vals, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax.set_xticklabels([f"{c[1]}\n{c[0]}\n{c[2]} thr" for c in cases], fontsize=7)
    ax.set_ylabel("ns per element (lower is better)")
    ax.set_title("Adam step on CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (the main job's benchmark)")
    ap.add_argument("--deepspeed", action="store_true", help="include DeepSpeedCPUAdam (JIT-builds on first use)")
    ap.add_argument("--threads", type=int, nargs="*", help="thread counts (default: 1 and all)")
    ap.add_argument("--repeats", type=int, help="interleaved rounds per case")
    ap.add_argument("--plot", metavar="PNG", help="write a bar chart")
    ap.add_argument("--mps-only", action="store_true", help="run only the MPS section")
    ap.add_argument("--no-mps", action="store_true", help="skip the MPS section")
    args = ap.parse_args(argv)
    all_threads = os.cpu_count() or 1
    threads = args.threads or sorted({1, all_threads})
    rows: list[Row] = []
    if not args.mps_only:
        info = backend_info()["cpu"]
        print(f"CPU backend: {info['backend']} ({info.get('simd', '-')}), torch {torch.__version__}, {all_threads} CPUs")
        print(HEADER)
        print("|---|---|---|---|---|---|---|---|")
        flat, many, repeats = (8 * 2**20, (128, 65536), 3) if args.quick else (64 * 2**20, (1000, 65536), 7)
        rows = cpu_section(flat, many, threads, args.repeats or repeats, args.deepspeed)
        t = first_step_seconds()
        print(f"\nimport to end of first step, 1M-parameter model: {t['total']:.2f} s (import torch "
              f"{t['import torch']:.2f} s, first forward/backward {t['first forward/backward']:.2f} s, "
              f"import mps_fused_adam + first step {t['mps_fused_adam']:.3f} s)")
        if args.plot:
            _plot(rows, args.plot)
    if not args.no_mps:
        from .bench_mps import mps_benchmark_section
        print()
        mps_benchmark_section(**({"numel": 8 * 2**20, "repeats": 3} if args.quick else {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
