"""Benchmark: ``python -m mps_fused_adam.bench [--quick] [--threads 1 4 16] [--no-deepspeed] [--plot out.png]
[--overhead]`` (``--help``).

CPU section: ours, ``torch.optim.AdamW(fused=True)``, ``torch.optim.AdamW(foreach=True)``,
DeepSpeed's ``DeepSpeedCPUAdam`` whenever it is importable (its first use JIT-builds for a minute
or two; ``--no-deepspeed`` leaves it out) and the memory floor (Adam's access pattern, 4 reads and
3 in-place writes, with trivial math, in our own loop and thread pool). Every contender of a case
works on the same params, grads and moments (the others' state tensors are pointed at ours): on a
virtual machine, separately allocated tensors can sit on memory of different speed. All contenders of a case
run interleaved, one step each in turn, and the median is kept: these machines are noisy, so only
ratios within one run mean anything. A summary then gives, per case, ours against the fastest of
the others and against the floor. Then the MPS section (``bench_mps``), which says "no MPS device"
off Apple Silicon.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import CPUAdam, AdamW, backend_info
from ..backends import _DTYPE_CODES
from ..numerics.contract import RULES, AdamHyper, LionHyper
from .timing import bytes_per_elem, interleaved_rounds, ratio_spread

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
    # The middle half (quartiles) of that ratio taken round by round: how far one round moves.
    vs_torch_fused_spread: Optional[tuple[float, float]] = None


def _params(count: int, size: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(size).to(dtype))
        p.grad = (torch.randn(size) * 1e-2).to(dtype)
        params.append(p)
    return params


def floor_available() -> bool:
    """The memory floor runs in the compiled CPU kernel's span loop (``_cpu``): where that did
    not load (the CPU backend is then the foreach tier), there is no floor to run."""
    from ..backends import get_backend
    return get_backend("cpu").name == "cpu"


def floor_missing_note() -> str:
    return (f"memory floor left out: it runs in the compiled CPU kernel, and the CPU backend here is "
            f"{backend_info()['cpu']['backend']!r} (backend_info() says why)")


def _floor_fn(params, states: list[list[torch.Tensor]], pdtype: torch.dtype, sdtype: torch.dtype,
              rule: str = "floor") -> Callable[[], None]:
    """The memory floor on the very tensors the optimizers use (``params``, their grads and
    ``states``: one list per state): the kernel's own span loop and threads with trivial math
    that keeps every value (rules.h, ``FloorRule``). Not on copies: on a virtual machine,
    separately allocated tensors can sit on memory of different speed (the 2-core EPYC: a floor
    on fresh copies ran up to 30% faster or slower than the same loop on the optimizer's tensors,
    benchmarks/diag_placement.py), which would be measured as the kernel's."""
    from .. import _cpu
    ptrs = ([p.data_ptr() for p in params], [p.grad.data_ptr() for p in params],
            [[t.data_ptr() for t in ts] for ts in states], [p.numel() for p in params])
    codes = (_DTYPE_CODES[pdtype], _DTYPE_CODES[sdtype])
    # The floor takes its rule's scalar struct and reads only a zero from it (weight_decay -
    # weight_decay, lr - lr), so its call is the rule's call.
    blob = (RULES["adam"].pack(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 1)) if rule == "floor" else
            RULES["lion"].pack(LionHyper(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.01)))
    keep = (params, states)
    return lambda: (keep, _cpu.step(rule, *ptrs, *codes, blob, torch.get_num_threads()))[1]


def share_states(opt: torch.optim.Optimizer, params, states: dict[str, list[torch.Tensor]]) -> None:
    """Point another optimizer's state tensors (after its first step made them) at ours, so that
    every contender reads and writes the same memory (see _floor_fn); each keeps its own step."""
    for i, p in enumerate(params):
        st = opt.state[p]
        for name, ts in states.items():
            if st[name].dtype != ts[i].dtype or st[name].shape != ts[i].shape:
                raise ValueError(f"{type(opt).__name__} state {name!r} is {st[name].dtype} {tuple(st[name].shape)}; "
                                 f"ours is {ts[i].dtype} {tuple(ts[i].shape)}")
            st[name] = ts[i]


