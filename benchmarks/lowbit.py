"""Low-bit options, measured: ``python benchmarks/lowbit.py [--steps 2000] [--size 16777216] [--out benchmarks/results/lowbit]``;
``python benchmarks/lowbit.py --lm [--steps 600]``: the transformer language model run (4., only).

1. Training curves (the longer version of tests/test_lowbit_training.py, plus bf16 with Kahan
   compensation in plain torch, for the decision on offering it): fp32 AdamW, AdamW8bit,
   bf16 + stochastic rounding, bf16 round-to-nearest, bf16 + Kahan, 8-bit + bf16 stochastic
   rounding; loss curves to <out>_curves.csv (drawn by plots.py), final losses to <out>.txt.
2. Optimizer-state bytes per parameter of each set-up.
3. CPU step time, one interleaved run over one flat tensor: torch.optim.AdamW(fused=True), ours
   AdamW, ours AdamW8bit, bitsandbytes' AdamW8bit and torchao's AdamW8bit where importable; bf16
   params with and without stochastic rounding (its overhead). The machine is shared: only ratios
   within one run mean anything, and the ratios against the floor and the stochastic-rounding
   overheads are taken round by round (their median, with the middle half of the rounds).
4. ``--lm``: a small decoder-only transformer language model built from :data:`LM_CONFIG` (no
   downloads: its corpus is sampled from a fixed random order-2 Markov source, so the best
   possible loss is known), trained for a few hundred steps with fp32 AdamW, AdamW8bit and
   AdamW4bit (fp32 params, and 4-bit with bf16 params + stochastic rounding), on the same
   minibatches; held-out loss curves to ``results/lowbit_lm_curves.csv`` (drawn by plots.py),
   final losses to ``results/lowbit_lm.txt``.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import mps_fused_adam as mfa  # noqa: E402
from mps_fused_adam.numerics import lowbit  # noqa: E402
from mps_fused_adam.tools.bench import share_states  # noqa: E402
from mps_fused_adam.numerics.contract import AdamHyper  # noqa: E402
from mps_fused_adam.optimizers.eight_bit import state_bytes_per_param  # noqa: E402
from mps_fused_adam.tools.timing import interleaved_rounds, ratio_spread  # noqa: E402
from test_lowbit_training import LR, make_student, make_task  # noqa: E402


class KahanBf16AdamW:
    """AdamW (no decay) on bf16 params with bf16 moments and a bf16 Kahan compensation buffer,
    as torch-optimi's ``kahan_sum`` (6 bytes of state per parameter), in plain torch."""

    def __init__(self, params, lr: float) -> None:
        self.params, self.lr, self.t = list(params), lr, 0
        self.state = {p: [torch.zeros_like(p) for _ in range(3)] for p in self.params}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        bc1, bc2 = 1 - 0.9 ** self.t, 1 - 0.999 ** self.t
        for p in self.params:
            m, v, comp = self.state[p]
            g = p.grad.float()
            m32 = 0.9 * m.float() + 0.1 * g
            v32 = 0.999 * v.float() + 0.001 * g * g
            m.copy_(m32)
            v.copy_(v32)
            y = -self.lr / bc1 * m32 / (v32.sqrt() / bc2 ** 0.5 + 1e-8) + comp.float()
            old = p.float()
            new = (old + y).to(torch.bfloat16)
            comp.copy_(y - (new.float() - old))  # what the bf16 store lost, added back next step
            p.copy_(new)


