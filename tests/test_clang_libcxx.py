"""Apple's compiler family on the C++ sources: clang++ with libc++ parses every source of the
``_cpu`` extension (the list and each SIMD build's flags read from cmake/cpu_adam.cmake) and the
native parity harness, with -Wall -Wextra -Werror. A macOS build compiles them with Apple clang
and libc++, where a header that libstdc++ pulls in by accident, or an overload that libc++
declares differently, fails; g++ (the Linux builds) never shows it. The host emulator's own
clang build is the ``clang-libc++`` leg of conftest.emulator_cxx. Syntax and types only: nothing
is linked or run here.
"""
from __future__ import annotations

import platform
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import clang_libcxx, require_tool

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "cpu"
CMAKE = ROOT / "cmake" / "cpu_adam.cmake"
FLAGS = ["-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off",
         "-fno-math-errno", "-fno-fast-math"]
X86 = platform.machine() in ("x86_64", "AMD64")


def module_sources() -> list[Path]:
    """The sources nanobind_add_module(_cpu ...) lists, besides the SIMD objects."""
    match = re.search(r"nanobind_add_module\(_cpu\s+NB_STATIC\s+([^)]*)\)", CMAKE.read_text())
    assert match, "no nanobind_add_module(_cpu NB_STATIC ...) in cmake/cpu_adam.cmake"
    return [ROOT / s for s in match.group(1).split() if s.endswith(".cpp")]


def isa_builds() -> dict[str, list[str]]:
    """Each mfa_isa_objects(name flags...) of cmake/cpu_adam.cmake: name -> its flags."""
    found = re.findall(r"^\s*mfa_isa_objects\((\w+)([^)]*)\)", CMAKE.read_text(), re.M)
    return {name: flags.split() for name, flags in found}


def test_the_lists_are_read():
    """The cmake file's shapes that the checks below parse are still there."""
    names = {p.name for p in module_sources()}
    assert {"bindings.cpp", "dispatch.cpp", "step.cpp", "thread_pool.cpp", "adam8bit.cpp", "adam4bit.cpp"} <= names
    assert all(p.is_file() for p in module_sources())
    assert {"scalar", "neon", "avx2", "avx512", "avx512bf16"} <= set(isa_builds())


def _parse(cmd: list[str], sources: list[Path]) -> None:
    proc = subprocess.run([*cmd, *FLAGS, *(str(s) for s in sources)], capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} on {[s.name for s in sources]}:\n{proc.stderr[-6000:]}"


@pytest.mark.skipif(sys.platform == "darwin", reason="on macOS the wheel build compiles them with Apple clang")
def test_module_sources_parse_with_libcxx():
    import nanobind
    nb_inc = Path(nanobind.include_dir())
    inc = ["-isystem", str(nb_inc), "-isystem", str(nb_inc.parent / "ext" / "robin_map" / "include"),
           "-isystem", sysconfig.get_paths()["include"]]
    _parse([*clang_libcxx(), *inc], module_sources())


@pytest.mark.skipif(sys.platform == "darwin", reason="on macOS the wheel build compiles them with Apple clang")
@pytest.mark.parametrize("isa", sorted(isa_builds()))
def test_simd_builds_parse_with_libcxx(isa):
    """Each SIMD build with its own flags; neon for arm64 (an arm64 Mac's build) through the
    target's C headers, which the aarch64 cross toolchain brings on an x86-64 host."""
    flags = isa_builds()[isa]
    target: list[str] = []
    if isa == "neon" and X86:
        require_tool("aarch64-linux-gnu-g++")  # its sysroot holds the aarch64 C headers
        target = ["--target=aarch64-linux-gnu"]
    elif isa.startswith("avx") and not X86:
        pytest.skip(f"an x86-64 build; this machine is {platform.machine()}")
    _parse([*clang_libcxx(), *target, *flags, f"-I{SRC}"], [SRC / f"adam_{isa}.cpp"])


@pytest.mark.skipif(sys.platform == "darwin", reason="tests/test_native_isa.py and test_cpu_4bit.py build them on Linux only")
@pytest.mark.parametrize("harness", ["isa_parity.cpp", "q4_parity.cpp"])
def test_parity_harness_parses_with_libcxx(harness):
    _parse([*clang_libcxx(), f"-I{SRC}", "-DMFA_NATIVE_NS=isa_scalar"], [ROOT / "tests" / "support" / "native" / harness])
