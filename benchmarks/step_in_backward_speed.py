"""Training-step time with ``step_in_backward=True`` against the plain step of the same optimizer.

    python benchmarks/step_in_backward_speed.py
    python benchmarks/step_in_backward_speed.py --out benchmarks/results/step_in_backward_<machine>.txt

The model: ``--blocks`` residual MLP blocks (LayerNorm, Linear(d, 4d), GELU, Linear(4d, d): six
tensors each; default 10 blocks of d = 512, 60 tensors, 21M parameters), batch ``--batch`` rows.
A step is forward, backward, ``step()`` and ``zero_grad()``. Both contenders train identical
copies of the model in one process, interleaved: each round runs ``--steps`` steps of one, then of
the other (the order alternates by round). Per contender the round's time is the median of its
steps; the figure is the median over rounds, and the ratio is taken per round (in-backward over
plain) and its median reported with its range. Shared machines: compare the ratio, not the times.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

CONFIGS = {
    "adamw-fp32": ("AdamW, fp32 params", torch.float32),
    "adamw8bit-fp32": ("AdamW8bit, fp32 params", torch.float32),
    "adamw-bf16-sr": ("AdamW(bf16_stochastic_round=True), bf16 params", torch.bfloat16),
    "adamw8bit-bf16-sr": ("AdamW8bit(bf16_stochastic_round=True), bf16 params", torch.bfloat16),
}
# On a CPU without native bf16 matrix instructions torch's bf16 matmuls take most of a bf16 step
# (seconds here), which would hide the optimizer: the default compares fp32 models.
DEFAULT_CONFIGS = ["adamw-fp32", "adamw8bit-fp32"]


def make_model(blocks: int, width: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(width, dtype=dtype)
            self.up = torch.nn.Linear(width, 4 * width, dtype=dtype)
            self.down = torch.nn.Linear(4 * width, width, dtype=dtype)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    return torch.nn.Sequential(*[Block() for _ in range(blocks)])


def make_optimizer(config: str, model: torch.nn.Module, in_backward: bool) -> torch.optim.Optimizer:
    import mps_fused_adam as mfa
    if config == "adamw-fp32":
        return mfa.AdamW(model.parameters(), lr=1e-4, step_in_backward=in_backward)
    if config == "adamw8bit-fp32":
        return mfa.AdamW8bit(model.parameters(), lr=1e-4, step_in_backward=in_backward)
    if config == "adamw-bf16-sr":
        return mfa.AdamW(model.parameters(), lr=1e-4, bf16_stochastic_round=True, step_in_backward=in_backward)
    return mfa.AdamW8bit(model.parameters(), lr=1e-4, bf16_stochastic_round=True, step_in_backward=in_backward)


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> list[float]:
    times = []
    for x in xs:
        t0 = time.perf_counter()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def measure(config: str, args: argparse.Namespace) -> dict[str, Any]:
    dtype = CONFIGS[config][1]
    contenders = {}
    for in_backward in (False, True):
        model = make_model(args.blocks, args.width, dtype)
        contenders[in_backward] = (model, make_optimizer(config, model, in_backward))
    ntensors = sum(1 for _ in contenders[False][0].parameters())
    nparams = sum(p.numel() for p in contenders[False][0].parameters())
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(args.batch, args.width, generator=gen).to(dtype) for _ in range(args.steps)]
    for model, opt in contenders.values():
        train_steps(model, opt, xs[:2])  # first steps: state creation, plans, caches
    per_round: dict[bool, list[float]] = {False: [], True: []}
    ratios = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for in_backward in order:
            model, opt = contenders[in_backward]
            per_round[in_backward].append(statistics.median(train_steps(model, opt, xs)))
        ratios.append(per_round[True][-1] / per_round[False][-1])
    return {"config": config, "tensors": ntensors, "params": nparams,
            "plain_ms": statistics.median(per_round[False]) * 1e3,
            "in_backward_ms": statistics.median(per_round[True]) * 1e3,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", help="also write the report to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from memory import emit, machine, versions
    results = [measure(c, args) for c in args.configs]
    lines = ["# step_in_backward=True against the plain step (benchmarks/step_in_backward_speed.py)",
             f"machine: {machine()}, {torch.get_num_threads()} torch threads", f"versions: {versions()}",
             f"model: {args.blocks} residual MLP blocks of width {args.width} ({results[0]['tensors']} tensors, "
             f"{results[0]['params'] / 1e6:.1f}M params), batch {args.batch}; {args.rounds} interleaved rounds of "
             f"{args.steps} steps per contender", "",
             "| optimizer | plain step (ms) | step_in_backward (ms) | ratio, median of rounds (min-max) |",
             "| --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {CONFIGS[r['config']][0]} | {r['plain_ms']:.1f} | {r['in_backward_ms']:.1f} | "
                     f"{r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) |")
    emit("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
