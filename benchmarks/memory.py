"""Peak memory per parameter of a real training step, one configuration per process.

    python benchmarks/memory.py                      # every configuration, CPU, the model below
    python benchmarks/memory.py --out benchmarks/results/memory_<machine>.txt
    python benchmarks/memory.py --configs torch-adamw-bf16 ours-adamw8bit-sr-inbwd
    python benchmarks/memory.py --device mps         # Apple Silicon (untested on Apple hardware)

The model: ``--layers`` bias-free ``Linear(--width, --width)`` (default 8 x 2048 x 2048 = 33.5M
parameters) in the configuration's dtype, batch ``--batch`` (4): activations are a few hundred KB,
so the figure is the parameters, gradients and optimizer states.

Method (each configuration in a fresh process, so nothing of another is counted):

1. a warm-up: two training steps of a one-layer model of the same width with the same optimizer
   (loads what a first step loads: kernels, libraries, compiled graphs), then everything freed;
2. the baseline: the process's resident memory now (CPU: ``VmRSS``; MPS:
   ``torch.mps.driver_allocated_memory()``), and the peak reset (CPU: ``/proc/self/clear_refs``);
3. the model is built and trained for ``--steps`` steps (forward, backward, ``step()``,
   ``zero_grad()``);
4. bytes per parameter = (peak - baseline) / parameters. CPU: the kernel's peak resident size
   (``VmHWM``), with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns freed large blocks
   to the system (set by this script for the children). MPS: the largest of the driver's
   allocation read after each forward, backward and step (a peak inside backward is not seen).

Step time: the median over the steps after the first, in the same process (shared machines: read
it as a rough figure; the speed comparison of step_in_backward is benchmarks/step_in_backward_speed.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

CONFIGS: dict[str, str] = {
    "torch-adamw-fp32": "torch.optim.AdamW, fp32 params",
    "torch-adamw-bf16": "torch.optim.AdamW, bf16 params (bf16 states)",
    "ours-adamw-fp32": "AdamW, fp32 params",
    "ours-adamw-bf16": "AdamW, bf16 params (bf16 states)",
    "ours-adamw-sr": "AdamW(bf16_stochastic_round=True), bf16",
    "ours-adamw-sr-inbwd": "AdamW(bf16_stochastic_round=True, step_in_backward=True), bf16",
    "ours-adamw8bit": "AdamW8bit, bf16 params",
    "ours-adamw8bit-sr": "AdamW8bit(bf16_stochastic_round=True), bf16",
    "ours-adamw8bit-sr-inbwd": "AdamW8bit(bf16_stochastic_round=True, step_in_backward=True), bf16",
    "ours-adamw4bit": "AdamW4bit, bf16 params",
    "ours-adamw4bit-sr": "AdamW4bit(bf16_stochastic_round=True), bf16",
    "ours-adamw4bit-sr-inbwd": "AdamW4bit(bf16_stochastic_round=True, step_in_backward=True), bf16",
    "hooks-adamw8bit-sr": "AdamW8bit(bf16_stochastic_round=True), one per param, stepped from hand-written hooks",
    "bnb-adamw8bit": "bitsandbytes.optim.AdamW8bit, bf16 params",
    "torchao-adamw8bit": "torchao.optim.AdamW8bit, bf16 params",
}


def _optimizer(config: str, params: Any) -> Any:
    import torch
    import mps_fused_adam as mfa
    lr = 1e-4
    if config.startswith("torch-adamw"):
        return torch.optim.AdamW(params, lr=lr)
    if config.startswith("ours-adamw4bit"):
        return mfa.AdamW4bit(params, lr=lr, bf16_stochastic_round="-sr" in config,
                             step_in_backward=config.endswith("-inbwd"))
    if config.startswith("ours-adamw8bit"):
        return mfa.AdamW8bit(params, lr=lr, bf16_stochastic_round="-sr" in config,
                             step_in_backward=config.endswith("-inbwd"))
    if config.startswith("ours-adamw"):
        return mfa.AdamW(params, lr=lr, bf16_stochastic_round="-sr" in config,
                         step_in_backward=config.endswith("-inbwd"))
    if config == "hooks-adamw8bit-sr":
        return _hand_hooks(params, lambda p: mfa.AdamW8bit([p], lr=lr, bf16_stochastic_round=True))
    if config == "bnb-adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=lr)
    if config == "torchao-adamw8bit":
        from torchao.optim import AdamW8bit
        return AdamW8bit(params, lr=lr)
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


class _NoStep:
    """What the training loop calls when hand-written hooks did the stepping."""

    def __init__(self, keep: Any) -> None:
        self.keep = keep

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _hand_hooks(params: Any, make: Callable[[Any], Any]) -> _NoStep:
    """PyTorch's recipe ("How to save memory by fusing the optimizer step into the backward
    pass"): one optimizer per parameter, stepped from its post-accumulate-grad hook, which frees
    the grad. The reference point of step_in_backward."""
    optimizers = {}

    def hook(p: Any) -> None:
        optimizers[p].step()
        p.grad = None
    for p in params:
        optimizers[p] = make(p)
        p.register_post_accumulate_grad_hook(hook)
    return _NoStep(optimizers)


def _dtype(config: str) -> Any:
    import torch
    return torch.float32 if config.endswith("-fp32") else torch.bfloat16


def _proc_status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class CpuMeter:
    """Resident memory of this process (Linux): current, and the peak since :meth:`reset`."""

    def now(self) -> int:
        return _proc_status("VmRSS")

    def reset(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size (Linux 4.0+)

    def sample(self) -> None:
        pass

    def peak(self) -> int:
        return _proc_status("VmHWM")


class MpsMeter:
    """The MPS driver's allocation, sampled at the points the training step gives (untested on
    Apple hardware)."""

    def __init__(self) -> None:
        import torch
        self._torch = torch
        self._peak = 0

    def now(self) -> int:
        self._torch.mps.synchronize()
        return int(self._torch.mps.driver_allocated_memory())

    def reset(self) -> None:
        self._peak = self.now()

    def sample(self) -> None:
        self._peak = max(self._peak, self.now())

    def peak(self) -> int:
        return self._peak


def _train(model: Any, opt: Any, steps: int, width: int, batch: int, dtype: Any, device: str,
           meter: Any, sync: Callable[[], None]) -> list[float]:
    import torch
    gen = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        x = torch.randn(batch, width, generator=gen).to(device=device, dtype=dtype)
        sync()
        t0 = time.perf_counter()
        loss = model(x).float().pow(2).mean()
        meter.sample()
        loss.backward()
        meter.sample()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        meter.sample()
    return times


def _model(layers: int, width: int, dtype: Any, device: str) -> Any:
    import torch
    torch.manual_seed(0)
    # Made in their dtype and on their device: no fp32 copy of the whole model is ever counted.
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False, dtype=dtype, device=device)
                                 for _ in range(layers)])


def child(config: str, layers: int, width: int, batch: int, steps: int, device: str) -> dict[str, Any]:
    """One configuration, measured in this process (see the module docstring)."""
    import torch
    dtype = _dtype(config)
    meter = MpsMeter() if device == "mps" else CpuMeter()
    sync = torch.mps.synchronize if device == "mps" else (lambda: None)
    warm = _model(1, width, dtype, device)
    warm_opt = _optimizer(config, warm.parameters())
    t0 = time.perf_counter()
    _train(warm, warm_opt, 2, width, batch, dtype, device, meter, sync)
    warm_s = time.perf_counter() - t0
    del warm, warm_opt
    gc.collect()
    baseline = meter.now()
    meter.reset()
    model = _model(layers, width, dtype, device)
    opt = _optimizer(config, model.parameters())
    n = sum(p.numel() for p in model.parameters())
    times = _train(model, opt, steps, width, batch, dtype, device, meter, sync)
    peak = meter.peak()
    return {"config": config, "params": n, "baseline_bytes": baseline, "peak_bytes": peak,
            "bytes_per_param": (peak - baseline) / n, "step_s": statistics.median(times[1:] or times),
            "first_step_s": times[0], "warmup_s": warm_s}


def machine() -> str:
    """The CPU's model name and core count (lscpu), or the platform's description."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        model = fields.get("Model name", "?").strip()
        cpus = fields.get("CPU(s)", "?").strip()
        return f"{model}, {cpus} CPUs ({platform.machine()}, {platform.system()})"
    except (OSError, subprocess.CalledProcessError):
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs ({platform.system()})"