def train(kind: str, steps: int, seed: int = 1) -> list[float]:
    torch.manual_seed(seed)
    x, y = make_task()
    model = make_student(seed)
    bf16 = kind not in ("fp32", "8bit")
    model = model.to(torch.bfloat16 if bf16 else torch.float32)
    params = list(model.parameters())
    opt = {
        "fp32": lambda: mfa.AdamW(params, lr=LR, weight_decay=0.0),
        "8bit": lambda: mfa.AdamW8bit(params, lr=LR, weight_decay=0.0, min_8bit_size=1024),
        "bf16-sr": lambda: mfa.AdamW(params, lr=LR, weight_decay=0.0, bf16_stochastic_round=True),
        "bf16": lambda: mfa.AdamW(params, lr=LR, weight_decay=0.0),
        "bf16-kahan": lambda: KahanBf16AdamW(params, lr=LR),
        "8bit-bf16-sr": lambda: mfa.AdamW8bit(params, lr=LR, weight_decay=0.0, min_8bit_size=1024,
                                              bf16_stochastic_round=True),
    }[kind]()
    dt = params[0].dtype
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(dt)).float(), y).backward()
        opt.step()
        with torch.no_grad():
            f = [p.float() for p in params]
            losses.append(torch.nn.functional.mse_loss(torch.tanh(x @ f[0].T + f[1]) @ f[2].T + f[3], y).item())
    return losses


def memory_table() -> list[str]:
    torch.manual_seed(0)
    rows = []
    for label, dtype, make in [
        ("fp32 AdamW", torch.float32, lambda ps: mfa.AdamW(ps)),
        ("bf16 params, fp32 states (CPUAdam)", torch.bfloat16, lambda ps: mfa.CPUAdam(ps)),
        ("bf16 params, bf16 states (+ stochastic rounding)", torch.bfloat16,
         lambda ps: mfa.AdamW(ps, bf16_stochastic_round=True)),
        ("fp32 params, AdamW8bit", torch.float32, lambda ps: mfa.AdamW8bit(ps)),
        ("bf16 params, AdamW8bit + stochastic rounding", torch.bfloat16,
         lambda ps: mfa.AdamW8bit(ps, bf16_stochastic_round=True)),
    ]:
        p = torch.nn.Parameter(torch.randn(1 << 20).to(dtype))
        p.grad = torch.randn_like(p)
        opt = make([p])
        opt.step()
        state = sum(t.numel() * t.element_size() for t in opt.state[p].values() if isinstance(t, torch.Tensor))
        rows.append(f"| {label} | {2 * p.element_size()} | {state / p.numel():.5f} | "
                    f"{2 * p.element_size() + state / p.numel():.5f} |")
        assert abs(state_bytes_per_param(opt) - state / p.numel()) < 1e-12
    return ["| set-up | param + grad | state | total (bytes/param) |", "| --- | --- | --- | --- |"] + rows


def _floor8(opt) -> Callable[[], None]:
    """The memory floor of the 8-bit step (the kernel's own blocks, threads and bytes, with
    trivial math that keeps every value) on the very param, grad and states of ``opt`` (an
    ``AdamW8bit`` after its first step): bench._floor_fn says why not on copies."""
    from mps_fused_adam import _cpu
    from mps_fused_adam.backends import _DTYPE_CODES as _PARAM_CODES
    (p,) = opt.param_groups[0]["params"]
    st = opt.state[p]
    keep = (p, st)
    args = [p.data_ptr(), p.grad.data_ptr()] + [st[k].data_ptr() for k in (
        "exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")] + [
        p.numel(), _PARAM_CODES[p.dtype], lowbit.kernel_table(True).data_ptr(), lowbit.kernel_table(False).data_ptr(),
        lowbit.pack_adam8bit(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 1)), 0, False]
    return lambda: (keep, _cpu.adam8bit_step(*args, torch.get_num_threads(), floor=True))[1]


