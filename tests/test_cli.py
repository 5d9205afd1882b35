"""``python -m mps_fused_adam`` as a command line: --help without importing torch, the options that
skip parts of the report, the JSON report, exit statuses; and ``bench --plot`` without matplotlib."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import pytest
import torch

@pytest.fixture(autouse=True)
def _fresh_selfcheck_references():
    """The self-check makes its references once per process (lru_cache); a test that patches the
    contract must neither see references made before nor leave its own behind."""
    def clear():
        if "mps_fused_adam.tools.selfcheck" in sys.modules:
            sc = sys.modules["mps_fused_adam.tools.selfcheck"]
            for name in ("_many_case", "_lowbit_cases"):
                getattr(sc, name, None) and getattr(sc, name).cache_clear()
    clear()
    yield
    clear()


HELP_PROBE = """
import runpy, sys, time
sys.argv = ["python -m mps_fused_adam", *sys.argv[1:]]
t0 = time.perf_counter()
try:
    runpy.run_module("mps_fused_adam", run_name="__main__")
except SystemExit as e:
    code = e.code
print("RESULT", code, "torch" in sys.modules, time.perf_counter() - t0)
"""


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mps_fused_adam", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("flag", ["--help", "-h", "--version"])
def test_help_answers_without_importing_torch(flag):
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", HELP_PROBE, flag], capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - t0
    *out, result = run.stdout.strip().splitlines()
    _, code, torch_loaded, seconds = result.split()
    assert code == "0" and torch_loaded == "False", run.stdout + run.stderr
    # The target is under a second; importing torch alone takes about one, hence the assert above.
    print(f"{flag}: {float(seconds) * 1e3:.0f} ms in the command, {wall:.2f} s with the interpreter")
    text = "\n".join(out)
    if flag == "--version":
        import mps_fused_adam
        assert text == f"mps_fused_adam {mps_fused_adam.__version__}"
    else:
        for option in ("--no-bench", "--check", "--self-check-only", "--json", "Exit status"):
            assert option in text


def test_unknown_option_is_a_usage_error():
    run = _run("--bench-only")
    assert run.returncode == 2
    assert "unrecognized arguments: --bench-only" in run.stderr and run.stdout == ""


def test_check_only_json():
    run = _run("--check", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)  # nothing but the JSON object on stdout
    assert set(report) == {"self_check", "passed", "summary"} and report["passed"] is True
    assert report["summary"]["checks_passed"] == report["summary"]["checks"] == len(report["self_check"])
    from mps_fused_adam.numerics.contract import element_rules
    from mps_fused_adam.tools.selfcheck import AGREEMENT_BOUND, AGREEMENT_LABEL, PAIRS
    cpu_paths = [r for r in report["self_check"] if r["backend"].startswith("_cpu (")]
    # Every rule of contract.RULES per dtype pair; 8-bit and 4-bit Adam x 3 each, stochastic
    # rounding x 2; several tensors in one call; torch.optim.AdamW
    from mps_fused_adam.tools.selfcheck import block_rules
    assert block_rules() == ["adam8bit", "adam4bit"]
    lowbit_cases = 3 * len(block_rules()) + 2
    per_path = len(PAIRS) * len(element_rules()) + lowbit_cases + 1 + 1
    assert cpu_paths and len(cpu_paths) % per_path == 0
    paths = len(cpu_paths) // per_path
    assert sum(r["dtypes"].startswith((*(f"{b} " for b in block_rules()), "adam-sr ")) for r in cpu_paths) == \
        lowbit_cases * paths
    agreement = [r for r in report["self_check"] if r["dtypes"] == AGREEMENT_LABEL]
    assert [r["backend"] for r in agreement] == [r["backend"] for r in cpu_paths[::per_path]] + ["foreach"]
    assert all(0 < r["worst_in_eps"] < AGREEMENT_BOUND and r["passed"] for r in agreement)
    # The CPU kernel equals the reference bit for bit on every SIMD path (the contract).
    assert all(r["bit_exact"] and r["worst_in_eps"] == 0 and r["passed"] and r["exact_required"]
               for r in cpu_paths if r["dtypes"] != AGREEMENT_LABEL)


def test_no_bench_text_report():
    run = _run("--no-bench")
    assert run.returncode == 0, run.stderr
    import torch
    assert f"torch {torch.__version__}" in run.stdout and "Backends:" in run.stdout
    assert "Self-check against the reference" in run.stdout
    assert "benchmark" not in run.stdout.lower()


def test_json_report_with_benchmark(monkeypatch, capsys):
    """The whole report in-process, with the benchmark shrunk to a few small rounds."""
    import torch

    from mps_fused_adam import __main__ as cli
    from mps_fused_adam.tools import bench
    monkeypatch.setattr(bench, "QUICK", dict(flat=4096, many=(4, 1024), repeats=5, foreach=False))
    assert cli.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["threads"] == torch.get_num_threads()
    assert env["backends"]["cpu"]["backend"] == "cpu"
    rows = report["benchmark"]
    assert {r["contender"] for r in rows} == {"ours", "floor", "torch fused"}  # no foreach in the quick run
    assert len(rows) == 2 * (3 + 3 + 2)  # two shapes; fp32, bf16/bf16: 3 contenders; bf16/fp32 states: 2
    for r in rows:
        if r["vs_torch_fused"] is not None and r["contender"] != "torch fused":
            lo, hi = r["vs_torch_fused_spread"]
            assert 0 < lo <= r["vs_torch_fused"] <= hi


def test_failed_self_check_exits_1(monkeypatch, capsys):
    from mps_fused_adam import __main__ as cli
    from mps_fused_adam.tools import selfcheck
    bad = selfcheck.CheckResult("_cpu (test)", "cpu", "float32/float32", 9.5, False)
    monkeypatch.setattr(selfcheck, "all_checks", lambda: iter([bad]))
    assert cli.main(["--no-bench"]) == 1
    out = capsys.readouterr().out
    assert "FAIL _cpu (test)" in out and "1 self-check(s) FAILED" in out


def test_ratio_spread_against_hand_computed_quartiles():
    from mps_fused_adam.tools.timing import ratio_spread
    torch_times = [2.0, 2.0, 2.0, 2.0, 2.0]
    ours = [1.0, 2.0, 4.0, 2.5, 1.6]  # ratios 2.0, 1.0, 0.5, 0.8, 1.25
    median, q1, q3 = ratio_spread(torch_times, ours)
    assert median == 1.0
    assert (q1, q3) == pytest.approx((0.65, 1.625))  # statistics.quantiles' default (exclusive) method


def _rounds_with_spread(half_iqr: float, rounds: int = 21, seed: int = 0) -> tuple[list[float], list[float]]:
    """Synthetic timings of torch fused and ours whose round-by-round ratio is 1.3 times a
    lognormal noise with the given half interquartile range (relative)."""
    import random
    rng = random.Random(seed)
    sigma = math.log1p(half_iqr) / 0.6745  # the quartiles of a normal sit at +-0.6745 sigma
    ours = [1.0] * rounds
    torch_times = [1.3 * math.exp(rng.gauss(0.0, sigma)) for _ in range(rounds)]
    return torch_times, ours


@pytest.mark.parametrize("half_iqr, fires", [(0.02, False), (0.08, False), (0.12, False), (0.15, False),  # idle
                                             (0.35, True), (0.6, True)])                                 # loaded
def test_noise_note_is_silent_on_idle_spreads_and_fires_on_loaded_ones(half_iqr, fires):
    from mps_fused_adam.tools.bench import Row, noise_note
    from mps_fused_adam.tools.timing import ratio_spread
    rows = []
    for seed in range(3):  # three cases, as in a run
        torch_times, ours = _rounds_with_spread(half_iqr, seed=seed)
        med, q1, q3 = ratio_spread(torch_times, ours)
        rows.append(Row("flat", "fp32", 2, "ours", 1.0, 1.0, 1.0, med, (q1, q3)))
    note = noise_note(rows, 21)
    assert (note is not None) == fires, (half_iqr, note)
    if fires:
        assert "uncertain by up to +-" in note and "busy" in note


def test_noise_note_judges_the_median_by_the_number_of_rounds():
    from mps_fused_adam.tools.bench import Row, median_uncertainty, noise_note
    row = Row("flat", "fp32", 2, "ours", 1.0, 1.0, 1.0, 1.0, (0.80, 1.20))  # rounds move +-20%
    # sigma = 0.4 / 1.349; standard error of the median = 1.2533 sigma / sqrt(n)
    assert median_uncertainty(row, 21) == pytest.approx(1.2533 * 0.4 / 1.349 / math.sqrt(21))
    assert noise_note([row], 400) is None          # many rounds pin the median down
    assert "+-8%" in noise_note([row], 21)           # over the 7.5% (one standard error) it allows
    assert "+-12%" in noise_note([row], 10)
    calmer = Row("flat", "fp32", 2, "ours", 1.0, 1.0, 1.0, 1.0, (0.85, 1.15))
    assert noise_note([calmer], 21) is None
    floor = Row("flat", "fp32", 2, "floor", 1.0, 1.0, 1.0, None, None)
    assert noise_note([floor], 21) is None          # only ours' rows are judged


def test_floor_rows_have_no_speed_against_torch(monkeypatch):
    from mps_fused_adam.tools import bench
    rows = bench.cpu_section(flat=4096, many=(4, 1024), thread_counts=[1], repeats=3, deepspeed=False,
                             foreach=False, echo=False)
    floors = [r for r in rows if r.contender == "floor"]
    if not bench.floor_available():
        pytest.skip("no compiled _cpu kernel: no floor rows")
    assert floors and all(r.vs_torch_fused is None and r.vs_torch_fused_spread is None for r in floors)
    assert all(r.vs_torch_fused is not None for r in rows if r.contender == "ours" and r.dtypes != "bf16/fp32-states")


def test_summary_line_counts_checks_per_backend_and_gives_the_headline_ratio():
    from mps_fused_adam.__main__ import summary
    report = {"self_check": [{"backend": "_cpu (avx2)", "passed": True}, {"backend": "_cpu (avx2)", "passed": False},
                             {"backend": "foreach", "passed": True}],
              "torch_agreement": {"passed": True},
              "benchmark": [{"contender": "ours", "vs_torch_fused": 1.5}, {"contender": "ours", "vs_torch_fused": 1.1},
                            {"contender": "ours", "vs_torch_fused": 2.0}, {"contender": "ours", "vs_torch_fused": None},
                            {"contender": "floor", "vs_torch_fused": None},
                            {"contender": "torch fused", "vs_torch_fused": 1.0}]}
    s = summary(report)
    assert s["checks_passed"] == 3 and s["checks"] == 4
    assert s["per_backend"] == {"_cpu (avx2)": {"passed": 1, "checks": 2}, "foreach": {"passed": 1, "checks": 1}}
    assert s["vs_torch_fused"] == {"median": 1.5, "min": 1.1, "max": 2.0, "cases": 3}
    assert s["line"] == ("summary: 3/4 checks passed (_cpu (avx2) 1/2, foreach 1/1, reference vs torch.optim.AdamW ok); "
                         "speed vs torch fused 1.50x (median of 3 cases, 1.10x to 2.00x)")


def test_the_command_ends_with_its_summary_line(monkeypatch, capsys):
    from mps_fused_adam import __main__ as cli
    from mps_fused_adam.tools import selfcheck
    ok = selfcheck.CheckResult("_cpu (test)", "cpu", "float32/float32", 0.0, True)
    monkeypatch.setattr(selfcheck, "all_checks", lambda: iter([ok, ok]))
    assert cli.main(["--check"]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "summary: 2/2 checks passed (_cpu (test) 2/2)"


def test_the_short_benchmark_says_why_its_floor_ratios_differ_from_the_docs(monkeypatch, capsys):
    from mps_fused_adam import __main__ as cli
    from mps_fused_adam.tools import bench
    monkeypatch.setattr(bench, "QUICK", dict(flat=4096, many=(4, 1024), repeats=3, foreach=False))
    cli.benchmark(echo=True)
    out = capsys.readouterr().out
    assert (bench.QUICK_SIZE_NOTE in out) == bench.floor_available()
    assert "64M elements" in bench.QUICK_SIZE_NOTE and "caches" in bench.QUICK_SIZE_NOTE


def test_a_closed_pipe_ends_the_command_quietly_with_exit_0():
    """``python -m mps_fused_adam | head -1`` used to end in a BrokenPipeError traceback and exit 1."""
    proc = subprocess.Popen([sys.executable, "-m", "mps_fused_adam", "--no-bench"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader goes away, as head does after its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert first.startswith(b"mps_fused_adam ") and "Traceback" not in err and "BrokenPipe" not in err, err


def test_bench_plot_without_matplotlib_fails_before_running(monkeypatch):
    from mps_fused_adam.tools import bench
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError

    def must_not_run(*a, **k):
        raise AssertionError("the benchmark ran before matplotlib was checked")
    monkeypatch.setattr(bench, "cpu_section", must_not_run)
    with pytest.raises(SystemExit, match=r"--plot needs matplotlib.*mps-fused-adam\[bench\]"):
        bench.main(["--quick", "--plot", "out.png"])


class Tampered:
    """The CPU backend followed by ``after(rule, params, states, old_params)``: a stand-in for a
    backend with a bug, checked by the self-check like any other."""
    name = "tampered"

    def __init__(self, after):
        from mps_fused_adam.backends import get_backend
        self.inner, self.after = get_backend("cpu"), after

    def update(self, rule, params, grads, states, hp, sr_keys=None):
        old = [p.clone() for p in params]
        self.inner.update(rule, params, grads, states, hp)
        self.after(rule, params, states, old)


def _check(after, device="cpu"):
    from mps_fused_adam.tools.selfcheck import check_backend
    return list(check_backend(Tampered(after), device, "tampered"))


def _cases() -> int:
    """check_backend's cases: every rule of contract.RULES with its own element math in every dtype
    pair of the self-check."""
    from mps_fused_adam.numerics.contract import element_rules
    from mps_fused_adam.tools.selfcheck import PAIRS
    return len(element_rules()) * len(PAIRS)


def test_a_nan_written_by_a_backend_fails_the_check():
    def nan(rule, params, states, old):
        params[0].view(-1)[7] = float("nan")
    results = _check(nan)
    assert results and all(not r.passed for r in results)
    assert all(r.worst_in_eps == float("inf") for r in results)


def test_abs_diff_counts_a_one_sided_nan_as_infinitely_wrong():
    from mps_fused_adam.tools.selfcheck import CheckResult, _abs_diff
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([nan, nan, 1.0, inf, inf, -inf, 2.0])
    b = torch.tensor([nan, 1.0, nan, inf, 1.0, inf, 1.5])
    assert _abs_diff(a, b).tolist() == [0.0, inf, inf, 0.0, inf, inf, 0.5]
    assert not CheckResult("x", "cpu", "float32/float32", nan, False).passed
    assert not CheckResult("x", "cpu", "float32/float32", inf, False).passed


def _leave_params(rule, params, states, old):
    for p, o in zip(params, old):
        p.copy_(o)


def _reverse_params(rule, params, states, old):
    for p, o in zip(params, old):
        p.copy_(2 * o.float() - p.float())


def _one_ulp_off(rule, params, states, old, calls=[0]):
    """Each param a random +-1 ulp of its dtype off after the last of the three steps: an honest
    rounding difference in the stored result (what a Metal tier may show), which must pass."""
    calls[0] += 1
    if calls[0] % 3:
        return
    gen = torch.Generator().manual_seed(calls[0])
    for p in params:
        ulp = torch.finfo(p.dtype).eps * torch.exp2(torch.floor(torch.log2(p.float().abs())))
        p.copy_(p.float() + ulp * torch.where(torch.rand(p.shape, generator=gen) < 0.5, -1.0, 1.0))


@pytest.mark.parametrize("after", [_leave_params, _reverse_params])
def test_params_not_written_or_moved_backwards_fail_every_case(after):
    """In half precision the contract's bound (8 eps x max|ref|) used to exceed the whole movement
    of three steps, so a backend that never wrote the params (or moved them the wrong way) passed
    Adam bf16/bf16, every half Lion pair and Adagrad fp16/bf16. On CPU bit identity is required;
    the tolerance used off CPU must reject them too."""
    import dataclasses
    results = _check(after)
    assert len(results) == _cases() and all(r.exact_required and not r.passed for r in results)
    for r in results:
        loose = dataclasses.replace(r, exact_required=False)  # as an MPS backend is judged
        assert not loose.passed, r
        assert r.worst_of_update >= 0.99, r  # the whole movement is missing (1) or doubled (2)


def test_the_tolerance_off_cpu_admits_rounding_differences():
    import dataclasses
    from mps_fused_adam.tools.selfcheck import UPDATE_BOUND
    results = _check(_one_ulp_off)
    assert len(results) == _cases()
    for r in results:
        assert not r.passed  # on CPU only bit identity passes
        assert dataclasses.replace(r, exact_required=False).passed, r
        assert r.worst_of_update < UPDATE_BOUND / 2, r


def test_a_host_scalar_bug_shared_with_the_reference_fails(monkeypatch, capsys):
    """The second moment's bias correction dropped in the host scalars, which the reference and
    every kernel take from contract.adam_scalars: no comparison with the reference can see it;
    the agreement with torch.optim.AdamW, now judged, does (reported at ~5e5 eps x max|p|)."""
    import dataclasses

    from mps_fused_adam import __main__ as cli
    from mps_fused_adam import backends
    from mps_fused_adam.numerics import contract, reference
    orig = contract.adam_scalars

    def buggy(hp):
        return orig(hp)._replace(d2=1.0)
    for module in (contract, reference, backends):
        monkeypatch.setattr(module, "adam_scalars", buggy)
    monkeypatch.setitem(contract.RULES, "adam", dataclasses.replace(contract.RULES["adam"], scalars=buggy))
    # The 8-bit rule's scalars (contract.adam8bit_scalars) call contract.adam_scalars too; the memo
    # of packed scalars cannot see a patched function, so it starts empty.
    monkeypatch.setattr(backends, "_PACKED", {})
    assert cli.main(["--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False
    failed = [r for r in report["self_check"] if not r["passed"]]
    assert failed and all(r["dtypes"] == "AdamW vs torch.optim.AdamW" for r in failed)
    assert {r["backend"] for r in failed} >= {"foreach"} and all(r["worst_in_eps"] > 1e4 for r in failed)


def test_torch_result_of_the_agreement_is_torch_optim_adamw():
    """The agreement check takes torch's result from its functional adamw (cheaper to import):
    it must be what torch.optim.AdamW(foreach=False) gives, bit for bit."""
    from mps_fused_adam.tools.selfcheck import _torch_adamw
    p0, grads, theirs = _torch_adamw(20, 3001, 0.01)
    tp = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=0.01, foreach=False)
    for g in grads:
        tp.grad = g.clone()
        opt.step()
    assert not torch.equal(p0, theirs) and torch.equal(tp.detach(), theirs)


def test_a_backend_that_raises_fails_its_cases_and_the_rest_still_runs(monkeypatch, capsys):
    from mps_fused_adam import __main__ as cli
    from mps_fused_adam import backends
    orig = backends.CPUBackend.update

    def explode_on_lion(self, rule, *args, **kwargs):
        if rule == "lion":
            raise RuntimeError("kernel exploded")
        return orig(self, rule, *args, **kwargs)
    monkeypatch.setattr(backends.CPUBackend, "update", explode_on_lion)
    assert cli.main(["--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)  # the whole report, not a traceback
    assert report["passed"] is False
    rows = report["self_check"]
    lion = [r for r in rows if r["backend"].startswith("_cpu (") and r["dtypes"].startswith("lion ")]
    assert lion and all(not r["passed"] and r["error"] == "RuntimeError: kernel exploded" for r in lion)
    others = [r for r in rows if r not in lion]
    assert all(r["passed"] and r["error"] is None for r in others)
    # the next backend was still checked: each rule per dtype pair, several tensors, torch.optim.AdamW
    assert sum(r["backend"] == "foreach" for r in others) == _cases() + 2
    assert cli.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"FAIL _cpu .* lion float32/float32 +raised RuntimeError: kernel exploded", out) and "self-check(s) FAILED" in out


def test_benchmark_without_the_compiled_cpu_kernel_leaves_the_floor_out(monkeypatch, capsys):
    """An install whose _cpu extension did not load (the CPU backend is then foreach): the floor
    runs in that extension, so the benchmark leaves it out and says so instead of crashing."""
    from mps_fused_adam import __main__ as cli
    from mps_fused_adam import backends
    from mps_fused_adam.tools import bench
    monkeypatch.setitem(sys.modules, "mps_fused_adam._cpu", None)  # import now raises ImportError
    monkeypatch.setitem(backends._chosen, "cpu", backends.ForeachBackend())
    monkeypatch.setattr(bench, "QUICK", dict(flat=4096, many=(4, 1024), repeats=3, foreach=False))
    rows = cli.benchmark(echo=True)
    out = capsys.readouterr().out
    assert "memory floor left out" in out and "'foreach'" in out
    assert len(rows) == 2 * (2 + 2 + 1)  # two shapes; ours and torch fused, ours alone for fp32 states
    assert {r["contender"] for r in rows} == {"ours", "torch fused"} and all(r["of_floor"] is None for r in rows)
    lines = bench.summary([bench.Row(**r) for r in rows])[2:]
    assert len(lines) == 6 and all(line.endswith("| - |") for line in lines)


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_json_has_no_infinity_when_a_code_differs(monkeypatch, capsys):
    """An 8-bit kernel storing one wrong code is infinitely wrong; --json printed that as
    ``Infinity``, which JSON parsers other than Python's reject. It is null now."""
    from mps_fused_adam import __main__ as cli
    from mps_fused_adam import backends
    orig = backends.CPUBackend.update

    def one_wrong_code(self, rule, params, grads, states, hp, sr_keys=None):
        orig(self, rule, params, grads, states, hp, sr_keys)
        if rule == "adam8bit":
            states[0][0][3] ^= 1
    monkeypatch.setattr(backends.CPUBackend, "update", one_wrong_code)
    assert cli.main(["--check", "--json"]) == 1
    report = _strict_json(capsys.readouterr().out)
    bad = [r for r in report["self_check"] if not r["passed"]]
    assert bad and all(r["dtypes"].startswith("adam8bit ") for r in bad)
    # Where the flipped code survives to the end it is infinitely wrong (fp16 re-quantizes it away).
    assert sum(r["worst_in_eps"] is None and r["worst_of_update"] is None for r in bad) >= 2


