"""Diagnostic: how the CPU 8-bit kernel dequantizes a block (``_cpu.set_q8_permute_dequant``,
adam8bit_kernel.h). With AVX512_VBMI (the avx512bf16 path) the 256 codes of a block go through
the map by byte permutes, 64 at a time; off, by one gather per 16 codes, as the avx512 and avx2
paths do. ``AdamW8bit``'s step with the permutes on and off, and the 8-bit memory floor, all in one
interleaved run on the same tensors, fp32 and bf16 params; then the kernel alone on an
L2-resident tensor at 1 thread (the arithmetic alone, no memory stalls).

``python benchmarks/diag_q8_dequant.py [--size N] [--threads 1 2] [--repeats R]``"""
import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import mps_fused_adam as mfa  # noqa: E402
from mps_fused_adam import _cpu
from mps_fused_adam.numerics import lowbit  # noqa: E402
from mps_fused_adam.numerics.contract import AdamHyper  # noqa: E402
from mps_fused_adam.optimizers.eight_bit import _PARAM_CODES  # noqa: E402
from mps_fused_adam.tools.timing import alternated_best, interleaved  # noqa: E402
from lowbit import _floor8  # noqa: E402


def permutes(on, fn):
    def run():
        _cpu.set_q8_permute_dequant(on)
        fn()
    return run


def kernel_args(p, st, threads):
    """_cpu.adam8bit_step's arguments for ``p`` and its 8-bit state ``st``, rounding to nearest."""
    return [p.data_ptr(), p.grad.data_ptr()] + [st[k].data_ptr() for k in (
        "exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")] + [
        p.numel(), _PARAM_CODES[p.dtype], lowbit.kernel_table(True).data_ptr(), lowbit.kernel_table(False).data_ptr(),
        lowbit.pack_adam8bit(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 5)), 0, False, threads]


def optimizer(size, dtype):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(size).to(dtype))
    p.grad = (torch.randn(size) * 1e-2).to(dtype)
    opt = mfa.AdamW8bit([p])
    for _ in range(3):  # states with realistic codes, not the first step's
        opt.step()
    return p, opt


def in_cache(dtype, n=65536, calls=40):
    """ns per element of one thread stepping an L2-resident tensor of n elements: best call of
    ``calls``, permutes on and off alternated."""
    p, opt = optimizer(n, dtype)
    args = kernel_args(p, opt.state[p], 1)
    best = alternated_best(_cpu.set_q8_permute_dequant, lambda: [_cpu.adam8bit_step(*args) for _ in range(8)],
                           calls=calls)
    _cpu.set_q8_permute_dequant(True)
    return {on: t / (8 * n) * 1e9 for on, t in best.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 24)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count()}))
    ap.add_argument("--repeats", type=int, default=11)
    a = ap.parse_args()
    print(f"# {platform.machine()}, {_cpu.simd_path()}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"AdamW8bit, flat {a.size} elements, median of {a.repeats} interleaved rounds; ns per element")
    print("| params | threads | gathers | permutes | 8-bit floor | permutes vs gathers | speed vs floor (permutes) |")
    print("|---|---|---|---|---|---|---|")
    try:
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            p, opt = optimizer(a.size, dtype)
            c = {"off": permutes(False, opt.step), "on": permutes(True, opt.step), "floor": _floor8(opt)}
            for threads in a.threads:
                torch.set_num_threads(threads)
                t = {k: v / a.size * 1e9 for k, v in interleaved(c, a.repeats).items()}
                print(f"| {name} | {threads} | {t['off']:.3f} | {t['on']:.3f} | {t['floor']:.3f} | "
                      f"{t['off'] / t['on']:.2f}x | {t['floor'] / t['on']:.2f} |", flush=True)
            del p, opt, c
        torch.set_num_threads(1)
        print("\nL2-resident, 1 thread (65,536 elements, 8 steps per call; best of 40 calls):\n")
        print("| params | gathers | permutes | permutes vs gathers |")
        print("|---|---|---|---|")
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            r = in_cache(dtype)
            print(f"| {name} | {r[False]:.3f} | {r[True]:.3f} | {r[False] / r[True]:.2f}x |", flush=True)
    finally:
        _cpu.set_q8_permute_dequant(True)


if __name__ == "__main__":
    main()
