"""Diagnostic: the CPU kernel's software prefetch distance, chosen per CPU vendor and dtypes
(``_cpu.prefetch_bytes()``, src/cpu/dispatch.cpp). Ours and the memory floor at each distance,
with DeepSpeed's ``DeepSpeedCPUAdam`` when importable, all in one interleaved run per case (the
distance is set before each call), so the ratios compare like with like on a noisy machine.

``python benchmarks/diag_prefetch.py [--size N] [--threads 1 2] [--distances 0 1024] [--repeats R]``"""
import argparse
import os
import platform

import torch

from mps_fused_adam import _cpu
from mps_fused_adam.tools.bench import DTYPE_CASES, _contenders, _params
from mps_fused_adam.tools.timing import interleaved


def at(distance, fn):
    def run():
        _cpu.set_prefetch_bytes(distance)
        fn()
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 26)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count()}))
    ap.add_argument("--distances", type=int, nargs="+", default=[0, 1024])
    ap.add_argument("--repeats", type=int, default=11)
    a = ap.parse_args()
    print(f"# {platform.machine()}, {_cpu.simd_path()}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"flat {a.size} elements, median of {a.repeats} interleaved rounds; ns per element")
    d = a.distances
    print("| dtypes | threads | " + " | ".join(f"ours {x}" for x in d) + " | " + " | ".join(f"floor {x}" for x in d) +
          " | deepspeed | best distance for ours | default here |")
    print("|---|---|" + "---|" * (2 * len(d) + 3))
    for threads in a.threads:
        torch.set_num_threads(threads)
        for label, pd, sd in DTYPE_CASES:
            found = _contenders(_params(1, a.size, pd), pd, sd, deepspeed=True, foreach=False)
            c = {}
            for x in d:
                c[f"ours {x}"] = at(x, found["ours"])
                c[f"floor {x}"] = at(x, found["floor"])
            if "deepspeed cpu_adam" in found:
                c["deepspeed"] = found["deepspeed cpu_adam"]
            try:
                t = {k: v / a.size * 1e9 for k, v in interleaved(c, a.repeats).items()}
            finally:
                _cpu.set_prefetch_bytes(None)  # back to the per-vendor choice
            best = min(d, key=lambda x: t[f"ours {x}"])
            ds = f"{t['deepspeed']:.3f}" if "deepspeed" in t else "-"
            print(f"| {label} | {threads} | " + " | ".join(f"{t[f'ours {x}']:.3f}" for x in d) + " | " +
                  " | ".join(f"{t[f'floor {x}']:.3f}" for x in d) +
                  f" | {ds} | {best} | {_cpu.prefetch_bytes(pd.itemsize, sd.itemsize)} |", flush=True)


if __name__ == "__main__":
    main()
