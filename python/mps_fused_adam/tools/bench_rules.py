"""Benchmark of the one-state rules: ``python -m mps_fused_adam.tools.bench_rules [--quick] [--threads N ...]``.

The one-state rules of contract.RULES (Lion, Adagrad) move param, grad and one state per element
(3 reads, 2 in-place writes). Each case times, interleaved (timing.py): ours (the rule's optimizer
class, contract.Example.optimizer: ``Lion``/``Adagrad``, or with fp32
states of bf16 params, which only DeepSpeed's CPU ops ask for, one backend call as those ops make),
the memory floor of that access pattern (the kernel's own span loop and thread pool with trivial
math: rule ``floor1``), and torch's ``Adagrad`` (``foreach`` and ``fused``) and lion_pytorch's
``Lion`` where installed, all on the same params, grads and state tensors (bench.py says why).
Only ratios within one run mean anything on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

import torch

import mps_fused_adam

from .. import backend_info
from ..backends import get_backend
from .bench import (DTYPE_CASES, HEADER, Row, _floor_fn, _params, _print_rows, floor_available, floor_missing_note,
                    positive_int, share_states)
from .bench_mps import bench_hyper
from ..numerics.contract import RULES, example
from .timing import bytes_per_elem, interleaved

# The rules this benchmark runs: those with one state (the floor, rule ``floor1``, has one).
ONE_STATE_RULES = [name for name, r in RULES.items() if len(r.states) == 1]
HYPER = {name: bench_hyper(name, 1) for name in ONE_STATE_RULES}


def _contenders(rule: str, params, pdtype, sdtype) -> dict[str, Callable[[], None]]:
    """Ours, the floor and the others, all on the same params, grads and state (bench._floor_fn)."""
    found: dict[str, Callable[[], None]] = {}
    name = RULES[rule].states[0]
    if sdtype == pdtype:
        ours = getattr(mps_fused_adam, example(rule).optimizer)(params)  # the class's defaults, as torch's below
        ours.step()  # creates the state the others then share
        states = [ours.state[p][name] for p in params]
        found["ours"] = ours.step
    else:
        states = [torch.zeros_like(p, dtype=sdtype) for p in params]
        backend, grads = get_backend("cpu"), [p.grad for p in params]
        found["ours"] = lambda: backend.update(rule, params, grads, [states], HYPER[rule])
    if floor_available():
        found["floor"] = _floor_fn(params, [states], pdtype, sdtype, rule="floor1")
    others: dict[str, torch.optim.Optimizer] = {}
    if sdtype == pdtype and rule == "adagrad":
        others["torch foreach"] = torch.optim.Adagrad(params, foreach=True)
        try:
            fused = torch.optim.Adagrad(params, fused=True)
            fused.step()
            others["torch fused"] = fused
        except Exception as exc:  # a torch without a CPU fused Adagrad: report and go on
            print(f"  (torch fused Adagrad unavailable: {exc!r})")
    if sdtype == pdtype and rule == "lion":
        try:
            import lion_pytorch
            others["lion_pytorch"] = lion_pytorch.Lion(params, lr=1e-4, weight_decay=0.01)
        except ImportError:
            pass
    for label, opt in others.items():
        opt.step()
        share_states(opt, params, {name: states})  # torch's Adagrad and lion_pytorch use our key names
        found[label] = opt.step
    return found


def rules_section(rules: list[str], flat: int, many: tuple[int, int], thread_counts: list[int],
                  repeats: int) -> list[Row]:
    rows: list[Row] = []
    shapes = [(f"flat {flat / 2**20:g}M", 1, flat), (f"{many[0]} x {many[1] // 1024}K", many[0], many[1])]
    start_threads = torch.get_num_threads()
    try:
        for rule in rules:
            for label, pd, sd in DTYPE_CASES:
                for case, count, size in shapes:
                    params = _params(count, size, pd)
                    contenders = _contenders(rule, params, pd, sd)
                    numel = count * size
                    for threads in thread_counts:
                        torch.set_num_threads(threads)
                        t = interleaved(contenders, repeats)
                        for name, secs in t.items():
                            rows.append(Row(f"{rule} {case}", label, threads, name, secs / numel * 1e9,
                                            bytes_per_elem(pd, sd, states=1) * numel / secs / 1e9,
                                            t["floor"] / secs if "floor" in t else None,
                                            t["torch fused"] / secs if "torch fused" in t else None))
                        _print_rows(rows[-len(t):])
                    del contenders, params
    finally:
        torch.set_num_threads(start_threads)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--rules", nargs="*", default=ONE_STATE_RULES, choices=ONE_STATE_RULES)
    ap.add_argument("--threads", type=positive_int, nargs="*", help="thread counts (default: 1 and all)")
    ap.add_argument("--repeats", type=positive_int, help="interleaved rounds per case")
    args = ap.parse_args(argv)
    all_threads = os.cpu_count() or 1
    threads = args.threads or sorted({1, all_threads})
    info = backend_info()["cpu"]
    print(f"CPU backend: {info['backend']} ({info.get('simd', '-')}), torch {torch.__version__}, {all_threads} CPUs; "
          f"load average {os.getloadavg()[0]:.1f} at start")
    if not floor_available():
        print(floor_missing_note())
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|")
    flat, many, repeats = (8 * 2**20, (128, 65536), 3) if args.quick else (64 * 2**20, (1000, 65536), 7)
    rules_section(args.rules, flat, many, threads, args.repeats if args.repeats is not None else repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
