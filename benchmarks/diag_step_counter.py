"""What keeping ``state['step']`` as torch's 0-dim tensor would cost our step path (issue 28).

One process, one optimizer per case, the contenders interleaved round by round; each round keeps
each contender's fastest step (shared machines deschedule a process for milliseconds at a time),
and the table gives the median over rounds:

- ``int``: ours as shipped (the step writes a Python int into each param's state dict);
- ``+fill_``: the same step, then each param's 0-dim step tensor set to the count (``fill_``, one
  torch call per tensor: the cheapest per-tensor way to keep such tensors current from Python);
- ``+foreach_add_``: the same step, then ``torch._foreach_add_(steps, 1)``, what torch's own
  optimizers call on their step tensors.

The tensor updates run after our step, so each row's difference to ``int`` is what a live tensor
count would add, at least (a native write by address, the other way, would need the cached plans
to prove each step tensor's identity, address and value every step: not built). Cases: 1000
tensors of 64K elements, fp32 and bf16 (AdamW, real CPU kernel), and 1000 of 16 elements, where
the step path is most of the time. Grads are set once and kept (planned steps).

    python benchmarks/diag_step_counter.py [--rounds 7]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import mps_fused_adam as mfa


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _case(count: int, size: int, dtype: torch.dtype):
    params = [torch.nn.Parameter(torch.randn(size).to(dtype)) for _ in range(count)]
    for p in params:
        p.grad = torch.full((size,), 1e-3, dtype=dtype)
    opt = mfa.AdamW(params, lr=1e-3)
    for _ in range(3):  # state made, plans built and used
        opt.step()
    steps = [torch.tensor(0.0) for _ in params]
    return opt, steps


def _time(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls: on a shared machine the least disturbed one."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    print(f"machine: {_cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    cases = [("1000 x 64K fp32", 1000, 65536, torch.float32, 8), ("1000 x 64K bf16", 1000, 65536, torch.bfloat16, 8),
             ("1000 x 16 fp32", 1000, 16, torch.float32, 100)]
    print("| case | int: ms/step | +fill_: ms/step | +foreach_add_: ms/step | +fill_ us/tensor | "
          "+foreach_add_ us/tensor |")
    print("|---|---|---|---|---|---|")
    for label, count, size, dtype, repeats in cases:
        opt, steps = _case(count, size, dtype)

        def with_fill() -> None:
            opt.step()
            n = opt.state[opt.param_groups[0]["params"][0]]["step"]
            for t in steps:
                t.fill_(n)

        def with_foreach() -> None:
            opt.step()
            torch._foreach_add_(steps, 1)

        rows: dict[str, list[float]] = {"int": [], "fill": [], "foreach": []}
        for _ in range(args.rounds):  # interleaved: each round times the three once, in turn
            rows["int"].append(_time(opt.step, repeats))
            rows["fill"].append(_time(with_fill, repeats))
            rows["foreach"].append(_time(with_foreach, repeats))
        med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
        per = {k: (med[k] - med["int"]) * 1e3 / count for k in ("fill", "foreach")}
        print(f"| {label} | {med['int']:.3f} | {med['fill']:.3f} | {med['foreach']:.3f} | {per['fill']:.2f} | "
              f"{per['foreach']:.2f} |", flush=True)
        del opt, steps
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
