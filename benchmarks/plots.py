"""The documentation's figures, drawn from the run logs in benchmarks/results/ (matplotlib).

    python benchmarks/plots.py                 # draws docs/img/*.png from benchmarks/results/
    python benchmarks/plots.py curves          # runs the low-bit training curves (benchmarks/lowbit.py's
                                               # train(), 2000 steps per mode) into
                                               # benchmarks/results/lowbit_curves.csv, then draws

Figures (each sized for the docs' page width, about 800 px):
- ``cpu_threads.png``: the CPU Adam step against torch's fused AdamW and DeepSpeed's CPU Adam by
  thread count, from ``cpu_xeon16_run8.txt`` (the benchmark's table rows);
- ``lowbit_curves.png``: training loss of the low-bit modes, from ``lowbit_curves.csv``;
- ``lowbit_lm_curves.png``: held-out loss of the transformer LM run (``lowbit.py --lm``), from
  ``lowbit_lm_curves.csv``;
- ``bytes_per_param.png``: memory per parameter of a training step by configuration, from
  ``memory_epyc_2core.txt`` (the summary table of benchmarks/memory.py; docs/memory.md's table).
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
OUT = HERE.parent / "docs" / "img"
CPU_RUN = RESULTS / "cpu_xeon16_run8.txt"
CURVES = RESULTS / "lowbit_curves.csv"
LM_CURVES = RESULTS / "lowbit_lm_curves.csv"
MEMORY = RESULTS / "memory_epyc_2core.txt"
MODES = ("fp32", "8bit", "bf16-sr", "bf16", "bf16-kahan", "8bit-bf16-sr")
LABELS = {"fp32": "fp32 AdamW", "8bit": "AdamW8bit (fp32 params)", "bf16-sr": "bf16 + stochastic rounding",
          "bf16": "bf16, round to nearest", "bf16-kahan": "bf16 + Kahan (plain torch)",
          "8bit-bf16-sr": "AdamW8bit, bf16 + stochastic rounding"}
WIDTH_IN, DPI = 8.0, 100  # 800 px wide: the Material theme's content column


def table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row of ``text`` (header and rule rows included)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]


def cpu_rows(path: Path = CPU_RUN) -> dict[tuple[str, str, str], dict[int, float]]:
    """(case, dtypes, contender) -> {threads: ns per element}, from the benchmark's table."""
    out: dict[tuple[str, str, str], dict[int, float]] = {}
    for cells in table_rows(path.read_text(encoding="utf-8")):
        # The per-contender rows; the closing summary table (ours against the fastest other) has
        # eight cells too, with a number where the contender's name stands.
        if len(cells) == 8 and cells[2].isdigit() and not cells[3].replace(".", "").isdigit():
            case, dtypes, threads, contender, ns = cells[:5]
            out.setdefault((case, dtypes, contender), {})[int(threads)] = float(ns)
    return out


def memory_rows(path: Path = MEMORY) -> list[tuple[str, float]]:
    """(what, bytes per parameter) of the summary table: its first table whose header names
    bytes per parameter (the "what" column, else the first)."""
    rows, header = [], None
    for cells in table_rows(path.read_text(encoding="utf-8")):
        if header is None:
            if any("bytes/param" in c or "bytes per param" in c for c in cells):
                header = cells
                col = next(i for i, c in enumerate(cells) if "bytes/param" in c or "bytes per param" in c)
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        if len(cells) != len(header):
            break
        try:
            label = cells[header.index("what")] if "what" in header else cells[0]
            rows.append((label.replace("`", ""), float(cells[col])))
        except ValueError:
            break
    return rows


def read_curves(path: Path = CURVES) -> dict[str, list[float]]:
    with path.open(encoding="utf-8") as f:
        reader = csv.DictReader(f)
        data: dict[str, list[float]] = {k: [] for k in reader.fieldnames or [] if k != "step"}
        for row in reader:
            for k in data:
                data[k].append(float(row[k]))
    return data


def write_curves(steps: int, path: Path = CURVES) -> None:
    sys.path.insert(0, str(HERE))
    import lowbit
    curves = {k: lowbit.train(k, steps) for k in MODES}
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *curves])
        for i in range(steps):
            w.writerow([i + 1, *(f"{curves[k][i]:.6g}" for k in curves)])


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 11, "axes.titlesize": 12, "legend.fontsize": 10,
                         "axes.spines.top": False, "axes.spines.right": False})
    return plt


CONTENDERS = (("ours", "mps-fused-adam", "#1f77b4"), ("torch fused", "torch AdamW(fused=True)", "#ff7f0e"),
              ("deepspeed cpu_adam", "DeepSpeed CPU Adam", "#2ca02c"), ("floor", "memory floor", "#7f7f7f"))


