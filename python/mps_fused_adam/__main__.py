"""``python -m mps_fused_adam``: versions, backends (and why the others are not available), the
SIMD path and thread count, a self-check of every available backend, and a short benchmark.
``--help`` lists the options; the exit status is non-zero if a self-check fails.

By default the text report fits a screen (about 30 lines: one line per self-checked backend, one
benchmark row per case); ``--verbose`` prints every check and every contender. A stdout that is
closed, full or whose reader went away costs the report, never the exit status: the checks still
run and the command exits with their status, quietly (``quiet_stdout``)."""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import statistics
import sys
import warnings
from typing import Any, Optional

from ._version import __version__

EXIT_OK, EXIT_CHECK_FAILED = 0, 1  # argparse exits with 2 on a usage error


def build_parser() -> argparse.ArgumentParser:
    """The command line. Parsed before torch is imported, so ``--help`` answers at once."""
    # The usage line names the program as the user typed it: the console script or `python -m`.
    invoked = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    ap = argparse.ArgumentParser(
        prog="mps-fused-adam" if invoked == "mps-fused-adam" else "python -m mps_fused_adam",
        description="Report versions and available backends, check every backend against the reference "
                    "implementation, and run a short benchmark.",
        epilog="Exit status: 0 when every self-check passes, 1 when one fails, 2 on a usage error. "
               "The full benchmark is python -m mps_fused_adam.bench.")
    ap.add_argument("--version", action="version", version=f"mps_fused_adam {__version__}")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--no-bench", action="store_true", help="skip the short benchmark (report and self-check only)")
    what.add_argument("--check", "--self-check-only", dest="check_only", action="store_true",
                      help="run only the self-check: no environment report, no benchmark")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object (report, self-check, benchmark rows) instead of text")
    ap.add_argument("--verbose", "-v", action="store_true",
                    help="print every self-check case and every benchmark contender (the default prints one "
                         "line per backend and one row per case)")
    return ap


def environment() -> dict[str, Any]:
    """Versions, devices, threads and the backend of each device type, with the reasons why the
    other backends are not used."""
    import torch

    from . import backend_info
    try:  # metadata only: importing deepspeed takes seconds and probes accelerators
        from importlib.metadata import version
        deepspeed: Optional[str] = version("deepspeed")
    except Exception:
        deepspeed = None
    mps = getattr(torch.backends, "mps", None)
    return {"mps_fused_adam": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "platform": f"{platform.system()} {platform.machine()}", "deepspeed": deepspeed,
            "mps_available": bool(mps is not None and mps.is_available()),
            "threads": torch.get_num_threads(), "backends": backend_info()}


def print_environment(env: dict[str, Any]) -> None:
    print(f"mps_fused_adam {env['mps_fused_adam']}  torch {env['torch']}  Python {env['python']}  {env['platform']}")
    print(f"deepspeed {env['deepspeed']} installed (see mps_fused_adam.deepspeed.install())" if env["deepspeed"]
          else "deepspeed: not installed")
    print(f"MPS device: {'available' if env['mps_available'] else 'not available'}")
    print(f"threads: {env['threads']} (torch.get_num_threads(), followed by the CPU kernel)")
    print("\nBackends:")
    for device, info in env["backends"].items():
        extra = f", SIMD {info['simd']}" if "simd" in info else ""
        print(f"  {device}: {info['backend']}{extra}")
        for reason in info["unavailable"]:
            print(f"    not used: {reason}")
        if "fast_math" in info:
            print(f"    fast math: {info['fast_math']}")
    if not env["mps_available"]:
        print("  mps: no MPS device here; the Metal tiers run on Apple Silicon only")


SELF_CHECK_TITLE = "Self-check against the reference"


def _check_line(r: dict[str, Any]) -> str:
    what = (f"raised {r['error']}" if r["error"] else
            f"worst {r['worst_in_eps']:.3g} eps{'  (bit-exact)' if r['bit_exact'] else ''}")
    return f"  {'ok' if r['passed'] else 'FAIL':4} {r['backend']:18} {r['device']:4} {r['dtypes']:26} {what}"