def speed(size: int, repeats: int, threads: int) -> list[str]:
    def flat(dtype):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(size).to(dtype))
        p.grad = (torch.randn(size) * 1e-2).to(dtype)
        return p

    torch.set_num_threads(threads)
    contenders, notes = {}, []
    # One param per dtype, shared by every contender of that dtype; the optimizers of one state
    # layout also share their state tensors: all of them then work on the same memory.
    shared = {torch.float32: flat(torch.float32), torch.bfloat16: flat(torch.bfloat16)}
    first_of: dict = {}
    for name, dtype, layout, make in [
        ("torch AdamW(fused=True) fp32", torch.float32, "fp32", lambda ps: torch.optim.AdamW(ps, fused=True)),
        ("ours AdamW fp32", torch.float32, "fp32", lambda ps: mfa.AdamW(ps)),
        ("ours AdamW8bit fp32", torch.float32, "8bit fp32", lambda ps: mfa.AdamW8bit(ps)),
        ("ours AdamW bf16 (round to nearest)", torch.bfloat16, "bf16", lambda ps: mfa.AdamW(ps)),
        ("ours AdamW bf16 + stochastic rounding", torch.bfloat16, "bf16",
         lambda ps: mfa.AdamW(ps, bf16_stochastic_round=True)),
        ("ours AdamW8bit bf16", torch.bfloat16, "8bit bf16", lambda ps: mfa.AdamW8bit(ps)),
        ("ours AdamW8bit bf16 + stochastic rounding", torch.bfloat16, "8bit bf16",
         lambda ps: mfa.AdamW8bit(ps, bf16_stochastic_round=True)),
    ]:
        p = shared[dtype]
        opt = make([p])
        opt.step()  # makes the state (the floor's tensors, for the 8-bit ones)
        if layout in first_of:
            theirs = first_of[layout].state[p]
            share_states(opt, [p], {k: [t] for k, t in theirs.items()
                                    if isinstance(t, torch.Tensor) and k != "step"})
        else:
            first_of[layout] = opt
        contenders[name] = opt.step
        if name in ("ours AdamW8bit fp32", "ours AdamW8bit bf16"):
            contenders[FLOOR8 + name[-5:]] = _floor8(opt)
    try:
        import bitsandbytes as bnb
        contenders["bitsandbytes AdamW8bit fp32"] = bnb.optim.AdamW8bit([shared[torch.float32]]).step
    except Exception as exc:
        notes.append(f"bitsandbytes: not importable ({type(exc).__name__})")
    try:
        from torchao.optim import AdamW8bit as AoAdamW8bit
        contenders["torchao AdamW8bit fp32"] = AoAdamW8bit([shared[torch.float32]]).step
    except Exception as exc:
        notes.append(f"torchao: not importable ({type(exc).__name__}: {exc})")
    rounds = interleaved_rounds(contenders, repeats)
    times = {name: statistics.median(ts) for name, ts in rounds.items()}
    base = times["torch AdamW(fused=True) fp32"]
    rows = [f"\n### {threads} thread(s)\n", "| contender | ns/elem | vs torch fused fp32 | speed vs 8-bit floor |",
            "| --- | --- | --- | --- |"]
    for name, t in times.items():
        floor = FLOOR8 + (" bf16" if "bf16" in name else " fp32")
        # Speed against the floor: the median of the round-by-round ratios, as bench.py's rows.
        of_floor = (f"{ratio_spread(rounds[floor], rounds[name])[0]:.2f}"
                    if ("8bit" in name.lower() or name.startswith(FLOOR8)) else "-")
        rows.append(f"| {name} | {t / size * 1e9:.3f} | {base / t:.2f}x | {of_floor} |")

    def overhead(sr_name: str, rtn_name: str) -> str:
        mid, lo, hi = ratio_spread(rounds[sr_name], rounds[rtn_name])
        return f"{mid - 1:+.1%} (middle half of the rounds {lo - 1:+.1%} to {hi - 1:+.1%})"
    rows.append("\nstochastic rounding overhead over round-to-nearest, the median of the round-by-round ratios: "
                f"bf16 AdamW {overhead('ours AdamW bf16 + stochastic rounding', 'ours AdamW bf16 (round to nearest)')}, "
                f"bf16 AdamW8bit {overhead('ours AdamW8bit bf16 + stochastic rounding', 'ours AdamW8bit bf16')}")
    return rows + [f"\n{n}" for n in notes]