def versions() -> str:
    import importlib.metadata as md
    found = []
    for dist in ("torch", "mps-fused-adam", "bitsandbytes", "torchao"):
        try:
            found.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            found.append(f"{dist} not installed")
    return ", ".join(found)


def emit(report: str, out: str | None) -> None:
    """Print a benchmark's report, and write it to ``out`` as well where one is given."""
    print(report)
    if out:
        with open(out, "w") as f:
            f.write(report)


def run_child(config: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--layers", str(args.layers),
           "--width", str(args.width), "--batch", str(args.batch), "--steps", str(args.steps),
           "--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"config": config, "error": f"exit {proc.returncode}: {tail[0][:160]}"}
    return json.loads(lines[-1])


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| configuration | what | bytes per param | peak - baseline (MB) | step (ms) |",
            "| --- | --- | --- | --- | --- |"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['config']} | {CONFIGS[r['config']]} | did not run: {r['error']} | | |")
            continue
        rows.append(f"| {r['config']} | {CONFIGS[r['config']]} | {r['bytes_per_param']:.2f} | "
                    f"{(r['peak_bytes'] - r['baseline_bytes']) / 1e6:.0f} | {r['step_s'] * 1e3:.0f} |")
    return "\n".join(rows)


MODEL_SIZES = (1e9, 3e9, 7e9, 13e9)
MEMORY_GB = (16, 24, 32, 36, 48, 64, 96, 128, 192)  # unified memory sizes of Apple Silicon Macs
USABLE = 0.7  # the share of unified memory the "what fits" table lets the step take (an assumption)


