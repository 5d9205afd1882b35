"""A build without a C++ compiler stops with the project's message (what to install, per platform),
not CMake's "Could not find compiler set in environment variable CXX", whatever CXX holds:
scikit-build-core sets CXX from Python's sysconfig (`g++` on Linux builds of CPython) when the
user has not, so an unset CXX is not what a user's build sees.

The configure runs with a PATH holding only cmake (and ninja for pip's build), so no compiler can
be found however the machine is equipped.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import cannot_run, require_tool

ROOT = Path(__file__).resolve().parents[1]
MESSAGE = "mps-fused-adam: no C++ compiler found"


def _bare_path(tmp_path: Path, *tools: str) -> str:
    """A directory holding links to ``tools`` only, for PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        (bin_dir / Path(tool).name).symlink_to(tool)
    return str(bin_dir)


def _sysconfig_cxx() -> str:
    """The CXX scikit-build-core would set: sysconfig's, its flags dropped (g++ when Python has none)."""
    words = (sysconfig.get_config_var("CXX") or "g++").split()
    return " ".join(w for w in words if not w.startswith("-")) or "g++"


def _assert_projects_message(output: str) -> None:
    assert MESSAGE in output, output[-4000:]
    for advice in ("sudo apt install g++", "sudo dnf install gcc-c++", "xcode-select --install"):
        assert advice in output, advice
    assert "Could not find" not in output, output[-4000:]


@pytest.mark.skipif(sys.platform == "win32", reason="the check is for POSIX builds (CMakeLists.txt)")
@pytest.mark.parametrize("cxx", [None, "sysconfig", "ccache g++", "/nonexistent/bin/c++"])
def test_configure_without_a_compiler_says_what_to_install(tmp_path, cxx):
    cmake, = require_tool("cmake")
    env = {"HOME": str(tmp_path), "PATH": _bare_path(tmp_path, cmake)}
    if cxx is not None:
        env["CXX"] = _sysconfig_cxx() if cxx == "sysconfig" else cxx
    proc = subprocess.run([cmake, "-S", str(ROOT), "-B", str(tmp_path / "build")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    _assert_projects_message(proc.stdout + proc.stderr)
    first = env.get("CXX", "").split()[0] if env.get("CXX") else None
    looked = f"looked for {first}, which CXX names" if first else "looked for c++, g++, clang++"
    assert looked in " ".join((proc.stdout + proc.stderr).split()), looked


def test_configure_with_a_compiler_passes_the_check(tmp_path):
    """The check looks CXX up on PATH: a compiler there, named as scikit-build-core names it,
    passes it (CMake then goes on to detect the compiler)."""
    cmake, = require_tool("cmake")
    names = (_sysconfig_cxx().split()[-1], "c++", "g++", "clang++")
    name = next((n for n in names if shutil.which(n)), None)
    if name is None:
        cannot_run(f"no C++ compiler on PATH (looked for {', '.join(names)})")
    proc = subprocess.run([cmake, "-S", str(ROOT), "-B", str(tmp_path / "build")],
                          env=dict(os.environ, CXX=name), capture_output=True, text=True, timeout=300)
    assert MESSAGE not in proc.stdout + proc.stderr
    assert "The CXX compiler identification is" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.skipif(sys.platform == "win32", reason="the check is for POSIX builds (CMakeLists.txt)")
def test_pip_wheel_without_a_compiler_says_what_to_install(tmp_path):
    """pip's own build of a checkout (--no-build-isolation: the build requirements of this
    environment), as a new user without a compiler runs it; scikit-build-core sets CXX itself."""
    # Probed, not read: the package source is meant to be missing from the scratch copy, so it is
    # no test-source (tests/test_release_config.py).
    if not any(ROOT.glob("python/mps_fused_adam/__init__.py")):
        pytest.skip("a copy of the test sources without the package source (cibuildwheel's scratch "
                    "directory): the configure test above covers CMakeLists.txt there")
    for module, dist in (("scikit_build_core", "scikit-build-core"), ("nanobind", "nanobind")):
        if subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode:
            cannot_run(f"{dist} is not installed here: pip's build without build isolation needs "
                       "scikit-build-core and nanobind")
    cmake, = require_tool("cmake")
    generator = shutil.which("ninja") or require_tool("make")[0]  # scikit-build-core's first choice, else make
    env = {"HOME": str(tmp_path), "PATH": _bare_path(tmp_path, cmake, generator), "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    assert "CXX" not in env
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                           "-w", str(tmp_path / "dist"), f"--config-settings=build-dir={tmp_path / 'build'}",
                           str(ROOT)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    _assert_projects_message(proc.stdout + proc.stderr)
