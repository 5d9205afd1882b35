"""Diagnostic (issues 10 and 11): how much of a step is the kernel and how much the step path.

For Lion and Adagrad (flat 64M and 1000 x 64K, fp32 and bf16), four contenders on the same
tensors, interleaved round by round:
- ``opt.step()`` as a training loop calls it (the step entry, the step plan's check of every
  tensor, then the kernel);
- the very kernel call that step makes (``CPUBackend.update`` with the same tensors, their
  addresses gathered beforehand as the step plan has them, the same hyperparameters: nothing else);
- the same step through torch's own step wrapper (``Optimizer.profile_hook_step``: hooks and a
  ``record_function`` range every step), which ``step_entry.py`` skips when no hook or profiler
  observes the step;
- the memory floor (``bench._floor_fn``, as ``bench_rules`` runs it).
Each call follows another contender that has streamed the step's tensors through the caches, as
in the benchmark, so the step path's Python and shim reads run cold. ns per element are medians of
the rounds; the ratios and differences are medians of the round-by-round values.

``python benchmarks/diag_step_path.py [--threads 1 2] [--repeats R] [--rules lion adagrad]``"""
import argparse
import os
import platform
import statistics

import torch

from mps_fused_adam import Adagrad, Lion
from mps_fused_adam.backends import get_backend
from mps_fused_adam.tools.bench import _floor_fn, _params
from mps_fused_adam.tools.bench_rules import HYPER
from mps_fused_adam.optimizers.step_plan import _addressed
from mps_fused_adam.tools.timing import interleaved_rounds

CASES = [("flat 64M", 1, 64 << 20), ("1000 x 64K", 1000, 64 << 10)]
STEP, KERNEL, TORCH, FLOOR = "opt.step()", "kernel call", "through torch's wrapper", "floor"


def contenders(rule: str, params):
    opt = Lion(params, lr=1e-4, weight_decay=0.01) if rule == "lion" else Adagrad(params)
    opt.step()  # makes the states and the step plan
    states = [opt.state[p]["exp_avg" if rule == "lion" else "sum"] for p in params]
    # Addressed lists, as the planned step passes them: no data_ptr() call per tensor here.
    params_a = _addressed(params, [p.data_ptr() for p in params], with_numels=True)
    grads_a = _addressed([p.grad for p in params], [p.grad.data_ptr() for p in params])
    states_a = _addressed(states, [t.data_ptr() for t in states])
    backend, hp = get_backend("cpu"), HYPER[rule]
    through_torch = torch.optim.Optimizer.profile_hook_step(type(opt).step.__wrapped__)
    dtype = params[0].dtype
    return {STEP: opt.step, KERNEL: lambda: backend.update(rule, params_a, grads_a, [states_a], hp),
            TORCH: lambda: through_torch(opt), FLOOR: _floor_fn(params, [states], dtype, dtype, rule="floor1")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="*", default=[1, os.cpu_count() or 1])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rules", nargs="*", default=["lion", "adagrad"])
    args = ap.parse_args()
    print(f"# {platform.machine()}, torch {torch.__version__}, {os.cpu_count()} CPUs; ns per element, medians of "
          f"{args.repeats} interleaved rounds")
    print("| rule | case | dtype | threads | step | kernel call | floor | kernel vs floor | step vs floor | "
          "step minus kernel call, us | torch's wrapper minus step, us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    med = statistics.median
    start = torch.get_num_threads()
    try:
        for rule in args.rules:
            for dtype in (torch.float32, torch.bfloat16):
                for case, count, size in CASES:
                    params = _params(count, size, dtype)
                    fns = contenders(rule, params)
                    n = count * size
                    for threads in args.threads:
                        torch.set_num_threads(threads)
                        t = interleaved_rounds(fns, args.repeats)
                        ns = {k: med(v) / n * 1e9 for k, v in t.items()}
                        rounds = list(zip(t[STEP], t[KERNEL], t[TORCH], t[FLOOR]))
                        print(f"| {rule} | {case} | {str(dtype)[6:]} | {threads} | {ns[STEP]:.3f} | {ns[KERNEL]:.3f} | "
                              f"{ns[FLOOR]:.3f} | {med(f / k for s, k, w, f in rounds):.2f} | "
                              f"{med(f / s for s, k, w, f in rounds):.2f} | {med((s - k) * 1e6 for s, k, w, f in rounds):.0f} | "
                              f"{med((w - s) * 1e6 for s, k, w, f in rounds):.0f} |", flush=True)
                    del fns, params
    finally:
        torch.set_num_threads(start)


if __name__ == "__main__":
    main()