def _contenders(params, pdtype, sdtype, deepspeed: bool, foreach: bool = True) -> dict[str, Callable[[], None]]:
    """Ours, the floor and the others, all on the same params, grads and moments."""
    ours = CPUAdam(params, fp32_optimizer_states=True) if sdtype != pdtype else AdamW(params, weight_decay=0.01)
    ours.step()  # makes the moments the others then share
    moments = {name: [ours.state[p][name] for p in params] for name in ("exp_avg", "exp_avg_sq")}
    found: dict[str, Callable[[], None]] = {OURS: ours.step}
    if floor_available():
        found[FLOOR] = _floor_fn(params, list(moments.values()), pdtype, sdtype)
    others: dict[str, torch.optim.Optimizer] = {}
    if sdtype == pdtype:  # torch keeps moments in the param dtype only
        others["torch fused"] = torch.optim.AdamW(params, weight_decay=0.01, fused=True)
        if foreach:
            others["torch foreach"] = torch.optim.AdamW(params, weight_decay=0.01, foreach=True)
    if deepspeed:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            others["deepspeed cpu_adam"] = DeepSpeedCPUAdam(params, weight_decay=0.01,
                                                            fp32_optimizer_states=sdtype == F32)
        except ImportError:
            pass  # not installed: nothing to compare with
        except Exception as exc:  # report and go on: DeepSpeed is a contender, not a requirement
            print(f"  (DeepSpeedCPUAdam unavailable: {exc!r})")
    for name, opt in others.items():
        opt.step()
        share_states(opt, params, moments)
        found[name] = opt.step
    return found


OURS, FLOOR = "ours", "floor"


def summary(rows: list[Row]) -> list[str]:
    """Per case: ours, the fastest other implementation, ours' speed relative to it (>1: ours is
    faster) and to the memory floor (1.0: at the floor). The floor ratio is ours' row's (the
    median of the round-by-round ratios, as printed per row) where the row has one, else the
    ratio of the medians."""
    lines = ["| case | dtypes | threads | ours ns/elem | fastest other | its ns/elem | ours vs it | ours vs floor |",
             "|---|---|---|---|---|---|---|---|"]
    cases = list(dict.fromkeys((r.case, r.dtypes, r.threads) for r in rows))
    for case in cases:
        by = {r.contender: r for r in rows if (r.case, r.dtypes, r.threads) == case}
        ours, floor = by[OURS], by.get(FLOOR)
        others = [r for name, r in by.items() if name not in (OURS, FLOOR)]
        best = min(others, key=lambda r: r.ns_per_elem) if others else None
        best_cells = (f"{best.contender} | {best.ns_per_elem:.3f} | {best.ns_per_elem / ours.ns_per_elem:.2f}x"
                      if best else "(none) | - | -")
        of_floor = (ours.of_floor if ours.of_floor is not None else
                    floor.ns_per_elem / ours.ns_per_elem if floor is not None else None)
        floor_cell = "-" if of_floor is None else f"{of_floor:.2f}"
        lines.append(f"| {case[0]} | {case[1]} | {case[2]} | {ours.ns_per_elem:.3f} | {best_cells} | {floor_cell} |")
    return lines


def cpu_section(flat: int, many: tuple[int, int], thread_counts: list[int], repeats: int,
                deepspeed: bool, foreach: bool = True, echo: bool = True) -> list[Row]:
    """Every dtype case on a flat tensor and on ``many`` (count, size) tensors, at each thread
    count; rows are printed as they come unless ``echo`` is false."""
    rows: list[Row] = []
    shapes = [(f"flat {flat / 2**20:g}M", 1, flat), (f"{many[0]} x {many[1] // 1024}K", many[0], many[1])]
    start_threads = torch.get_num_threads()
    try:
        for label, pd, sd in DTYPE_CASES:
            for case, count, size in shapes:
                params = _params(count, size, pd)
                contenders = _contenders(params, pd, sd, deepspeed, foreach)
                numel = count * size
                for threads in thread_counts:
                    torch.set_num_threads(threads)
                    rounds = interleaved_rounds(contenders, repeats)
                    for name, ts in rounds.items():
                        secs = statistics.median(ts)
                        # The floor is a yardstick, not a contender: no speed against torch for it.
                        vs_torch = (ratio_spread(rounds["torch fused"], ts)
                                    if "torch fused" in rounds and name != FLOOR else None)
                        rows.append(Row(case, label, threads, name, secs / numel * 1e9,
                                        bytes_per_elem(pd, sd) * numel / secs / 1e9,
                                        ratio_spread(rounds[FLOOR], ts)[0] if FLOOR in rounds else None,
                                        vs_torch and vs_torch[0], vs_torch and vs_torch[1:]))
                    if echo:
                        _print_rows(rows[-len(rounds):])
                del contenders, params
    finally:
        torch.set_num_threads(start_threads)
    return rows