def test_a_backend_that_drops_all_but_the_first_tensor_of_a_call_fails(monkeypatch, capsys):
    """Every case used to hand the backend one tensor of 4099 elements per call: one thread of
    the CPU kernel, one tensor. A bug in the later tensors of a call went unseen."""
    from mps_fused_adam import __main__ as cli
    from mps_fused_adam import backends
    orig = backends.CPUBackend.update

    def first_only(self, rule, params, grads, states, hp, sr_keys=None):
        orig(self, rule, params[:1], grads[:1], [s[:1] for s in states], hp, None if sr_keys is None else sr_keys[:1])
    monkeypatch.setattr(backends.CPUBackend, "update", first_only)
    assert cli.main(["--check", "--json"]) == 1
    failed = [r for r in _strict_json(capsys.readouterr().out)["self_check"] if not r["passed"]]
    from mps_fused_adam.tools.selfcheck import many_sizes
    sizes = many_sizes(torch.get_num_threads())
    assert failed and all(r["backend"].startswith("_cpu (") and r["dtypes"].startswith(f"{len(sizes)} tensors, ")
                          for r in failed)
    # What the case covers: more than two minimum spans (32768 elements) per thread, tensor ends off
    # the kernel's 64-element thread boundaries.
    assert sum(sizes) > 2 * 32768 * torch.get_num_threads() and all(n % 64 for n in sizes) and len(sizes) > 1