def plot_cpu(out: Path) -> Path:
    """Ns per element against threads, one panel per case (lower is faster)."""
    plt = _plt()
    rows = cpu_rows()
    cases = [("flat 64M", "fp32"), ("flat 64M", "bf16/bf16"), ("1000 x 64K", "fp32"), ("1000 x 64K", "bf16/bf16")]
    from matplotlib.ticker import FuncFormatter
    fig, axes = plt.subplots(2, 2, figsize=(WIDTH_IN, 6.6), sharex=True)
    for ax, (case, dtypes) in zip(axes.flat, cases):
        for key, label, color in CONTENDERS:
            series = rows.get((case, dtypes, key))
            if series:
                ts = sorted(series)
                style = dict(ls="--", lw=1.2) if key == "floor" else dict(lw=2, marker="o")
                ax.plot(ts, [series[t] for t in ts], color=color, label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([1, 4, 16], ["1", "4", "16"])
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
        ax.set_title(f"{dtypes}, {case}")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("threads")
    fig.supylabel("ns per element (log scale; lower is faster)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False)
    fig.suptitle("Adam step on a 16-core Intel Xeon (AVX-512), one interleaved run", y=0.99)
    fig.tight_layout(rect=(0, 0.09, 1, 0.97))
    path = out / "cpu_threads.png"
    fig.savefig(path, dpi=DPI)
    return path


def plot_curves(out: Path) -> Path:
    plt = _plt()
    curves = read_curves()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4.6))
    final = {k: sum(v[-50:]) / 50 for k, v in curves.items()}
    for k, v in curves.items():
        ax.plot(range(1, len(v) + 1), v, lw=1.6, label=f"{LABELS.get(k, k)}: {final[k] / final['fp32'] - 1:+.1%}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (fp32 evaluation)")
    ax.set_title("608K-parameter MLP regression, lr 1e-3: final loss against fp32 AdamW")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    path = out / "lowbit_curves.png"
    fig.savefig(path, dpi=DPI)
    return path


def plot_lm(out: Path) -> Path:
    plt = _plt()
    with LM_CURVES.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    modes = [k for k in rows[0] if k != "step"]
    labels = {"fp32": "fp32 AdamW", "8bit": "AdamW8bit", "4bit": "AdamW4bit",
              "4bit-bf16-sr": "AdamW4bit, bf16 + stochastic rounding"}
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4.6))
    final = {k: sum(float(r[k]) for r in rows[-5:]) / 5 for k in modes}
    for k in modes:
        ax.plot(steps, [float(r[k]) for r in rows], lw=1.6,
                label=f"{labels.get(k, k)}: {final[k]:.3f} ({final[k] / final['fp32'] - 1:+.1%})")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats per token)")
    ax.set_title("156K-parameter transformer LM (benchmarks/lowbit.py --lm): final loss against fp32 AdamW")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    path = out / "lowbit_lm_curves.png"
    fig.savefig(path, dpi=DPI)
    return path


def plot_memory(out: Path) -> Path:
    plt = _plt()
    rows = memory_rows()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 0.5 * len(rows) + 1.4))
    names = [n for n, _ in rows][::-1]
    values = [v for _, v in rows][::-1]
    ours = [not n.startswith(("torch.", "bitsandbytes", "torchao")) for n in names]
    bars = ax.barh(range(len(rows)), values, color=["#1f77b4" if o else "#ff7f0e" for o in ours])
    ax.bar_label(bars, fmt="%.2f", padding=3)
    short = [n.replace("bf16_stochastic_round=True", "SR").replace("step_in_backward=True", "in backward")
             .replace(", one per param, stepped from hand-written hooks", ", hand-written hooks")
             .replace("bitsandbytes.optim.", "bnb ").replace("torchao.optim.", "torchao ")
             .replace("torch.optim.", "torch ") for n in names]
    ax.set_yticks(range(len(rows)), short)
    ax.set_xlabel("bytes per parameter, peak of a training step (lower is better)")
    ax.set_xlim(0, max(values) * 1.12)
    fig.suptitle("Memory per parameter: 8 x Linear(2048, 2048), batch 4, on a 2-core AMD EPYC")
    fig.text(0.5, 0.935, "blue: mps-fused-adam; orange: torch, bitsandbytes, torchao; SR: bf16 stochastic rounding",
             ha="center", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path = out / "bytes_per_param.png"
    fig.savefig(path, dpi=DPI)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", choices=["draw", "curves"], default="draw")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.what == "curves":
        write_curves(args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    for draw in (plot_cpu, plot_curves, plot_lm, plot_memory):
        print(f"wrote {draw(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