def read_results(path: str) -> list[tuple[str, float]]:
    """``(configuration, bytes per param)`` of each measured row of a report this script wrote."""
    rows = []
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 5 and cells[0] in CONFIGS:
                try:
                    rows.append((cells[0], float(cells[2])))
                except ValueError:
                    pass  # a configuration that did not run
    return rows


def fits_tables(rows: list[tuple[str, float]]) -> str:
    """The docs' tables from measured bytes per param: GiB a step needs for each model size
    (activations excluded), and the smallest unified memory where that is at most ``USABLE`` of it."""
    sizes = " | ".join(f"{n / 1e9:.0f}B" for n in MODEL_SIZES)
    need = [f"| configuration | bytes per param | {sizes} |", "| --- | --- |" + " --- |" * len(MODEL_SIZES)]
    fits = [f"| configuration | {sizes} |", "| --- |" + " --- |" * len(MODEL_SIZES)]
    for config, bpp in rows:
        gib = [bpp * n / 2 ** 30 for n in MODEL_SIZES]
        need.append(f"| {CONFIGS[config]} | {bpp:.2f} | " + " | ".join(f"{g:.1f} GiB" for g in gib) + " |")
        smallest = [next((f"{m} GB" for m in MEMORY_GB if g <= USABLE * m), f"> {MEMORY_GB[-1]} GB") for g in gib]
        fits.append(f"| {CONFIGS[config]} | " + " | ".join(smallest) + " |")
    return "\n".join(need) + "\n\n" + "\n".join(fits) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cpu", choices=["cpu", "mps"])
    ap.add_argument("--out", help="also write the report to this file")
    ap.add_argument("--tables", metavar="REPORT", help="print the docs' memory tables from a report and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tables:
        print(fits_tables(read_results(args.tables)), end="")
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.width, args.batch, args.steps, args.device)))
        return 0
    results = []
    for config in args.configs:
        results.append(run_child(config, args))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    n = next((r["params"] for r in results if "params" in r), 0)
    head = [f"# Peak memory per parameter of a training step ({args.device})",
            f"machine: {machine()}", f"versions: {versions()}, Python {platform.python_version()}",
            f"model: {args.layers} x bias-free Linear({args.width}, {args.width}) = {n / 1e6:.1f}M params, batch "
            f"{args.batch}, {args.steps} steps; each configuration in its own process (benchmarks/memory.py)",
            "bytes per param = (peak - baseline) / params; baseline after a warm-up of a one-layer model with the "
            "same optimizer; " + ("CPU: VmHWM after clear_refs, MALLOC_MMAP_THRESHOLD_=65536" if args.device == "cpu"
                                  else "MPS: driver_allocated_memory() sampled after forward, backward and step"),
            "step: median wall time of the steps after the first (forward + backward + step + zero_grad)", ""]
    emit("\n".join(head) + table(results) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