def print_environment_short(env: dict[str, Any]) -> None:
    """Versions on one line; per device the backend in use and why the others are not."""
    ds = f"  deepspeed {env['deepspeed']}" if env["deepspeed"] else ""
    print(f"mps_fused_adam {env['mps_fused_adam']}  torch {env['torch']}  Python {env['python']}  "
          f"{env['platform']}{ds}  threads {env['threads']}")
    print("Backends:")
    for device, info in env["backends"].items():
        extra = f" (SIMD {info['simd']})" if "simd" in info else ""
        print(f"  {device}: {info['backend']}{extra}")
        for reason in info["unavailable"]:
            print(f"    not used: {reason}")
    if not env["mps_available"]:
        print("  mps: no MPS device here; the Metal tiers run on Apple Silicon only")


def self_check(echo: bool) -> list[dict[str, Any]]:
    """Every available backend against the reference; printed line by line as it runs if ``echo``."""
    from .tools.selfcheck import UPDATE_BOUND, CheckResult, all_checks, tier_lines
    if echo:
        print(f"{SELF_CHECK_TITLE} (on CPU: bit for bit; elsewhere within 8 eps x max|ref| "
              f"and {UPDATE_BOUND:g} of each tensor's movement):")
        for line in tier_lines():  # every MPS tier, loaded or not, and the kernels it refuses
            print(line)
    results = []
    checks = all_checks()
    while True:
        try:
            r = next(checks)
        except StopIteration:
            break
        except Exception as exc:  # outside any one case (choosing a backend, a SIMD path): the rest is lost
            r = CheckResult("self-check", "-", "-", math.inf, False, error=f"{type(exc).__name__}: {exc}")
            checks = iter(())
        results.append({"backend": r.backend, "device": r.device, "dtypes": r.dtypes,
                        "worst_in_eps": r.worst_in_eps, "worst_of_update": r.worst_of_update,
                        "bit_exact": r.bit_exact, "exact_required": r.exact_required, "passed": r.passed,
                        "error": r.error})
        if echo:
            print(_check_line(results[-1]), flush=True)
    return results


def print_checks_short(results: list[dict[str, Any]]) -> None:
    """One line per backend: its count of passed cases and how close they came; every failed case
    on a line of its own below it."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by.setdefault(r["backend"], []).append(r)
    for backend, rs in by.items():
        passed = sum(r["passed"] for r in rs)
        exact = sum(r["bit_exact"] for r in rs)
        rest = [r["worst_in_eps"] for r in rs if not r["bit_exact"] and r["error"] is None]
        how = f"{exact} bit-exact" + (f", the rest within {max(rest):.3g} eps" if rest else "")
        print(f"  {'ok' if passed == len(rs) else 'FAIL':4} {backend:18} {passed}/{len(rs)} cases ({how})")
        for r in rs:
            if not r["passed"]:
                print(_check_line(r))


def benchmark(echo: bool, notes: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """The short CPU benchmark (``bench.QUICK``) at the current thread count; what it says about
    its own figures (a busy machine, no floor, fewer than 4 rounds) is appended to ``notes``."""
    notes = [] if notes is None else notes
    from dataclasses import asdict

    import torch

    from .tools import bench
    if echo:
        print("Short benchmark (python -m mps_fused_adam.bench for the full one):")
        print(bench.spread_note(bench.QUICK["repeats"]))
        if bench.floor_available():
            print(bench.QUICK_SIZE_NOTE)
    if bench.QUICK["repeats"] < 4:
        notes.append(bench.spread_note(bench.QUICK["repeats"]))
    if not bench.floor_available():
        notes.append(bench.floor_missing_note())
        if echo:
            print(notes[-1])
    if echo:
        print(bench.HEADER)
        print("|---|---|---|---|---|---|---|---|")
    rows = bench.cpu_section(thread_counts=[torch.get_num_threads()], deepspeed=False, echo=echo, **bench.QUICK)
    note = bench.noise_note(rows, bench.QUICK["repeats"])
    if note:
        notes.append(note)
        if echo:
            print(note)
    return [asdict(r) for r in rows]


def _speed_cell(row: dict[str, Any], rounds: int) -> tuple[str, bool]:
    """``ours vs torch fused`` of a row, with its spread when the median is known to within
    ``bench.noise_note``'s tolerance; otherwise the median alone, marked, and False."""
    from .tools import bench
    if row["vs_torch_fused"] is None:
        return "-", True
    error = bench.median_uncertainty(bench.Row(**row), rounds)
    if error is not None and error <= bench.NOISE_TOLERANCE:
        lo, hi = row["vs_torch_fused_spread"]
        return f"{row['vs_torch_fused']:.2f}x ({lo:.2f}-{hi:.2f})", True
    return f"{row['vs_torch_fused']:.2f}x (median)", False


