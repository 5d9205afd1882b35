"""The SIMD builds of the CPU kernel against the scalar build, bit for bit, in a native harness
(tests/support/native/isa_parity.cpp): arm64 NEON cross-compiled and run under qemu-aarch64, and each x86
build the CPU here runs natively. The harness reaches what the Python API cannot, such as
stochastic rounding at element indices across 2^32. (The x86 builds also run through the
extension in test_cpu_kernel.py.)"""
from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

import pytest

from conftest import require_tool

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "cpu"
FLAGS = ["-std=c++17", "-O2", "-ffp-contract=off", "-fno-math-errno", "-fno-fast-math", "-static"]


def _assert_every_rule_ran(stdout: str) -> None:
    """The harness's totals, and a line per rule of MFA_RULES (adam_types.h) with cases and no mismatch."""
    assert re.search(r"^\d+ passed, 0 failed$", stdout, re.M) and "\n0 passed" not in stdout, stdout
    names = re.findall(r'X\(\s*\w+\s*,\s*"(\w+)"', (SRC / "adam_types.h").read_text())
    assert names
    for name in names:
        assert re.search(rf"^rule {name}: [1-9]\d* cases, 0 mismatches$", stdout, re.M), (name, stdout)


def _kernel_tables(tmp_path: Path) -> str:
    """lowbit's two kernel tables (signed, then unsigned) in one file, for the harness's 8-bit part."""
    from mps_fused_adam.numerics import lowbit

    path = tmp_path / "kernel_tables.bin"
    path.write_bytes(lowbit.kernel_table(True).numpy().tobytes() + lowbit.kernel_table(False).numpy().tobytes())
    return str(path)


def _assert_search_checked(stdout: str) -> None:
    """The 8-bit search's near-midpoint cases ran for both maps, with and without the floor."""
    assert "MISMATCH quantize" not in stdout, stdout


def test_neon_matches_scalar_under_qemu(tmp_path):
    cxx, qemu = require_tool("aarch64-linux-gnu-g++", "qemu-aarch64")
    exe = tmp_path / "isa_parity"
    subprocess.run([cxx, *FLAGS, f"-I{SRC}", "-DMFA_NATIVE_NS=isa_neon", str(ROOT / "tests/support/native/isa_parity.cpp"),
                    str(SRC / "adam_scalar.cpp"), str(SRC / "adam_neon.cpp"), "-o", str(exe)], check=True)
    run = subprocess.run([qemu, str(exe), _kernel_tables(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "neon vs scalar" in run.stdout
    _assert_every_rule_ran(run.stdout)
    _assert_search_checked(run.stdout)


# The /proc/cpuinfo flags each x86 build needs; its compiler flags come from cmake/cpu_adam.cmake.
X86_NEEDS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx2", "fma", "f16c"},
    "avx512bf16": {"avx512f", "avx512_bf16", "avx512dq", "avx512vl", "avx512bw", "avx512vbmi", "avx2", "fma",
                   "f16c"},
}


def _build_flags(isa: str) -> list[str]:
    """The -m flags cmake/cpu_adam.cmake gives the ``isa`` build (``mfa_isa_objects(isa ...)``)."""
    text = (ROOT / "cmake" / "cpu_adam.cmake").read_text()
    match = re.search(rf"^\s*mfa_isa_objects\({isa}\s+([^)]*)\)", text, re.MULTILINE)
    assert match, f"no mfa_isa_objects({isa} ...) in cmake/cpu_adam.cmake"
    return match.group(1).split()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


@pytest.mark.parametrize("isa", list(X86_NEEDS))
def test_x86_build_matches_scalar_natively(tmp_path, isa):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"an x86-64 build; this machine is {platform.machine()}")
    missing = X86_NEEDS[isa] - _cpu_flags()
    if missing:
        cpu = "CPU with AVX-512" if isa.startswith("avx512") else "CPU with AVX2"
        pytest.skip(f"this CPU lacks {sorted(missing)}, which the {isa} build needs (a {cpu} runs it)")
    [cxx] = require_tool("g++")
    base = [cxx, *[f for f in FLAGS if f != "-static"], f"-I{SRC}"]
    objs = []
    for src, extra in ((ROOT / "tests/support/native/isa_parity.cpp", [f"-DMFA_NATIVE_NS=isa_{isa}"]),
                       (SRC / "adam_scalar.cpp", []), (SRC / f"adam_{isa}.cpp", _build_flags(isa))):
        obj = tmp_path / (src.stem + ".o")
        subprocess.run([*base, *extra, "-c", str(src), "-o", str(obj)], check=True)
        objs.append(str(obj))
    exe = tmp_path / "isa_parity"
    subprocess.run([cxx, *objs, "-o", str(exe)], check=True)
    run = subprocess.run([str(exe), _kernel_tables(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{isa} vs scalar" in run.stdout
    _assert_every_rule_ran(run.stdout)
    _assert_search_checked(run.stdout)
