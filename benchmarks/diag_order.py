"""Diagnostic (issue 10): does the order of the benchmark's contenders move ours against the floor?

The benchmark's fp32 Adam case, flat 64M, with every contender (bench._contenders, DeepSpeed
included where importable), timed 15 rounds each way: the contenders rotated every round (the
benchmark's order before it took a seeded permutation per round), shuffled every round, and
ours and the floor with only one other contender or none. Two repetitions; prints ours against
the floor (the median of the round-by-round ratios) and each contender's median ns per element.
``python benchmarks/diag_order.py THREADS``"""
import random, statistics, sys, time
import torch
from mps_fused_adam.tools.bench import _contenders, _params
from mps_fused_adam.tools.timing import ratio_spread
F32 = torch.float32
th = int(sys.argv[1]) if len(sys.argv) > 1 else 4
params = _params(1, 64 << 20, F32)
c = _contenders(params, F32, F32, deepspeed=True)
print("contenders", list(c))
torch.set_num_threads(th)
def run(names, order, rounds=15):
    for n in names: c[n]()
    times = {n: [] for n in names}
    rng = random.Random(1)
    for r in range(rounds):
        if order == "rotate":
            seq = names[r % len(names):] + names[:r % len(names)]
        else:
            seq = names[:]; rng.shuffle(seq)
        for n in seq:
            t0 = time.perf_counter(); c[n](); times[n].append(time.perf_counter() - t0)
    return times
allnames = list(c)
for rep in range(2):
    for label, names, order in [("all, rotation", allnames, "rotate"), ("all, shuffled", allnames, "shuffle"),
                                ("ours+floor, rotation", ["ours", "floor"], "rotate"),
                                ("ours, floor, deepspeed, rotation", ["ours", "floor", "deepspeed cpu_adam"], "rotate"),
                                ("ours, floor, torch fused, rotation", ["ours", "floor", "torch fused"], "rotate")]:
        t = run(names, order)
        med = {n: statistics.median(v) / (64 << 20) * 1e9 for n, v in t.items()}
        print(f"{th}T {label}: ours vs floor {ratio_spread(t['floor'], t['ours'])[0]:.3f}; " +
              ", ".join(f"{n} {v:.3f}" for n, v in med.items()), flush=True)
