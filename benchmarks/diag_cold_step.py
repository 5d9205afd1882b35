"""Diagnostic (issue 10): ours' AdamW step and the memory floor with cold caches, flat and many tensors.

Each timed call follows a 2 GiB sweep, as a step follows forward and backward passes (or the
benchmark's other contenders); flat 64M and 1000 x 64K, fp32 and bf16 params and states, 15
interleaved rounds. Prints ns per element (medians), ours against the floor, and each against
itself from flat to 1000 x 64K. ``python benchmarks/diag_cold_step.py THREADS``"""
import statistics
import sys
import time

import torch

import mps_fused_adam as mfa
from mps_fused_adam.tools.bench import _floor_fn, _params

th = int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads()
torch.set_num_threads(th)
big = torch.empty(1 << 29)
for dt in (torch.float32, torch.bfloat16):
    cases = {}
    for label, count, size in (("flat", 1, 64 << 20), ("many", 1000, 1 << 16)):
        ps = _params(count, size, dt)
        opt = mfa.AdamW(ps, weight_decay=0.01)
        opt.step()
        opt.step()
        states = [[opt.state[p][k] for p in ps] for k in ("exp_avg", "exp_avg_sq")]
        cases[label] = {"ours": opt.step, "floor": _floor_fn(ps, states, dt, dt)}
    res = {(c, w): [] for c in cases for w in ("ours", "floor")}
    for _ in range(15):
        for c, fns in cases.items():
            for w, fn in fns.items():
                big.add_(1.0)
                t0 = time.perf_counter()
                fn()
                res[(c, w)].append(time.perf_counter() - t0)
    n = 64 << 20
    m = {k: statistics.median(v) / n * 1e9 for k, v in res.items()}
    print(f"threads {th} {str(dt)[6:]}: flat ours {m[('flat', 'ours')]:.3f} floor {m[('flat', 'floor')]:.3f} | "
          f"many ours {m[('many', 'ours')]:.3f} floor {m[('many', 'floor')]:.3f} | "
          f"ours/floor flat {m[('flat', 'floor')] / m[('flat', 'ours')]:.2f} "
          f"many {m[('many', 'floor')] / m[('many', 'ours')]:.2f} | "
          f"many vs flat ours {m[('many', 'ours')] / m[('flat', 'ours')] - 1:+.0%} "
          f"floor {m[('many', 'floor')] / m[('flat', 'floor')] - 1:+.0%}", flush=True)
    del cases
