"""The 4-bit CPU step against its own memory floor: ``python benchmarks/lowbit4_speed.py [--size 16777216]
[--threads 1 16] [--repeats 15] [--out benchmarks/results/lowbit4_speed_<machine>.txt]``.

One flat tensor per param dtype (fp32, bf16), shared by every contender of that dtype, each run
through the CPU backend as the optimizers call it: the 4-bit step (``adam4bit``; bf16 also with
stochastic rounding), its memory floor (``_cpu.adam4bit_step(..., floor=True)``: the step's own
blocks, threads and bytes with trivial math that keeps every value, on the very same tensors),
and for scale the 8-bit step and its floor and Adam with bf16 states (bf16 params: the Adam element
math with no quantization, so its speed against the 4-bit bf16 floor bounds what any 4-bit kernel
with that math can reach). Contenders
interleaved in a fresh order each round; medians; the speed against the floor is the median of
the round-by-round ratios (floor time / step time), with the middle half of the rounds.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from mps_fused_adam import _cpu
from mps_fused_adam.backends import CPUBackend, _DTYPE_CODES
from mps_fused_adam.numerics import lowbit, lowbit4
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.tools.timing import interleaved_rounds, ratio_spread

HP = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 10)
KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")


def _state4(n: int) -> dict[str, torch.Tensor]:
    nb = lowbit4.num_blocks4(n)
    return {"exp_avg_codes": lowbit4.fresh_codes4(n, True), "exp_avg_absmax": torch.zeros(nb),
            "exp_avg_sq_codes": lowbit4.fresh_codes4(n, False), "exp_avg_sq_absmax": torch.zeros(nb)}


def _state8(n: int) -> dict[str, torch.Tensor]:
    nb = lowbit.num_blocks(n)
    return {"exp_avg_codes": torch.full((n,), lowbit.SIGNED_ZERO_CODE, dtype=torch.uint8),
            "exp_avg_absmax": torch.zeros(nb), "exp_avg_sq_codes": torch.zeros(n, dtype=torch.uint8),
            "exp_avg_sq_absmax": torch.zeros(nb)}


def contenders(size: int) -> dict:
    backend = CPUBackend()
    out = {}
    gen = torch.Generator().manual_seed(0)
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        p = torch.randn(size, generator=gen).to(dtype)
        g = (torch.randn(size, generator=gen) * 1e-2).to(dtype)
        s4, s8 = _state4(size), _state8(size)
        for rule, st, name in (("adam4bit", s4, "4-bit"), ("adam8bit", s8, "8-bit")):
            lists = [[st[k]] for k in KEYS]
            out[f"{name} step {tag}"] = (lambda r=rule, lst=lists: backend.update(r, [p], [g], lst, HP))
            if dtype is torch.bfloat16:
                key = [lowbit.sr_key(1, 1)]
                out[f"{name} step {tag} + stochastic rounding"] = (
                    lambda r=rule, lst=lists: backend.update(r, [p], [g], lst, HP, sr_keys=key))
            fn = _cpu.adam4bit_step if rule == "adam4bit" else _cpu.adam8bit_step
            tables = (lowbit4.kernel_table4 if rule == "adam4bit" else lowbit.kernel_table)
            args = [p.data_ptr(), g.data_ptr(), *(st[k].data_ptr() for k in KEYS), size, _DTYPE_CODES[dtype],
                    tables(True).data_ptr(), tables(False).data_ptr(), lowbit.pack_adam8bit(HP), 0, False]
            out[f"{name} floor {tag}"] = (lambda f=fn, a=args, keep=(p, g, st): f(*a, torch.get_num_threads(),
                                                                                   floor=True))
        if dtype is torch.bfloat16:
            m, v = torch.zeros(size, dtype=dtype), torch.zeros(size, dtype=dtype)
            out["AdamW bf16 states bf16"] = lambda: backend.update("adam", [p], [g], [[m], [v]], HP)
    return out


def measure(size: int, threads: int, repeats: int) -> list[str]:
    torch.set_num_threads(threads)
    fns = contenders(size)
    rounds = interleaved_rounds(fns, repeats)
    rows = [f"\n### {threads} thread(s)\n", "| contender | ns/elem | speed vs its floor (middle half) |",
            "| --- | --- | --- |"]
    for name, ts in rounds.items():
        t = statistics.median(ts)
        bits = "4-bit" if name.startswith("4-bit") else "8-bit" if name.startswith("8-bit") else None
        vs = "-"
        if bits and " step " in name:
            floor = f"{bits} floor {'bf16' if 'bf16' in name else 'fp32'}"
            mid, lo, hi = ratio_spread(rounds[floor], ts)
            vs = f"{mid:.2f} ({lo:.2f}-{hi:.2f})"
        elif name.startswith("AdamW"):  # the Adam math alone, no quantization: the 4-bit step's ceiling
            mid, lo, hi = ratio_spread(rounds["4-bit floor bf16"], ts)
            vs = f"{mid:.2f} ({lo:.2f}-{hi:.2f}) of the 4-bit bf16 floor"
        rows.append(f"| {name} | {t / size * 1e9:.3f} | {vs} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 24)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args()
    lines = [f"# 4-bit CPU step vs its memory floor ({platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} CPUs, SIMD path {_cpu.simd_path()}, torch {torch.__version__}, "
             f"load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             f"\nflat {args.size} elements, interleaved rounds, median of {args.repeats}"]
    for t in args.threads:
        lines += measure(args.size, t, args.repeats)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
