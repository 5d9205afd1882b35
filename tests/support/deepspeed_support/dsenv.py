"""Helpers for the DeepSpeed tests: the DeepSpeed requirement, and subprocesses that cannot compile.

DeepSpeed JIT-builds ops with the C++ compiler and ninja found on PATH (torch's cpp_extension
honours CC/CXX too). The subprocesses get a PATH that holds only a python symlink, CC and CXX set
to /bin/false, and an empty TORCH_EXTENSIONS_DIR that must still be empty afterwards, so any
attempt to build an op either fails loudly or leaves a trace the tests catch.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent
COMPILERS = ("gcc", "g++", "cc", "c++", "clang", "clang++", "ninja", "ld", "nvcc")


def require_deepspeed():
    """Import DeepSpeed, or skip; with MFA_REQUIRE_DEEPSPEED set (CI), a missing DeepSpeed fails."""
    if os.environ.get("MFA_REQUIRE_DEEPSPEED"):
        import deepspeed  # noqa: F401  (ImportError fails the test loudly in CI)
        return deepspeed
    return pytest.importorskip("deepspeed")


def package_root() -> str:
    """The directory holding the mps_fused_adam being tested (source tree or installed wheel)."""
    import mps_fused_adam.deepspeed
    return str(Path(mps_fused_adam.deepspeed.__file__).resolve().parents[2])


def _on_interpreter_path(directory: str) -> bool:
    """Whether ``directory`` is on sys.path of this interpreter without PYTHONPATH (site-packages,
    also one added by a .pth file)."""
    from_env = {str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    resolved = str(Path(directory).resolve())
    return resolved not in from_env and resolved in {str(Path(p).resolve()) for p in sys.path if p}


def no_compiler_env(tmp_path: Path, **extra: str) -> dict:
    """An environment for a subprocess in which no compiler, linker or ninja can be found."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        link = bin_dir / name
        if not link.exists():
            link.symlink_to(sys.executable)
    ext_dir = tmp_path / "torch_extensions"
    ext_dir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DS_BUILD"))}
    # The package's directory goes on PYTHONPATH only when the interpreter would not find it: a
    # site-packages directory there would shadow the interpreter's own DeepSpeed (CI runs these
    # tests with one virtual environment per DeepSpeed release, each seeing the wheel's
    # environment, which holds another DeepSpeed, behind its own site-packages).
    root = package_root()
    paths = [str(SUPPORT)] if _on_interpreter_path(root) else [root, str(SUPPORT)]
    env.update(
        PATH=str(bin_dir), CC="/bin/false", CXX="/bin/false", TORCH_EXTENSIONS_DIR=str(ext_dir),
        PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"),
        PYTHONWARNINGS="ignore::FutureWarning",
    )
    env.update(extra)
    for tool in COMPILERS:
        assert shutil.which(tool, path=env["PATH"]) is None, f"{tool} is reachable in the no-compiler PATH"
    return env


def extensions_built(tmp_path: Path) -> list:
    """Whatever a JIT build left in the subprocesses' TORCH_EXTENSIONS_DIR (must stay empty)."""
    ext_dir = tmp_path / "torch_extensions"
    return sorted(str(p.relative_to(ext_dir)) for p in ext_dir.rglob("*")) if ext_dir.exists() else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_result(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith("MFA-RESULT "):
            return json.loads(line[len("MFA-RESULT "):])
    raise AssertionError("no MFA-RESULT line in the runner's output:\n" + stdout[-5000:])


def run_python(args: list, env: dict, timeout: float = 600, cwd: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{args} exited with {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def run_ranks(tmp_path: Path, argv: list, world_size: int, **extra: str) -> list:
    """Run ``python *argv`` as ``world_size`` ranks over gloo on loopback, in environments with
    no compiler (plus ``extra``); each rank's parsed MFA-RESULT, in rank order."""
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = no_compiler_env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                              LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                              LOCAL_WORLD_SIZE=str(world_size), **extra)
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, f"rank exited with {p.returncode}\n{stdout[-4000:]}\n{stderr[-8000:]}"
        outs.append(parse_result(stdout))
    return outs
