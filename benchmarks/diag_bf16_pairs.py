"""Diagnostic: the CPU kernel's bf16 pair path (``_cpu.set_bf16_pairs``, adam_kernel.h): with bf16
params and states, each stream's 2W values load as their even and odd elements (one load and two
bit operations instead of two widening loads) and store back in one conversion. Ours and the
memory floor with the path on and off, all four in one interleaved run per case on the same
tensors, for Adam, Lion and Adagrad; then the same kernels on L2-resident data at 1 thread (the
arithmetic alone, no memory stalls), which bounds what any thread count can reach.

``python benchmarks/diag_bf16_pairs.py [--size N] [--threads 1 2] [--repeats R]``"""
import argparse
import os
import platform

import torch

from mps_fused_adam import _cpu
from mps_fused_adam.tools import bench_rules
from mps_fused_adam.tools.bench import _DTYPE_CODES, _contenders, _params
from mps_fused_adam.numerics.contract import RULES, AdamHyper, LionHyper
from mps_fused_adam.tools.timing import alternated_best, interleaved

BF16 = torch.bfloat16


def pairs(on, fn):
    def run():
        _cpu.set_bf16_pairs(on)
        fn()
    return run


def contenders(rule, size):
    params = _params(1, size, BF16)
    if rule == "adam":
        return _contenders(params, BF16, BF16, deepspeed=False, foreach=False)
    return bench_rules._contenders(rule, params, BF16, BF16)


def in_cache(rule, n=16384, reps=128):
    """ns per element of one thread on n elements (L2-resident) passed `reps` times in one call."""
    kernel = {"adam": "adam", "adam floor": "floor", "lion": "lion", "adagrad": "adagrad", "floor1": "floor1"}[rule]
    states = 2 if kernel in ("adam", "floor") else 1
    p, g = torch.randn(n).to(BF16), (torch.randn(n) * 1e-2).to(BF16)
    st = [(torch.rand(n) * 1e-3).to(BF16) for _ in range(states)]
    blob = (RULES["adam"].pack(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 1)) if states == 2 else
            RULES["lion"].pack(LionHyper(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.01)) if kernel != "adagrad"
            else RULES["adagrad"].pack(bench_rules.HYPER["adagrad"]))
    args = ([p.data_ptr()] * reps, [g.data_ptr()] * reps, [[s.data_ptr()] * reps for s in st], [n] * reps,
            _DTYPE_CODES[BF16], _DTYPE_CODES[BF16], blob, 1)
    best = alternated_best(_cpu.set_bf16_pairs, lambda: _cpu.step(kernel, *args))
    _cpu.set_bf16_pairs(True)
    return {on: t / (n * reps) * 1e9 for on, t in best.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 26)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count()}))
    ap.add_argument("--repeats", type=int, default=11)
    a = ap.parse_args()
    print(f"# {platform.machine()}, {_cpu.simd_path()}, torch {torch.__version__}, {os.cpu_count()} CPUs; bf16 params "
          f"and states, flat {a.size} elements, median of {a.repeats} interleaved rounds; ns per element")
    print("| rule | threads | ours, pairs off | ours, pairs on | floor, off | floor, on | ours on vs off | "
          "speed vs floor (on) |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for rule in ("adam", "lion", "adagrad"):
            found = contenders(rule, a.size)
            c = {"off": pairs(False, found["ours"]), "on": pairs(True, found["ours"]),
                 "floor off": pairs(False, found["floor"]), "floor on": pairs(True, found["floor"])}
            for threads in a.threads:
                torch.set_num_threads(threads)
                t = {k: v / a.size * 1e9 for k, v in interleaved(c, a.repeats).items()}
                print(f"| {rule} | {threads} | {t['off']:.3f} | {t['on']:.3f} | {t['floor off']:.3f} | "
                      f"{t['floor on']:.3f} | {t['off'] / t['on']:.2f}x | {t['floor on'] / t['on']:.2f} |", flush=True)
        torch.set_num_threads(1)
        print("\nL2-resident, 1 thread (16K elements passed 128 times per call; best of 40 calls):\n")
        print("| kernel | pairs off | pairs on | on vs off |")
        print("|---|---|---|---|")
        for rule in ("adam", "adam floor", "lion", "adagrad", "floor1"):
            r = in_cache(rule)
            print(f"| {rule} | {r[False]:.3f} | {r[True]:.3f} | {r[False] / r[True]:.2f}x |", flush=True)
    finally:
        _cpu.set_bf16_pairs(True)


if __name__ == "__main__":
    main()
