"""Diagnostic (issues 10 and 11): the CPU kernel's 512-bit and 256-bit builds side by side in one
process, each rule against each build's memory floor, flat 64M, on the same tensors.

On the 16-core Xeon, separate processes of the rules benchmark put the AVX2 build at 0.98 to 1.02
of its floor with fp32 states at 4 threads where the AVX-512 build reached 0.91 to 0.98 of its own
(benchmarks/isa_rules_xeon16.txt); but the floors themselves moved by up to 50% between those
processes. Here every contender runs round by round in one process (timing.interleaved_rounds),
the SIMD build switched per call (``_cpu.set_simd_path``), and each is reported against the faster
floor: the one that counts for the targets.

``python benchmarks/diag_isa_width.py [--threads 4 16] [--rounds 15] [--paths avx512bf16 avx2]``
"""
from __future__ import annotations

import argparse
import statistics

import torch

from mps_fused_adam import _cpu
from mps_fused_adam.backends import get_backend
from mps_fused_adam.tools.bench import _floor_fn, _params
from mps_fused_adam.numerics.contract import AdagradHyper, AdamHyper, LionHyper
from mps_fused_adam.tools.timing import interleaved_rounds, ratio_spread

HYPER = {"adam": AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10),
         "lion": LionHyper(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.01),
         "adagrad": AdagradHyper(lr=1e-2, eps=1e-10, weight_decay=0.0, step=10)}
STATES = {"adam": 2, "lion": 1, "adagrad": 1}
CASES = [("fp32", torch.float32, torch.float32), ("bf16/fp32-states", torch.bfloat16, torch.float32),
         ("bf16/bf16", torch.bfloat16, torch.bfloat16)]


def on_path(path: str, fn):
    def call() -> None:
        _cpu.set_simd_path(path)
        fn()
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--size", type=int, default=64 << 20)
    ap.add_argument("--paths", nargs="*", default=["avx512bf16", "avx2"])
    ap.add_argument("--rules", nargs="*", default=["lion", "adagrad", "adam"])
    args = ap.parse_args()
    paths = [p for p in args.paths if p in _cpu.simd_paths()]
    before = _cpu.simd_path()
    backend = get_backend("cpu")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads available, SIMD paths {paths}; "
          f"flat {args.size} elements, medians of {args.rounds} interleaved rounds; ratios are round by round "
          f"against the faster floor (median)")
    print("| rule | dtypes | threads | contender | ns/elem | speed vs faster floor |")
    print("|---|---|---|---|---|---|")
    try:
        for rule in args.rules:
            for label, pd, sd in CASES:
                params = _params(1, args.size, pd)
                grads = [p.grad for p in params]
                states = [[torch.zeros_like(p, dtype=sd) for p in params] for _ in range(STATES[rule])]
                if rule == "adagrad":
                    for s in states[0]:
                        s.fill_(1e-4)
                floor_rule = "floor" if STATES[rule] == 2 else "floor1"
                floor = _floor_fn(params, states, pd, sd, rule=floor_rule)
                contenders = {}
                for path in paths:
                    contenders[f"ours {path}"] = on_path(path, lambda: backend.update(rule, params, grads, states,
                                                                                      HYPER[rule]))
                    contenders[f"floor {path}"] = on_path(path, floor)
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    rounds = interleaved_rounds(contenders, args.rounds)
                    med = {k: statistics.median(v) for k, v in rounds.items()}
                    best_floor = min((k for k in med if k.startswith("floor")), key=med.get)
                    for name, ts in rounds.items():
                        ratio = ratio_spread(rounds[best_floor], ts)[0]
                        print(f"| {rule} | {label} | {threads} | {name} | {med[name] / args.size * 1e9:.3f} | "
                              f"{ratio:.2f} |", flush=True)
    finally:
        _cpu.set_simd_path(before)


if __name__ == "__main__":
    main()
