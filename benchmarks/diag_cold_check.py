"""Diagnostic (issue 10): the step plan's check with warm and with cold caches.

1000 params of 64K elements (AdamW, fp32); after a few steps, times ``GroupPlan.check`` right
after another check (warm) and right after sweeping 2 GiB through the caches, as a step of the
kernel over 1 GiB of params, grads and moments does (cold). ``python benchmarks/diag_cold_check.py``"""
import statistics
import time

import torch

import mps_fused_adam as mfa

K, S = 1000, 1 << 16
torch.manual_seed(0)
ps = [torch.nn.Parameter(torch.randn(S)) for _ in range(K)]
for p in ps:
    p.grad = torch.randn(S)
opt = mfa.AdamW(ps)
for _ in range(3):
    opt.step()
plan = opt._plans[0].native
big = torch.empty(1 << 29)  # 2 GiB of fp32
warm, cold = [], []
for _ in range(15):
    big.add_(1.0)  # evicts the caches
    t0 = time.perf_counter()
    plan.check(ps, [], [], torch.get_num_threads())
    t1 = time.perf_counter()
    plan.check(ps, [], [], torch.get_num_threads())
    t2 = time.perf_counter()
    cold.append(t1 - t0)
    warm.append(t2 - t1)
print(f"threads {torch.get_num_threads()}, shim {plan.uses_handles}: check per tensor, median of 15: "
      f"warm {statistics.median(warm) / K * 1e6:.2f} us, cold {statistics.median(cold) / K * 1e6:.2f} us")