FLOOR8 = "8-bit memory floor"


# ---- 4. a small transformer language model ----------------------------------------------------

LM_CONFIG = dict(vocab=32, context=32, d_model=64, heads=4, layers=3, ff=256, batch=32, lr=3e-3, warmup=40,
                 weight_decay=0.01, eval_batches=4, eval_every=10)
LM_MODES = ("fp32", "8bit", "4bit", "4bit-bf16-sr")


class MarkovSource:
    """A fixed random order-2 Markov source over ``vocab`` tokens: each pair of previous tokens
    picks among 8 next tokens (Dirichlet(1) weights), so text has structure a model must
    learn from context, and its entropy rate (the best achievable loss) is computed exactly."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        probs = torch.zeros(vocab * vocab, vocab)
        for row in range(vocab * vocab):
            nxt = torch.randperm(vocab, generator=gen)[:8]
            w = -torch.log(torch.rand(8, generator=gen))  # normalized: Dirichlet(1) weights
            probs[row, nxt] = w / w.sum()
        self.probs = probs
        self.cum = probs.cumsum(1)

    def sample(self, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
        out = torch.randint(0, self.vocab, (n, length), generator=gen)
        for t in range(2, length):
            row = out[:, t - 2] * self.vocab + out[:, t - 1]
            u = torch.rand(n, 1, generator=gen)
            out[:, t] = torch.searchsorted(self.cum[row], u).squeeze(1).clamp(max=self.vocab - 1)
        return out

    def entropy(self) -> float:
        """Entropy rate in nats per token (uniform pairs start each sequence; the chain's pair
        distribution is estimated by long sampling, as the stationary law has no closed form)."""
        seq = self.sample(64, 512, torch.Generator().manual_seed(123))
        rows = seq[:, 1:-1] * self.vocab + seq[:, 2:]
        p = self.probs
        h = -(p * torch.log(p.clamp(min=1e-30))).sum(1)
        return float(h[rows.reshape(-1)].mean())


class TinyLM(torch.nn.Module):
    """Decoder-only transformer: token and position embeddings, pre-norm blocks of causal
    multi-head attention and a GELU MLP, a final norm and an untied output layer."""

    def __init__(self, vocab: int, context: int, d_model: int, heads: int, layers: int, ff: int, **_: object) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(context, d_model)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, activation="gelu", batch_first=True,
                                             norm_first=True) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d_model)
        self.out = torch.nn.Linear(d_model, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = self.mask[:t, :t].to(h.dtype)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.out(self.norm(h))


def lm_train(kind: str, steps: int, cfg: dict = LM_CONFIG, seed: int = 0) -> tuple[list[float], float]:
    """Held-out loss (nats per token, fp32 evaluation) every ``eval_every`` steps of one mode, and
    the optimizer's state bytes per parameter. Every mode sees the same initial weights and batches."""
    source = MarkovSource(cfg["vocab"])
    torch.manual_seed(seed)
    model = TinyLM(**cfg)
    dtype = torch.bfloat16 if kind.endswith("bf16-sr") else torch.float32
    model = model.to(dtype)
    params = list(model.parameters())
    kw = dict(lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    opt = {"fp32": lambda: mfa.AdamW(params, **kw),
           "8bit": lambda: mfa.AdamW8bit(params, **kw),
           "4bit": lambda: mfa.AdamW4bit(params, **kw),
           "4bit-bf16-sr": lambda: mfa.AdamW4bit(params, bf16_stochastic_round=True, **kw)}[kind]()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg["warmup"]))
    draws = torch.Generator().manual_seed(1)
    held = source.sample(cfg["batch"] * cfg["eval_batches"], cfg["context"] + 1, torch.Generator().manual_seed(2))
    losses = []
    for step in range(1, steps + 1):
        seq = source.sample(cfg["batch"], cfg["context"] + 1, draws)
        logits = model(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg["vocab"]), seq[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % cfg["eval_every"]:
            continue
        with torch.no_grad():
            logits = model(held[:, :-1]).float()
            losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, cfg["vocab"]),
                                                            held[:, 1:].reshape(-1)).item())
    return losses, state_bytes_per_param(opt)


