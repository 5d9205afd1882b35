"""Diagnostic: torch's huge-page switch for CPU tensors (``THP_MEM_ALLOC_ENABLE=1``: its allocator
then aligns large tensors to 2 MiB and asks the kernel for transparent huge pages) and the CPU
Adam step. Where the system's THP mode is ``madvise`` (both machines here), tensors otherwise get
4 KiB pages. Ours and the Adam memory floor (the same tensors, trivial math) on one flat tensor,
in child processes with and without the switch, alternating; Linux only.

``python benchmarks/diag_thp.py [--size N] [--threads 1 2] [--rounds 2] [--steps 9]``"""
import argparse
import os
import statistics
import subprocess
import sys

import torch


def child(threads: int, dtype_name: str, size: int, steps: int) -> None:
    from mps_fused_adam import AdamW
    from mps_fused_adam.tools.bench import _floor_fn
    from mps_fused_adam.tools.timing import interleaved
    torch.set_num_threads(threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    p = torch.nn.Parameter(torch.randn(size).to(dtype))
    p.grad = (torch.randn(size) * 1e-2).to(dtype)
    opt = AdamW([p], weight_decay=0.01)
    opt.step()
    floor = _floor_fn([p], [[opt.state[p]["exp_avg"]], [opt.state[p]["exp_avg_sq"]]], dtype, dtype)
    t = interleaved({"ours": opt.step, "floor": floor}, steps)
    print(f"{t['ours'] / size * 1e9:.3f} {t['floor'] / size * 1e9:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 26)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count()}))
    ap.add_argument("--rounds", type=int, default=2, help="child processes per setting and case")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--child", nargs=2, metavar=("THREADS", "DTYPE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(int(a.child[0]), a.child[1], a.size, a.steps)
        return
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, transparent huge pages: {mode}; "
          f"flat {a.size} elements, bf16 and fp32 params and states; ns per element, median of {a.steps} "
          f"steps per process, {a.rounds} processes per setting, alternating")
    print("| dtypes | threads | ours, 4 KiB pages | ours, huge pages | floor, 4 KiB | floor, huge | ours huge vs 4 KiB |")
    print("|---|---|---|---|---|---|---|")
    for threads in a.threads:
        for dtype_name in ("bf16", "fp32"):
            got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for _ in range(a.rounds):
                for thp in (False, True):
                    env = dict(os.environ)
                    env.pop("THP_MEM_ALLOC_ENABLE", None)
                    if thp:
                        env["THP_MEM_ALLOC_ENABLE"] = "1"
                    out = subprocess.run([sys.executable, __file__, "--child", str(threads), dtype_name,
                                          "--size", str(a.size), "--steps", str(a.steps)],
                                         env=env, check=True, capture_output=True, text=True).stdout.split()
                    got[thp].append((float(out[0]), float(out[1])))
            med = {k: (statistics.median(o for o, _ in v), statistics.median(f for _, f in v)) for k, v in got.items()}
            print(f"| {dtype_name} | {threads} | {med[False][0]:.3f} | {med[True][0]:.3f} | {med[False][1]:.3f} | "
                  f"{med[True][1]:.3f} | {med[False][0] / med[True][0]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
