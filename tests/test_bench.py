"""The benchmark's per-case summary: ours against the fastest other implementation and the floor."""
from __future__ import annotations

from mps_fused_adam.bench import Row, summary


def row(contender: str, ns: float, case: str = "flat 64M", threads: int = 16) -> Row:
    return Row(case, "fp32", threads, contender, ns, 1.0, None, None)


def test_summary_picks_the_fastest_other_and_ratios():
    rows = [row("ours", 0.25), row("floor", 0.20), row("torch fused", 0.30), row("deepspeed cpu_adam", 0.24),
            row("torch foreach", 1.1),
            row("ours", 0.5, "flat 64M", 1), row("floor", 0.5, "flat 64M", 1)]
    lines = summary(rows)
    assert lines[2] == "| flat 64M | fp32 | 16 | 0.250 | deepspeed cpu_adam | 0.240 | 0.96x | 0.80 |"
    assert lines[3] == "| flat 64M | fp32 | 1 | 0.500 | (none) | - | - | 1.00 |"
    assert len(lines) == 4