def lm_main(steps: int, results: str) -> None:
    cfg = LM_CONFIG
    source = MarkovSource(cfg["vocab"])
    n_params = sum(p.numel() for p in TinyLM(**cfg).parameters())
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, CPU backend "
             f"{mfa.backend_info()['cpu']['backend']}",
             f"\n## Transformer LM ({n_params} params, config {cfg}), {steps} steps",
             f"source entropy rate (best achievable loss): {source.entropy():.4f} nats/token; "
             f"uniform guess: {math.log(cfg['vocab']):.4f}"]
    curves, state = {}, {}
    for kind in LM_MODES:
        t0 = time.perf_counter()
        curves[kind], state[kind] = lm_train(kind, steps)
        print(f"{kind}: {curves[kind][-1]:.4f} after {steps} steps ({time.perf_counter() - t0:.0f} s)", flush=True)
    final = {k: sum(v[-5:]) / 5 for k, v in curves.items()}
    lines.append(f"final held-out loss (mean of the last 5 evaluations, every {cfg['eval_every']} steps), relative "
                 f"to fp32 AdamW; state bytes per param:")
    lines += [f"- {k}: {v:.4f} ({v / final['fp32'] - 1:+.2%}), excess over the entropy rate "
              f"{v - source.entropy():.4f}; state {state[k]:.3f} B/param" for k, v in final.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(results, "lowbit_lm.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(results, "lowbit_lm_curves.csv"), "w") as f:
        f.write("step," + ",".join(curves) + "\n")
        for i in range(len(curves["fp32"])):
            f.write(f"{(i + 1) * cfg['eval_every']}," + ",".join(f"{curves[k][i]:.6g}" for k in curves) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--size", type=int, default=1 << 24)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    ap.add_argument("--no-train", action="store_true", help="speed only: no training curves, nothing written")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "lowbit"))
    ap.add_argument("--lm", action="store_true", help="only the transformer LM run (--steps defaults to 600 there)")
    args = ap.parse_args()
    if args.lm:
        steps = args.steps if "--steps" in sys.argv else 600
        return lm_main(steps, os.path.dirname(args.out))
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    if args.no_train:
        lines.append(f"\n## CPU step, flat {args.size} elements, interleaved, median of {args.repeats}")
        for t in args.threads:
            lines += speed(args.size, args.repeats, t)
        print("\n".join(lines))
        return
    curves = {k: train(k, args.steps) for k in ("fp32", "8bit", "bf16-sr", "bf16", "bf16-kahan", "8bit-bf16-sr")}
    final = {k: sum(v[-50:]) / 50 for k, v in curves.items()}
    lines.append(f"\n## Training ({args.steps} steps, lr {LR}); final loss (mean of last 50) relative to fp32 AdamW")
    lines += [f"- {k}: {v:.4f} ({v / final['fp32'] - 1:+.1%})" for k, v in final.items()]
    lines.append("\n## Optimizer state per parameter (1M-element tensor)")
    lines += memory_table()
    lines.append(f"\n## CPU step, flat {args.size} elements, interleaved, median of {args.repeats}")
    for t in args.threads:
        lines += speed(args.size, args.repeats, t)
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out + ".txt", "w") as f:
        f.write(text)
    # The curves as plots.py reads them (it draws docs/img/lowbit_curves.png from this file).
    with open(args.out + "_curves.csv", "w") as f:
        f.write("step," + ",".join(curves) + "\n")
        for i in range(args.steps):
            f.write(f"{i + 1}," + ",".join(f"{curves[k][i]:.6g}" for k in curves) + "\n")


if __name__ == "__main__":
    main()
