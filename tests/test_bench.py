"""The benchmark's per-case summary: ours against the fastest other implementation and the floor."""
from __future__ import annotations

from mps_fused_adam.tools.bench import Row, summary


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
    # With round-by-round ratios (the rows' column), the summary repeats ours' row's figure.
    paired = [Row("flat 64M", "fp32", 4, "ours", 0.25, 1.0, 0.93, None), row("floor", 0.20, threads=4)]
    assert summary(paired)[2] == "| flat 64M | fp32 | 4 | 0.250 | (none) | - | - | 0.93 |"


# The benchmarks run the memory floors on the optimizers' own tensors (bench._floor_fn), so the
# floors must leave every value as it was, on every SIMD path, in every dtype pair, tails included.
import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import DTYPE_PAIRS, pair_id  # noqa: E402


def _positive(n: int, dtype: torch.dtype) -> torch.Tensor:
    # No -0: x + g * 0 may turn a -0 into +0, the only value the floors may change.
    return (torch.rand(n) + 0.5).to(dtype)


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
@pytest.mark.parametrize("rule", ["floor", "floor1"])
def test_floors_keep_every_value(simd, pair, rule):
    from mps_fused_adam.tools.bench import _floor_fn
    pd, sd = pair
    params = []
    for n in (1, 37, 4099):
        p = torch.nn.Parameter(_positive(n, pd) * torch.where(torch.rand(n) < 0.5, -1.0, 1.0).to(pd))
        p.grad = -_positive(n, pd)
        params.append(p)
    states = [[_positive(p.numel(), sd) for p in params] for _ in range(2 if rule == "floor" else 1)]
    before = [t.clone() for t in [*params, *(p.grad for p in params), *(t for ts in states for t in ts)]]
    _floor_fn(params, states, pd, sd, rule=rule)()
    after = [*params, *(p.grad for p in params), *(t for ts in states for t in ts)]
    assert all(torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8)) for a, b in zip(after, before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_8bit_floor_keeps_every_value(simd, dtype):
    import os
    import sys
    import mps_fused_adam as mfa
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from lowbit import _floor8
    p = torch.nn.Parameter(torch.randn(5000).to(dtype))
    p.grad = (torch.randn(5000) * 1e-2).to(dtype)
    opt = mfa.AdamW8bit([p], min_8bit_size=1)
    opt.step()
    before = [p.detach().clone(), *(t.clone() for t in opt.state[p].values() if isinstance(t, torch.Tensor))]
    _floor8(opt)()
    after = [p.detach(), *(t for t in opt.state[p].values() if isinstance(t, torch.Tensor))]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before))


def test_contenders_share_params_grads_and_moments():
    """Every contender of a case reads and writes the same memory as ours (bench.py's docstring)."""
    from mps_fused_adam.tools.bench import _contenders, _params
    params = _params(3, 64, torch.float32)
    found = _contenders(params, torch.float32, torch.float32, deepspeed=False, foreach=True)
    assert set(found) == {"ours", "floor", "torch fused", "torch foreach"}
    ours_state = found["ours"].__self__.state
    for name in ("torch fused", "torch foreach"):
        other = found[name].__self__.state
        for p in params:
            for key in ("exp_avg", "exp_avg_sq"):
                assert other[p][key] is ours_state[p][key]
    for fn in found.values():  # every contender still steps, each on the shared tensors
        fn()
    assert all(torch.isfinite(p).all() for p in params)


def test_alternated_best_times_each_setting_in_turn():
    """The on/off helper of the diagnostics: each setting is switched on in turn, ``rounds``
    times, and the fastest call of each is reported (a setting that sleeps is the slower one)."""
    import time
    from mps_fused_adam.tools.timing import alternated_best
    seen, state = [], {}

    def switch(on):
        seen.append(on)
        state["on"] = on

    best = alternated_best(switch, lambda: time.sleep(0.002 if state["on"] else 0), rounds=2, calls=3, warmup=1)
    assert seen == [False, True, False, True]
    assert set(best) == {False, True}
    assert best[True] >= 0.002 > best[False]


def test_interleaved_rounds_vary_each_contenders_predecessor():
    """Every contender runs once per round (entry r of each list from round r), and over the
    rounds each one follows several different others: a contender that leaves work behind (torch's
    foreach frees gigabytes) must not always be followed by the same one."""
    from mps_fused_adam.tools.timing import interleaved_rounds
    calls: list[str] = []
    names = ["ours", "floor", "torch fused", "torch foreach", "deepspeed"]
    contenders = {n: (lambda n=n: calls.append(n)) for n in names}
    times = interleaved_rounds(contenders, 20)
    assert all(len(times[n]) == 20 for n in names)
    rounds = calls[len(names):]  # after the warm-up calls, one per contender
    assert all(sorted(rounds[i:i + len(names)]) == sorted(names) for i in range(0, len(rounds), len(names)))
    for n in names:
        followed = {rounds[i - 1] for i in range(1, len(rounds)) if rounds[i] == n}
        assert len(followed) >= 3, f"{n} followed only {followed}"
    assert interleaved_rounds(contenders, 20).keys() == times.keys()
    first, second = calls[5:105], calls[110:210]  # each run: 5 warm-up calls, then 20 rounds of 5
    assert first == second, "the order comes from a fixed seed, so two runs take the same orders"
