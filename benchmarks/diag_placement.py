"""Diagnostic: does where a tensor sits in memory move the benchmark? Ours, the memory floor on
ours' very tensors (param, grad, moments) and the same floor loop on fresh copies of them,
interleaved (median of 11), per dtype case and thread count. On a virtual machine the copies can
sit on memory of different speed; that difference was once read as the kernel's distance from
the floor, so the benchmarks now run every contender on the same tensors (bench._floor_fn).
``python benchmarks/diag_placement.py [--size N] [--threads 1 2]``"""
import argparse
import os

import torch

import mps_fused_adam as mfa
from mps_fused_adam.tools.bench import DTYPE_CASES, _floor_fn, _params
from mps_fused_adam.tools.timing import interleaved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 26)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count()}))
    a = ap.parse_args()
    n = a.size
    print(f"# {os.cpu_count()} CPUs, torch {torch.__version__}, flat {n} elements; ns per element")
    print("| dtypes | threads | ours | floor on ours' tensors | floor on fresh copies |")
    print("|---|---|---|---|---|")
    for threads in a.threads:
        torch.set_num_threads(threads)
        for label, pd, sd in DTYPE_CASES:
            (p,) = _params(1, n, pd)
            ours = mfa.CPUAdam([p], fp32_optimizer_states=True) if sd != pd else mfa.AdamW([p], weight_decay=0.01)
            ours.step()
            st = ours.state[p]
            copy = torch.nn.Parameter(p.detach().clone())
            copy.grad = p.grad.clone()
            c = {"ours": ours.step,
                 "same": _floor_fn([p], [[st["exp_avg"]], [st["exp_avg_sq"]]], pd, sd),
                 "copies": _floor_fn([copy], [[st["exp_avg"].clone()], [st["exp_avg_sq"].clone()]], pd, sd)}
            t = {k: v / n * 1e9 for k, v in interleaved(c, 11).items()}
            print(f"| {label} | {threads} | {t['ours']:.3f} | {t['same']:.3f} | {t['copies']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