HEADER = "| case | dtypes | threads | contender | ns/elem | GB/s | speed vs floor | speed vs torch fused |"


def _print_rows(rows: list[Row]) -> None:
    for r in rows:
        f = "-" if r.of_floor is None else f"{r.of_floor:.2f}"
        t = "-" if r.vs_torch_fused is None else f"{r.vs_torch_fused:.2f}x"
        if r.vs_torch_fused_spread and r.contender != "torch fused":
            t += f" ({r.vs_torch_fused_spread[0]:.2f}-{r.vs_torch_fused_spread[1]:.2f})"
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


# The main command's short run: 4M-element and 64 x 64K tensors, torch's slow foreach left out,
# and 21 rounds (each a few ms), aiming at a median ratio that moves by under about 5% between
# runs on an idle machine; on a busy one noise_note says the ratios are not to be trusted.
QUICK = dict(flat=4 * 2**20, many=(64, 65536), repeats=21, foreach=False)
FULL = dict(flat=64 * 2**20, many=(1000, 65536), repeats=7, foreach=True)
# Why the short run's "speed vs floor" reads lower than the docs' tables: measured on a 16-core
# Xeon (AVX-512), bf16/bf16 at 2 threads, ours of the floor was 0.40 (flat 4M) and 0.44
# (64 x 64K) against 0.95 (flat 64M) and 0.86 (1000 x 64K); its speed against torch fused was
# 1.2x to 2.3x at every size. The floor does trivial math, so it gains the most from the caches.
QUICK_SIZE_NOTE = ("sizes: 4M elements flat and 64 x 64K, small enough to take seconds and to sit largely in "
                   "this CPU's caches, where the memory floor runs faster than from DRAM: 'speed vs floor' reads "
                   "lower here than in the docs' tables (64M elements; on a 16-core Xeon, bf16: 0.40 at 4M, "
                   "0.95 at 64M). python -m mps_fused_adam.bench runs the tables' sizes")
SPREAD_NOTE = ("speed vs torch fused: the median of the ratios taken round by round; in brackets the middle "
               "half of those ratios (how much one round moves on this machine); above 1 is faster than torch")


def spread_note(repeats: int) -> str:
    """SPREAD_NOTE for a run of ``repeats`` rounds: with fewer than 4 there are no quartiles, and
    the brackets hold the lowest and the highest ratio instead (timing.ratio_spread)."""
    if repeats >= 4:
        return SPREAD_NOTE
    return SPREAD_NOTE.replace("the middle half of those ratios",
                               f"the lowest and highest of those ratios (only {repeats} rounds: no quartiles)")


def median_uncertainty(row: Row, rounds: int) -> Optional[float]:
    """How far the median ratio of ``row`` against torch fused may be off, relative to it: the
    standard error of a median, 1.2533 sigma / sqrt(rounds), with sigma estimated from the
    round-to-round spread (interquartile range / 1.349; with fewer than 4 rounds the spread is
    the lowest to the highest ratio, taken as 2 sigma)."""
    if not row.vs_torch_fused_spread or not row.vs_torch_fused:
        return None
    lo, hi = row.vs_torch_fused_spread
    sigma = (hi - lo) / (1.349 if rounds >= 4 else 2.0)
    return 1.2533 * sigma / math.sqrt(max(rounds, 1)) / row.vs_torch_fused


NOISE_TOLERANCE = 0.075  # relative standard error of a median ratio above which a run is "busy"


def noise_note(rows: list[Row], rounds: int, tolerance: float = NOISE_TOLERANCE) -> Optional[str]:
    """A warning when this run's median ratios are uncertain by more than ``tolerance`` (one
    standard error, relative: a busy machine). Judged on the median, not on single rounds: on an idle shared VM single rounds
    still move by 8 to 12% (the note used to fire on every run there); a second
    process competing for the cores moves rounds by 30% and more. Rounds that move by +-12%
    (half the interquartile range) leave the median of 21 within 4.9%; +-30% leaves it within 12%."""
    errors = [e for r in rows if r.contender == OURS and (e := median_uncertainty(r, rounds)) is not None]
    if not errors or max(errors) <= tolerance:
        return None
    return (f"note: the speed ratios of this run are uncertain by up to +-{max(errors):.0%} (rounds moved a lot: "
            f"the machine is busy or throttling); rerun on an idle machine before drawing conclusions")


