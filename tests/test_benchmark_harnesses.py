"""The C++ benchmark harnesses under benchmarks/ (the README's evidence for what the CPU kernel
does and does not ship) still build against the kernel sources: each with the g++ flags its own
header gives. Two had stopped linking when the kernel gained the far prefetch (a new function the
kernel calls, which each harness defines for itself) and nothing noticed. Built at -O0: only
whether they compile and link is checked here; the harnesses check their own numerics when run."""
from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mavx512vbmi", "-mavx2",
          "-mfma", "-mf16c"]
CONTRACT = ["-ffp-contract=off", "-fno-math-errno"]
# harness: its flags beyond -O0 (as its header or its Python driver gives them)
HARNESSES = {
    "diag_divsqrt.cpp": ["-mavx512f"],
    "diag_rule_math.cpp": ["-std=c++20", *CONTRACT, *AVX512, "-Isrc/cpu", "-pthread"],
    "diag_sqrt_split.cpp": ["-std=c++20", *CONTRACT, *AVX512, "-Isrc/cpu", "-pthread"],
    "diag_sr_hash.cpp": ["-std=c++17", *CONTRACT, *AVX512, "-mvaes", "-maes", "-Isrc/cpu"],
    # diag_q8_ablation.py builds it once per variant, each with the kernel header patched; the
    # unpatched header and the first variant's name are enough to see that it still links.
    "diag_q8_ablation.cpp": ["-std=c++20", *CONTRACT, *AVX512, "-pthread", '-DDIAG_VARIANT="full"', "-Isrc/cpu"],
}


def test_every_harness_is_listed():
    assert sorted(HARNESSES) == sorted(p.name for p in (ROOT / "benchmarks").glob("*.cpp"))


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_harness_builds(name, tmp_path):
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None:
        pytest.skip("the harnesses are x86-64 AVX-512 programs built with g++")
    proc = subprocess.run(["g++", "-O0", *HARNESSES[name], f"benchmarks/{name}", "-o", str(tmp_path / "harness")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
