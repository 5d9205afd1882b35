"""Diagnostic (issue 10): is the 1000 x 64K penalty the tensors' separate allocations?

Ours (AdamW) and the memory floor on (a) one flat tensor, (b) 1000 separately allocated tensors,
(c) 1000 views of one buffer, the same elements in each, the floor on ours' tensors; interleaved,
median of 7. Prints the
transparent-huge-page mode, which decides whether large allocations get 2 MiB pages.
``python benchmarks/diag_many_tensors.py``"""
import torch

import mps_fused_adam as mfa
from mps_fused_adam.tools.bench import _floor_fn
from mps_fused_adam.tools.timing import interleaved

try:
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
except OSError:
    thp = "unknown"
print("transparent huge pages:", thp, "| torch", torch.__version__)
K = 1000
S = (1 << 26) // K // 64 * 64


def tensors(kind, dtype, count):
    """`count` lists of K tensors of S elements (one tensor of K * S for 'flat')."""
    out = []
    for _ in range(count):
        if kind == "flat":
            out.append([torch.randn(K * S).to(dtype)])
        elif kind == "separate":
            out.append([torch.randn(S).to(dtype) for _ in range(K)])
        else:
            buf = torch.randn(K * S).to(dtype)
            out.append([buf[i * S:(i + 1) * S] for i in range(K)])
    return out


def ours_and_floor(kind, dtype):
    """AdamW on the kind's tensors, and the memory floor on the same tensors (bench._floor_fn)."""
    (ts,) = tensors(kind, dtype, 1)
    ps = [torch.nn.Parameter(t) for t in ts]
    grads = tensors(kind, dtype, 1)[0]
    for p, g in zip(ps, grads):
        p.grad = g.mul_(1e-2)
    opt = mfa.AdamW(ps, weight_decay=0.01)
    opt.step()
    states = [[opt.state[p][name] for p in ps] for name in ("exp_avg", "exp_avg_sq")]
    return opt.step, _floor_fn(ps, states, dtype, dtype)


import os

for threads in sorted({1, min(4, os.cpu_count()), os.cpu_count()}):
    torch.set_num_threads(threads)
    for dtype in (torch.float32, torch.bfloat16):
        c = {}
        for kind in ("flat", "separate", "views"):
            c[f"ours {kind}"], c[f"floor {kind}"] = ours_and_floor(kind, dtype)
        t = interleaved(c, 7)
        print(f"{threads} threads, {str(dtype)[6:]}, ns/elem: " +
              ", ".join(f"{k} {v / (K * S) * 1e9:.3f}" for k, v in t.items()), flush=True)