def positive_int(text: str) -> int:
    """argparse type for thread counts and rounds: 0 or a negative number used to fail minutes
    into the run (or, for --repeats 0, be ignored)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _require_matplotlib() -> None:
    """``--plot`` needs matplotlib: say so before minutes of benchmarking, not after."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib, which is not installed: pip install matplotlib "
                         "(or pip install 'mps-fused-adam[bench]')") from None


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mps_fused_adam.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, no torch foreach (the main command's benchmark)")
    ap.add_argument("--no-deepspeed", action="store_true",
                    help="leave DeepSpeedCPUAdam out (otherwise included when importable; JIT-builds on first use)")
    ap.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    ap.add_argument("--threads", type=positive_int, nargs="*",
                    help="thread counts, e.g. --threads 1 4 16 (default: 1 and all)")
    ap.add_argument("--repeats", type=positive_int, help="interleaved rounds per case")
    ap.add_argument("--plot", metavar="PNG", help="write a bar chart (needs matplotlib: the 'bench' extra)")
    ap.add_argument("--mps-only", action="store_true", help="run only the MPS section")
    ap.add_argument("--no-mps", action="store_true", help="skip the MPS section")
    ap.add_argument("--overhead", action="store_true", help="only the per-tensor cost of the step path (bench_overhead)")
    args = ap.parse_args(argv)
    # Options that a chosen section would ignore are usage errors: each used to run and exit 0
    # having silently done less than asked (--mps-only --no-mps ran nothing at all).
    if args.mps_only and args.no_mps:
        ap.error("--mps-only and --no-mps leave nothing to run")
    if args.overhead:
        for given, name in ((args.threads is not None, "--threads"), (args.plot, "--plot"),
                            (args.mps_only, "--mps-only"), (args.no_mps, "--no-mps")):
            if given:
                ap.error(f"{name} does not apply to --overhead (it takes --quick and --repeats)")
    elif args.mps_only:
        for given, name in ((args.threads is not None, "--threads"), (args.plot, "--plot")):
            if given:
                ap.error(f"{name} applies to the CPU section, which --mps-only leaves out")
    if args.plot:
        _require_matplotlib()
    if args.overhead:
        from .bench_overhead import overhead_section
        repeats = args.repeats if args.repeats is not None else 30 if args.quick else None
        overhead_section(**({} if repeats is None else {"repeats": repeats}))
        return 0
    all_threads = os.cpu_count() or 1
    threads = args.threads or sorted({1, all_threads})
    rows: list[Row] = []
    if not args.mps_only:
        info = backend_info()["cpu"]
        pool = "-"
        if floor_available():
            from .. import _cpu
            pool = _cpu.thread_pool()
        print(f"CPU backend: {info['backend']} ({info.get('simd', '-')}, threads: {pool}), "
              f"torch {torch.__version__}, {all_threads} CPUs, load average {os.getloadavg()[0]:.1f}")
        if not floor_available():
            print(floor_missing_note())
        size = dict(QUICK if args.quick else FULL)
        if args.repeats is not None:
            size["repeats"] = args.repeats
        print(spread_note(size["repeats"]))
        print(HEADER)
        print("|---|---|---|---|---|---|---|---|")
        rows = cpu_section(thread_counts=threads, deepspeed=not args.no_deepspeed, **size)
        note = noise_note(rows, size["repeats"])
        if note:
            print(note)
        print("\nPer case, ours against the fastest other implementation and the memory floor "
              "(speed ratios: >1 means ours is faster):")
        print("\n".join(summary(rows)))
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")
        t = first_step_seconds()
        print(f"\nimport to end of first step, 1M-parameter model: {t['total']:.2f} s (import torch "
              f"{t['import torch']:.2f} s, first forward/backward {t['first forward/backward']:.2f} s, "
              f"import mps_fused_adam + first step {t['mps_fused_adam']:.3f} s)")
        if args.plot:
            _plot(rows, args.plot)
    if not args.no_mps:
        from .bench_mps import mps_benchmark_section
        print()
        size = {"numel": 8 * 2**20, "repeats": 3} if args.quick else {}
        if args.repeats is not None:
            size["repeats"] = args.repeats
        mps_benchmark_section(**size)
    return 0