def print_benchmark_short(rows: list[dict[str, Any]]) -> None:
    """One row per case: ours and torch's fused AdamW in ns per element, ours against it and
    against the memory floor; the spread only where it means something."""
    from .tools import bench
    rounds = bench.QUICK["repeats"]
    print(f"Short benchmark, {rounds} interleaved rounds at {rows[0]['threads'] if rows else '-'} threads "
          f"(--verbose: every contender; python -m mps_fused_adam.bench: the full one):")
    print("| case | dtypes | ours ns/elem | torch fused ns/elem | ours vs torch fused | ours vs floor |")
    print("|---|---|---|---|---|---|")
    steady = True
    for case in dict.fromkeys((r["case"], r["dtypes"]) for r in rows):
        by = {r["contender"]: r for r in rows if (r["case"], r["dtypes"]) == case}
        ours, theirs = by[bench.OURS], by.get("torch fused")
        cell, ok = _speed_cell(ours, rounds)
        steady &= ok
        floor = "-" if ours["of_floor"] is None else f"{ours['of_floor']:.2f}"
        print(f"| {case[0]} | {case[1]} | {ours['ns_per_elem']:.3f} | "
              f"{'-' if theirs is None else format(theirs['ns_per_elem'], '.3f')} | {cell} | {floor} |")
    print("ratios above 1: ours is faster; in brackets the middle half of the round-by-round ratios" if steady else
          "the machine is busy (the rounds moved too much for their spread to mean anything): the ratios are "
          "medians; rerun on an idle machine before drawing conclusions")


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float as None: json.dump writes them as ``Infinity`` and
    ``NaN``, which are not JSON (a failed check's worst difference is infinite)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class QuietStdout(io.TextIOBase):
    """stdout for the command's report: a write that fails (a closed descriptor, a full disk,
    ``| head`` gone) makes it ``lost`` and drops the rest, so the checks run to the end and
    their status is still the exit status. The report is worth less than the status it reports."""

    def __init__(self, stream: Optional[Any]) -> None:
        super().__init__()
        self._stream = stream
        self.lost = stream is None  # `python -m mps_fused_adam >&-`: Python's sys.stdout is None

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                self._stream.write(text)
            except (OSError, ValueError):  # ValueError: the stream was closed under us
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._lose()

    def _lose(self) -> None:
        self.lost = True
        # What the real stream still buffers would fail again at the interpreter's exit flush
        # (printing "Exception ignored ... BrokenPipeError"): its descriptor goes to /dev/null.
        try:
            fd = self._stream.fileno()
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass


def main(argv: Optional[list[str]] = None) -> int:
    """The command; returns its exit status (also the console script ``mps-fused-adam``)."""
    out = QuietStdout(sys.stdout)
    real, sys.stdout = sys.stdout, out
    try:
        status = _main(argv, out)
        out.flush()  # a closed pipe or a full disk shows here, not in the interpreter's exit flush
        return status
    finally:
        sys.stdout = real


def _main(argv: Optional[list[str]], out: Optional[QuietStdout] = None) -> int:
    args = build_parser().parse_args(argv)
    report: dict[str, Any] = {}
    # Warnings (an MPS_FUSED_ADAM_SIMD path this CPU lacks, a tier that did not load) go to stderr
    # as always, and into the report, where --json readers would otherwise never see them.
    with warnings.catch_warnings(record=True) as caught:
        failed = _run(args, report, lost=lambda: out is not None and out.lost)
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if caught:
        report["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    report["summary"] = summary(report)
    if args.json:
        json.dump(_json_safe(report), sys.stdout, indent=1, allow_nan=False)
        print()
    else:
        print(f"\n{report['summary']['line']}")
    return EXIT_CHECK_FAILED if failed else EXIT_OK


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The run in one line: checks passed per backend, and the benchmark's headline, ours against
    torch fused as the median over the benchmark's cases with their range."""
    per_backend: dict[str, list[int]] = {}
    for r in report.get("self_check", []):
        counts = per_backend.setdefault(r["backend"], [0, 0])
        counts[0] += bool(r["passed"])
        counts[1] += 1
    agreement = report.get("torch_agreement")
    passed = sum(c[0] for c in per_backend.values()) + bool(agreement and agreement["passed"])
    total = sum(c[1] for c in per_backend.values()) + (agreement is not None)
    checks = ", ".join(f"{name} {p}/{n}" for name, (p, n) in per_backend.items())
    line = f"summary: {passed}/{total} checks passed ({checks}" + (
        f", reference vs torch.optim.AdamW {'ok' if agreement['passed'] else 'FAILED'})" if agreement else ")")
    out: dict[str, Any] = {"checks_passed": passed, "checks": total,
                           "per_backend": {k: {"passed": p, "checks": n} for k, (p, n) in per_backend.items()}}
    ratios = sorted(r["vs_torch_fused"] for r in report.get("benchmark", [])
                    if r["contender"] == "ours" and r["vs_torch_fused"] is not None)
    if ratios:
        out["vs_torch_fused"] = {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1],
                                 "cases": len(ratios)}
        line += (f"; speed vs torch fused {out['vs_torch_fused']['median']:.2f}x (median of {len(ratios)} cases, "
                 f"{ratios[0]:.2f}x to {ratios[-1]:.2f}x)")
    elif "benchmark" in report:
        line += "; benchmark: no torch fused to compare with"
    out["line"] = line
    return out


def _run(args: argparse.Namespace, report: dict[str, Any], lost=lambda: False) -> int:
    """The report's sections, into ``report``; returns how many checks failed. ``lost()``: stdout
    can no longer be written, so the benchmark (which only prints) is left out."""
    text = not args.json
    verbose = text and args.verbose
    if not args.check_only:
        report["environment"] = environment()
        if text:
            (print_environment if verbose else print_environment_short)(report["environment"])
            print()
    if text and not verbose:
        print(SELF_CHECK_TITLE + " (--verbose lists every case):")
        from .tools.selfcheck import tier_lines
        for line in tier_lines():  # every MPS tier on one line: its state, the kernels it refuses
            print(line)
    report["self_check"] = self_check(echo=verbose)
    if text and not verbose:
        print_checks_short(report["self_check"])
    failed = sum(not r["passed"] for r in report["self_check"])
    if not args.check_only:
        from .tools.selfcheck import torch_agreement
        a = report["torch_agreement"] = torch_agreement()
        failed += not a["passed"]
        if text:
            verdict = "ok" if a["passed"] else "FAIL"
            what = (f"the contract (the reference) against torch.optim.AdamW (fp32, 100 steps, 100K params): "
                    f"{a['identical']:.1%} bit-identical, mean {a['mean_ulps']:.2f} ulps, largest difference "
                    f"{a['max_in_eps']:.3g} eps x max|p| (bound {a['bound']:g})")
            print(f"\n{verdict}: {what}" if verbose else f"  {verdict:4} {what}")
    report["passed"] = failed == 0
    if failed and text:
        print(f"\n{failed} self-check(s) FAILED")
    if not (failed or args.check_only or args.no_bench or lost()):
        if text:
            print()
        notes: list[str] = []
        report["benchmark"] = benchmark(echo=verbose, notes=notes)
        if notes:
            report["benchmark_notes"] = notes
        if text and not verbose:
            print_benchmark_short(report["benchmark"])
    return failed


if __name__ == "__main__":
    sys.exit(main())
