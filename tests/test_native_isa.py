"""The arm64 NEON build of the CPU kernel, cross-compiled and run under qemu-aarch64, against the
scalar build, bit for bit. (The x86 SIMD builds run natively in test_cpu_kernel.py.)"""
from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import require_tool

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "cpu"
FLAGS = ["-std=c++17", "-O2", "-ffp-contract=off", "-fno-math-errno", "-fno-fast-math", "-static"]


def test_neon_matches_scalar_under_qemu(tmp_path):
    cxx, qemu = require_tool("aarch64-linux-gnu-g++", "qemu-aarch64")
    exe = tmp_path / "isa_parity"
    subprocess.run([cxx, *FLAGS, f"-I{SRC}", "-DMFA_NATIVE_NS=isa_neon", str(ROOT / "tests/native/isa_parity.cpp"),
                    str(SRC / "adam_scalar.cpp"), str(SRC / "adam_neon.cpp"), "-o", str(exe)], check=True)
    run = subprocess.run([qemu, str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "neon vs scalar" in run.stdout
    assert " 0 failed" in run.stdout and " 0 passed" not in run.stdout, run.stdout
