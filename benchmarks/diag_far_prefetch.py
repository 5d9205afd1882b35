"""Diagnostic: the CPU kernel's far prefetch (a second prefetch of each stream into L2,
``_cpu.far_prefetch_bytes()``, src/cpu/dispatch.cpp) against the near prefetch alone. Ours and the
trivial-math floor, each with and without it, all four in one interleaved run per case, on the
same tensors; Adam in its three dtype cases, Lion and Adagrad in fp32 and bf16. Speeds are
relative to the floor without the far prefetch (above 1 is faster); "ours/floor" compares ours
with the floor of the same prefetch.

``python benchmarks/diag_far_prefetch.py [--size N] [--threads 1 4 16] [--repeats R] [--far BYTES] [--dtypes bf16/bf16 ...]``
(``--far``: the distance to measure, for every case; default 8 times the near distance, the choice
on Intel for fp32 states)."""
import argparse
import os
import platform

import torch

from mps_fused_adam import _cpu
from mps_fused_adam.tools import bench_rules
from mps_fused_adam.tools.bench import DTYPE_CASES, _contenders, _params
from mps_fused_adam.tools.timing import interleaved


def at(far, fn):
    def run():
        _cpu.set_far_prefetch_bytes(far)
        fn()
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 26)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count()}))
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--far", type=int, default=None)
    ap.add_argument("--dtypes", nargs="+", default=None, help="only these cases, e.g. bf16/bf16")
    a = ap.parse_args()
    print(f"# {platform.machine()}, {_cpu.simd_path()}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"flat {a.size} elements, median of {a.repeats} interleaved rounds")
    print("| rule | dtypes | threads | far bytes | ours, near only | ours, near + far | floor, near + far "
          "| ours/floor, near only | ours/floor, near + far | floor ns/elem, near only |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cases = [("adam", label, pd, sd) for label, pd, sd in DTYPE_CASES]
    cases += [(rule, label, pd, pd) for rule in ("lion", "adagrad")
              for label, pd in (("fp32", torch.float32), ("bf16/bf16", torch.bfloat16))]
    cases = [c for c in cases if a.dtypes is None or c[1] in a.dtypes]
    for rule, label, pd, sd in cases:
        params = _params(1, a.size, pd)
        found = (_contenders(params, pd, sd, deepspeed=False, foreach=False) if rule == "adam"
                 else bench_rules._contenders(rule, params, pd, sd))
        near = _cpu.prefetch_bytes(torch.finfo(pd).bits // 8, torch.finfo(sd).bits // 8)
        far = a.far if a.far is not None else 8 * near
        for threads in a.threads:
            torch.set_num_threads(threads)
            c = {"ours off": at(0, found["ours"]), "ours on": at(far, found["ours"]),
                 "floor off": at(0, found["floor"]), "floor on": at(far, found["floor"])}
            try:
                t = interleaved(c, a.repeats)
            finally:
                _cpu.set_far_prefetch_bytes(None)
            f0 = t["floor off"]
            print(f"| {rule} | {label} | {threads} | {far} | {f0 / t['ours off']:.3f} | {f0 / t['ours on']:.3f} | "
                  f"{f0 / t['floor on']:.3f} | {t['floor off'] / t['ours off']:.3f} | "
                  f"{t['floor on'] / t['ours on']:.3f} | {f0 / a.size * 1e9:.3f} |", flush=True)
        del found, params


if __name__ == "__main__":
    main()
