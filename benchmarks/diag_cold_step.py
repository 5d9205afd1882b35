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
from mps_fused_adam.bench import _floor_fn

th = int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads()
torch.set_num_threads(th)
big = torch.empty(1 << 29)
for dt in (torch.float32, torch.bfloat16):
    cases = {}
    for label, count, size in (("flat", 1, 64 << 20), ("many", 1000, 1 << 16)):
        ps = []
        for _ in range(count):
            p = torch.nn.Parameter(torch.randn(size).to(dt)); p.grad = (torch.randn(size) * 1e-2).to(dt); ps.append(p)
        opt = mfa.AdamW(ps, weight_decay=0.01); opt.step(); opt.step()
        st = [[opt.state[p][k] for p in ps] for k in ("exp_avg", "exp_avg_sq")]
        cases[label] = (opt.step, _floor_fn(ps, st, dt, dt), ps, opt)
    res = {(c, w): [] for c in cases for w in ("ours", "floor")}
    for _ in range(15):
        for c, (o, f, _, _) in cases.items():
            for w, fn in (("ours", o), ("floor", f)):
                big.add_(1.0); t0 = time.perf_counter(); fn(); res[(c, w)].append(time.perf_counter() - t0)
    n = 64 << 20
    med = {k: statistics.median(v) / n * 1e9 for k, v in res.items()}
    print(f"threads {th} {str(dt)[6:]}: flat ours {med[('flat','ours')]:.3f} floor {med[('flat','floor')]:.3f} | many ours {med[('many','ours')]:.3f} floor {med[('many','floor')]:.3f} | ours/floor flat {med[('flat','floor')]/med[('flat','ours')]:.2f} many {med[('many','floor')]/med[('many','ours')]:.2f} | many vs flat ours {med[('many','ours')]/med[('flat','ours')]-1:+.0%} floor {med[('many','floor')]/med[('flat','floor')]-1:+.0%}", flush=True)
    del cases