@pytest.mark.parametrize("module", ["bench", "bench_rules"])
@pytest.mark.parametrize("argv, message", [
    (["--threads", "0"], "argument --threads: must be at least 1, got 0"),
    (["--threads", "2", "-2"], "argument --threads: must be at least 1, got -2"),
    (["--threads", "two"], "argument --threads: 'two' is not a whole number"),
    (["--repeats", "-1"], "argument --repeats: must be at least 1, got -1"),
    (["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),  # was silently ignored
])
def test_bench_rejects_thread_counts_and_rounds_below_one(module, argv, message, monkeypatch, capsys):
    import importlib
    bench = importlib.import_module(f"mps_fused_adam.tools.{module}")

    def must_not_run(*a, **k):
        raise AssertionError("the benchmark ran")
    monkeypatch.setattr(bench, "cpu_section" if module == "bench" else "rules_section", must_not_run)
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--quick", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("module", ["bench", "bench_rules"])
def test_bench_repeats_reach_the_run(module, monkeypatch):
    import importlib
    bench = importlib.import_module(f"mps_fused_adam.tools.{module}")
    seen = {}

    class Stop(Exception):
        pass

    def record(*args, **kwargs):
        seen["repeats"] = kwargs["repeats"] if module == "bench" else args[4]
        seen["threads"] = kwargs["thread_counts"] if module == "bench" else args[3]
        raise Stop
    monkeypatch.setattr(bench, "cpu_section" if module == "bench" else "rules_section", record)
    with pytest.raises(Stop):
        bench.main(["--quick", "--repeats", "1", "--threads", "1", "3"])
    assert seen == {"repeats": 1, "threads": [1, 3]}


@pytest.mark.parametrize("argv, message", [
    (["--mps-only", "--no-mps"], "--mps-only and --no-mps leave nothing to run"),
    (["--mps-only", "--plot", "out.png"], "--plot applies to the CPU section, which --mps-only leaves out"),
    (["--mps-only", "--threads", "2"], "--threads applies to the CPU section, which --mps-only leaves out"),
    (["--overhead", "--threads", "2"], "--threads does not apply to --overhead"),
    (["--overhead", "--plot", "out.png"], "--plot does not apply to --overhead"),
    (["--overhead", "--no-mps"], "--no-mps does not apply to --overhead"),
])
def test_bench_rejects_options_the_chosen_section_would_ignore(argv, message, monkeypatch, capsys):
    from mps_fused_adam.tools import bench, bench_mps, bench_overhead

    def must_not_run(*a, **k):
        raise AssertionError("a section ran")
    for module, name in ((bench, "cpu_section"), (bench_mps, "mps_benchmark_section"),
                         (bench_overhead, "overhead_section")):
        monkeypatch.setattr(module, name, must_not_run)
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("module, section, argv, expected", [
    ("bench_overhead", "overhead_section", ["--overhead"], {}),
    ("bench_overhead", "overhead_section", ["--overhead", "--quick"], {"repeats": 30}),
    ("bench_overhead", "overhead_section", ["--overhead", "--repeats", "5"], {"repeats": 5}),
    ("bench_mps", "mps_benchmark_section", ["--mps-only"], {}),
    ("bench_mps", "mps_benchmark_section", ["--mps-only", "--quick", "--repeats", "2"],
     {"numel": 8 * 2**20, "repeats": 2}),
])
def test_python_m_bench_runs_the_mps_and_overhead_sections(module, section, argv, expected, monkeypatch):
    """``python -m mps_fused_adam.bench --mps-only`` and ``--overhead`` run their section alone,
    with --repeats and --quick honoured."""
    import importlib
    import runpy
    mod = importlib.import_module(f"mps_fused_adam.tools.{module}")
    seen = []
    monkeypatch.setattr(mod, section, lambda **kwargs: seen.append(kwargs) or [])
    monkeypatch.setattr(sys, "argv", ["bench", *argv])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("mps_fused_adam.bench", run_name="__main__")
    assert exit_.value.code == 0 and seen == [expected]


def test_python_m_bench_mps_says_there_is_no_mps_device():
    run = subprocess.run([sys.executable, "-m", "mps_fused_adam.bench", "--mps-only"], capture_output=True, text=True,
                         timeout=120)
    import torch
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        pytest.skip("an MPS device is here: the section would run in full")
    assert run.returncode == 0 and "no MPS device" in run.stdout, run.stdout + run.stderr


_ENV_PROBE = """
import warnings
warnings.simplefilter("always")
import torch, mps_fused_adam as mfa
p = torch.nn.Parameter(torch.randn(4)); o = mfa.AdamW([p])
for _ in range(3):
    p.grad = torch.randn(4); o.step()
from mps_fused_adam import _cpu
print("POOL", _cpu.thread_pool())
"""


@pytest.mark.parametrize("name, value, message", [
    ("MPS_FUSED_ADAM_POOL", "Own", "MPS_FUSED_ADAM_POOL='Own' is not recognised (the only value is 'own'); "
                                   "using the default"),
    ("MPS_FUSED_ADAM_TENSOR_HANDLES", "off", "MPS_FUSED_ADAM_TENSOR_HANDLES='off' is not 0 or 1; using the "
                                             "tensor handles"),
    ("MPS_FUSED_ADAM_POOL", "own", None),
    ("MPS_FUSED_ADAM_TENSOR_HANDLES", "0", None),
])
def test_unrecognised_env_values_warn_once(name, value, message):
    """Both variables used to take any other value silently, as the default; now they say so, once
    (as MPS_FUSED_ADAM_SIMD and _PREFETCH do), and the recognised values stay quiet."""
    import os
    env = dict(os.environ, **{name: value})
    run = subprocess.run([sys.executable, "-c", _ENV_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    warned = [line for line in run.stderr.splitlines() if "RuntimeWarning" in line and name in line]
    if message is None:
        assert warned == [], run.stderr
    else:
        assert len(warned) == 1 and message in warned[0], run.stderr


def test_bench_rules_reports_speed_against_torch_fused_where_it_runs(monkeypatch, capsys):
    """torch's fused Adagrad is a contender, yet the column was always '-'."""
    from mps_fused_adam.tools import bench_rules
    monkeypatch.setattr(bench_rules, "_contenders", lambda rule, params, pd, sd: {})
    monkeypatch.setattr(bench_rules, "interleaved", lambda contenders, repeats: {
        "ours": 1.0, "floor": 0.5, "torch foreach": 8.0, "torch fused": 2.5})
    rows = bench_rules.rules_section(["adagrad"], 64, (2, 64), [1], 1)
    ours = [r for r in rows if r.contender == "ours"]
    assert len(ours) == 6 and all(r.vs_torch_fused == 2.5 and r.of_floor == 0.5 for r in ours)
    assert [r.vs_torch_fused for r in rows if r.contender == "torch foreach"][0] == 2.5 / 8.0
    assert "| 0.50 | 2.50x |" in capsys.readouterr().out


def test_spread_note_says_min_and_max_below_four_rounds():
    from mps_fused_adam.tools.bench import SPREAD_NOTE, spread_note
    from mps_fused_adam.tools.timing import ratio_spread
    assert spread_note(4) == SPREAD_NOTE and "middle half" in SPREAD_NOTE
    assert "lowest and highest of those ratios (only 3 rounds: no quartiles)" in spread_note(3)
    assert ratio_spread([2.0, 2.0, 2.0], [1.0, 4.0, 2.5]) == (0.8, 0.5, 2.0)  # median, min, max


def test_json_carries_the_benchmark_notes_and_warnings(monkeypatch, capsys):
    """--json readers saw neither the busy-machine note nor a warning such as the SIMD fallback."""
    from mps_fused_adam import __main__ as cli
    from mps_fused_adam import backends
    from mps_fused_adam.tools import bench
    monkeypatch.setattr(bench, "QUICK", dict(flat=4096, many=(4, 1024), repeats=3, foreach=False))
    monkeypatch.setattr(bench, "noise_note", lambda rows, rounds: "note: ratios moved by up to +-40%")
    monkeypatch.setenv("MPS_FUSED_ADAM_SIMD", "neon" if "neon" not in backends.get_backend("cpu")._cpu.simd_paths()
                       else "avx2")
    monkeypatch.delitem(backends._chosen, "cpu")  # chosen again, in the command: the warning comes then
    monkeypatch.setattr(cli, "self_check", lambda echo: [])  # checked elsewhere; keeps this test short
    with pytest.warns(RuntimeWarning, match="MPS_FUSED_ADAM_SIMD="):  # still warned, as well as recorded
        assert cli.main(["--json"]) == 0
    captured = capsys.readouterr()
    report = _strict_json(captured.out)
    assert report["benchmark_notes"][0].startswith("speed vs torch fused") and "only 3 rounds" in report["benchmark_notes"][0]
    assert report["benchmark_notes"][1:] == ["note: ratios moved by up to +-40%"]
    assert any("MPS_FUSED_ADAM_SIMD=" in w and "is not supported on this CPU" in w for w in report["warnings"])


# ---- the report at a glance, and a stdout that cannot be written (issue 35 item 10) ------------

def _shrunk(monkeypatch):
    from mps_fused_adam.tools import bench
    monkeypatch.setattr(bench, "QUICK", dict(flat=4096, many=(4, 1024), repeats=5, foreach=False))


def test_default_report_fits_a_screen_and_verbose_lists_every_check(monkeypatch, capsys):
    """By default: one line per self-checked backend with its count, one benchmark row per case,
    at most about 30 lines; --verbose adds a line per case and per contender."""
    from mps_fused_adam import __main__ as cli
    _shrunk(monkeypatch)
    assert cli.main([]) == 0
    short = capsys.readouterr().out.rstrip().splitlines()
    assert cli.main(["--verbose"]) == 0
    full = capsys.readouterr().out.rstrip().splitlines()
    assert len(short) <= 30, "\n".join(short)
    cases = [line for line in full if re.match(r"  (ok|FAIL) +\S", line) and " eps" in line and "cases" not in line]
    backends = [line for line in short if re.match(r"  ok +\S.* \d+/\d+ cases \(", line)]
    counts = {m.group(1): int(m.group(2)) for line in backends
              if (m := re.match(r"  ok +(.+?) +\d+/(\d+) cases", line))}
    assert counts and sum(counts.values()) == len(cases)  # every case counted on its backend's line
    assert short[-1].startswith("summary: ") and full[-1].startswith("summary: ")
    table = [line for line in short if line.startswith("| ") and "ns/elem" not in line]
    assert len(table) == 6  # fp32, bf16/bf16, bf16/fp32 states on two shapes
    assert sum(line.startswith("| ") for line in full) > len(table) + 2


@pytest.mark.parametrize("half_iqr,shown", [(0.02, True), (0.5, False)])
def test_speeds_carry_their_spread_only_when_it_means_something(half_iqr, shown):
    """A tight spread is printed with the ratio; a wide one leaves the median and says the
    machine is busy (the same tolerance as the benchmark's noise note)."""
    from mps_fused_adam import __main__ as cli
    from mps_fused_adam.tools import bench
    row = dict(case="flat 4M", dtypes="fp32", threads=2, contender="ours", ns_per_elem=1.0, gbps=1.0, of_floor=0.9,
               vs_torch_fused=1.2, vs_torch_fused_spread=(1.2 - half_iqr, 1.2 + half_iqr))
    cell, steady = cli._speed_cell(row, bench.QUICK["repeats"])
    assert steady is shown
    assert cell == (f"1.20x ({1.2 - half_iqr:.2f}-{1.2 + half_iqr:.2f})" if shown else "1.20x (median)")


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["text", "json"])
@pytest.mark.parametrize("redirect", ["closed", "full"])
def test_a_closed_or_full_stdout_exits_quietly_with_the_checks_status(redirect, json_flag):
    """``--check >&-`` used to raise AttributeError and exit 1; ``>/dev/full`` an OSError with a
    traceback. Now: no output on stderr, the self-check's own status."""
    if redirect == "full" and not __import__("os").path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    stdout = subprocess.DEVNULL if redirect == "closed" else open("/dev/full", "w")
    try:
        kw = {"stdout": stdout} if redirect == "full" else {"close_fds": True}
        cmd = [sys.executable, "-m", "mps_fused_adam", "--check", *json_flag]
        if redirect == "closed":  # the child's descriptor 1 closed, as the shell's >&- does
            cmd = ["sh", "-c", 'exec "$@" >&-', "sh", *cmd]
        run = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, timeout=300, **kw)
    finally:
        if redirect == "full":
            stdout.close()
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_a_failed_check_keeps_its_status_without_stdout(monkeypatch):
    from mps_fused_adam import __main__ as cli
    from mps_fused_adam.tools import selfcheck
    bad = selfcheck.CheckResult("_cpu (test)", "cpu", "float32/float32", 9.5, False)
    monkeypatch.setattr(selfcheck, "all_checks", lambda: iter([bad]))
    monkeypatch.setattr(sys, "stdout", None)  # what Python sets for a closed descriptor 1
    assert cli.main(["--check"]) == 1 and cli.main(["--check", "--json"]) == 1
    assert sys.stdout is None  # restored for the caller
