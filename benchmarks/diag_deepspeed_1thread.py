"""Diagnostic (issue 10): at 1 thread on the 2-core EPYC DeepSpeed's fp32 CPU Adam beat ours. Is it
the memory placement of its state tensors or its kernel? Times ours, DeepSpeed and our kernel on
each one's states (same param and grad), interleaved. Needs DeepSpeed (its cpu_adam JIT-builds).
``python benchmarks/diag_deepspeed_1thread.py``"""
import torch
torch.set_num_threads(1)
import mps_fused_adam as mfa
from mps_fused_adam import _cpu
from mps_fused_adam.numerics.contract import RULES, AdamHyper
from mps_fused_adam.tools.timing import interleaved
from deepspeed.ops.adam import DeepSpeedCPUAdam
n = 1 << 26
torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(n)); p.grad = torch.randn(n) * 1e-2
ours = mfa.AdamW([p], weight_decay=0.01)
ds = DeepSpeedCPUAdam([p], weight_decay=0.01)
ours.step(); ds.step()
blob = RULES["adam"].pack(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 2))
def kernel_on(st):
    m, v = st["exp_avg"], st["exp_avg_sq"]
    args = ([p.data_ptr()], [p.grad.data_ptr()], [[m.data_ptr()], [v.data_ptr()]], [n], 0, 0, blob)
    return lambda: _cpu.step("adam", *args, 1)
c = {"ours.step": ours.step, "ds.step": ds.step, "our kernel on our states": kernel_on(ours.state[p]),
     "our kernel on DS states": kernel_on(ds.state[p])}
t = interleaved(c, 9)
for k, v in t.items(): print(f"{k:28s} {v / n * 1e9:.3f} ns/elem")
print("DS state keys", list(ds.state[p].keys()), ds.state[p]["exp_avg"].dtype)
