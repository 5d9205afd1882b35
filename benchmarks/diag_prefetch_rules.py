"""Diagnostic: the software prefetch distance for the one-state rules (Lion, Adagrad): ours and
their floor (rule floor1) at each distance, all in one interleaved run per case, on the same
tensors (bench_rules' contenders), at 1 and 2 threads (or the thread counts given), ns per element. The distance is chosen per
CPU vendor and param size (``_cpu.prefetch_bytes``, measured on Adam: benchmarks/diag_prefetch.py);
this checks that the choice holds for three streams instead of four.

``python benchmarks/diag_prefetch_rules.py [THREADS ...]``"""
import sys

import torch
from mps_fused_adam import _cpu
from mps_fused_adam.tools import bench_rules
from mps_fused_adam.tools.bench import _params
from mps_fused_adam.tools.timing import interleaved
def at(d, fn):
    def run():
        _cpu.set_prefetch_bytes(d); fn()
    return run
size = 1 << 26
dists = [0, 256, 512, 1024, 2048]
thread_counts = [int(a) for a in sys.argv[1:]] or [1, 2]
for rule in ("lion", "adagrad"):
    for label, pd, sd in [("bf16/bf16", torch.bfloat16, torch.bfloat16), ("fp32", torch.float32, torch.float32), ("bf16/fp32", torch.bfloat16, torch.float32)]:
        found = bench_rules._contenders(rule, _params(1, size, pd), pd, sd)
        for th in thread_counts:
            torch.set_num_threads(th)
            c = {}
            for d in dists:
                c[f"o{d}"] = at(d, found["ours"]); c[f"f{d}"] = at(d, found["floor"])
            t = {k: v / size * 1e9 for k, v in interleaved(c, 7).items()}
            _cpu.set_prefetch_bytes(None)
            print(f"{rule} {label} T={th} ours " + " ".join(f"{d}:{t[f'o{d}']:.3f}" for d in dists) + " | floor " + " ".join(f"{d}:{t[f'f{d}']:.3f}" for d in dists), flush=True)
