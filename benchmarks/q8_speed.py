"""The 8-bit CPU step against its memory floor and against AdamW with bf16 states, for one or more
builds of the package: ``python benchmarks/q8_speed.py [--threads 1 16] [--rounds 3]
[--build before=/path/a --build after=/path/b]``.

Each round runs every build once, in a fresh process (the builds alternate, their order turning
each round), and each process times, at each thread count, on 16M-element flat tensors (bf16 and
fp32 params): ``AdamW8bit``, its memory floor (the kernel's own blocks, threads and bytes with
trivial math, on the optimizer's very tensors: lowbit.py's ``_floor8``) and our ``AdamW`` (bf16
params: bf16 states; fp32 params: fp32 states), interleaved, the median of ``--repeats`` calls.
A build is a directory put first on ``sys.path`` (a ``pip install --target``); without
``--build`` the installed package runs. The table gives, per build, the median over the rounds
of the per-round medians, and the ratios round by round (their median, lowest and highest)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def _one_process(threads: list[int], size: int, repeats: int) -> dict:
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mps_fused_adam as mfa
    from mps_fused_adam import _cpu
    from mps_fused_adam.tools.timing import interleaved_rounds
    from lowbit import _floor8

    out: dict = {"simd": _cpu.simd_path(), "module": mfa.__file__}
    for th in threads:
        torch.set_num_threads(th)
        contenders = {}
        for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(size).to(dtype))
            p.grad = (torch.randn(size) * 1e-2).to(dtype)
            q = torch.nn.Parameter(p.detach().clone())
            q.grad = p.grad.clone()
            opt8, opt = mfa.AdamW8bit([p]), mfa.AdamW([q])
            opt8.step()
            opt.step()
            contenders[f"AdamW8bit {tag}"] = opt8.step
            contenders[f"8-bit floor {tag}"] = _floor8(opt8)
            contenders[f"AdamW {tag}"] = opt.step
        rounds = interleaved_rounds(contenders, repeats)
        out[str(th)] = {k: statistics.median(v) / size * 1e9 for k, v in rounds.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--size", type=int, default=1 << 24)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--build", action="append", default=[], help="NAME=DIR, a pip install --target")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_one_process(args.threads, args.size, args.repeats)))
        return
    builds = [b.split("=", 1) for b in args.build] or [["installed", ""]]
    results: dict[str, list[dict]] = {name: [] for name, _ in builds}
    t0 = time.time()
    for r in range(args.rounds):
        order = builds[r % len(builds):] + builds[:r % len(builds)]
        for name, path in order:
            env = dict(os.environ)
            if path:
                env["PYTHONPATH"] = os.pathsep.join([path] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--size", str(args.size), "--repeats",
                   str(args.repeats), "--threads", *map(str, args.threads)]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = [f"{cpu}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.rounds} rounds of one process per build "
             f"({time.time() - t0:.0f} s), {args.size} elements, median of {args.repeats} interleaved calls per process",
             "", "ns/elem: the median over the rounds; 'of floor': floor / step, and 'vs AdamW': AdamW / step, "
             "round by round (median, lowest to highest)", ""]
    for name, _ in builds:
        lines.append(f"build {name}: SIMD path {results[name][0]['simd']}")
    for th in args.threads:
        lines += ["", f"### {th} thread(s)", "", "| build | contender | ns/elem | of floor | vs AdamW |",
                  "| --- | --- | --- | --- | --- |"]
        for name, _ in builds:
            runs = [res[str(th)] for res in results[name]]
            for key in runs[0]:
                tag = key.split()[-1]
                med = statistics.median(run[key] for run in runs)

                def ratio(other: str) -> str:
                    rs = sorted(run[other] / run[key] for run in runs)
                    return f"{statistics.median(rs):.2f} ({rs[0]:.2f} to {rs[-1]:.2f})"
                lines.append(f"| {name} | {key} | {med:.3f} | {ratio(f'8-bit floor {tag}')} | "
                             f"{ratio(f'AdamW {tag}') if key.startswith('AdamW8bit') else '-'} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
