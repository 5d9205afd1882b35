"""Shared fixtures. The tests import the installed package (CI runs them against the built wheel)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

# The harness modules (the host emulator, the raw-Metal harness, the DeepSpeed and integration
# helpers, workers run as scripts) live in tests/support/ and are imported by their own names.
SUPPORT_DIR = Path(__file__).resolve().parent / "support"
if str(SUPPORT_DIR) not in sys.path:
    sys.path.insert(0, str(SUPPORT_DIR))

DTYPE_PAIRS = [  # (param dtype, state dtype) pairs the kernels are instantiated for
    (torch.float32, torch.float32),
    (torch.float16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
]


def pair_id(pair) -> str:
    return "-".join(str(d).replace("torch.", "") for d in pair)


def public_optimizer_names() -> list[str]:
    """The optimizer classes mps_fused_adam exports (its public names that are torch optimizers):
    a test that lists classes by hand checks its list against this one."""
    import mps_fused_adam as mfa
    return sorted(n for n in mfa.__all__
                  if isinstance(getattr(mfa, n), type) and issubclass(getattr(mfa, n), torch.optim.Optimizer))


# Why the tests that fork a process whose threads have started skip on macOS (docs/apple-testing.md).
FORK_ON_DARWIN = ("fork() after threads have started is unsafe on macOS (Apple's frameworks), whose default "
                  "start method is spawn since Python 3.8 (DataLoader workers are spawned there); the fork "
                  "checks run on Linux")


def require_tool(*names: str) -> list[str]:
    """Paths of the named tools. Missing tools skip the test on a developer machine but fail it
    where MFA_REQUIRE_TOOLS=1, as .ci/run sets after installing them: a skipped check must never
    pass for a run one. (Not keyed on CI: GitHub sets CI=true in cibuildwheel's per-wheel test
    environments too, which do not carry the cross tools.)"""
    found = [shutil.which(n) for n in names]
    missing = [n for n, f in zip(names, found) if f is None]
    if missing:
        cannot_run(f"required tools not on PATH: {', '.join(missing)}")
    return found  # type: ignore[return-value]


def cannot_run(reason: str) -> None:
    """A check that needs a tool or a download cannot run here: skip with ``reason`` on a developer
    machine, fail where MFA_REQUIRE_TOOLS=1 (CI), by the same rule as :func:`require_tool`."""
    if os.environ.get("MFA_REQUIRE_TOOLS"):
        pytest.fail(reason + " (MFA_REQUIRE_TOOLS is set; .ci/run installs the tools and has network)")
    pytest.skip(reason)


def require_bitsandbytes():
    """bitsandbytes, or a skip saying why (a test dependency where it installs); a failure where
    MFA_REQUIRE_BITSANDBYTES=1 (CI installs bitsandbytes==0.50.2)."""
    try:
        import bitsandbytes
        import bitsandbytes.functional  # noqa: F401  (its own load errors show here)
    except Exception as exc:  # ImportError, or its own load errors on unsupported platforms
        msg = f"bitsandbytes not importable ({exc!r}); CI installs bitsandbytes==0.50.2"
        if os.environ.get("MFA_REQUIRE_BITSANDBYTES"):
            pytest.fail(msg + " (MFA_REQUIRE_BITSANDBYTES is set)")
        pytest.skip(msg)
    return bitsandbytes


def require_torchao():
    """torchao, or a skip saying why; a failure where MFA_REQUIRE_TORCHAO=1 (CI installs
    torchao==0.18.0; the README's set-up does not, and a hand-built torchao layout is checked there)."""
    try:
        import torchao.optim  # noqa: F401
    except Exception as exc:
        msg = f"torchao not importable ({exc!r}); pip install torchao to compare against it"
        if os.environ.get("MFA_REQUIRE_TORCHAO"):
            pytest.fail(msg + " (MFA_REQUIRE_TORCHAO is set)")
        pytest.skip(msg)
    import torchao
    return torchao


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def _simd_paths() -> list[str]:
    from mps_fused_adam import _cpu
    return _cpu.simd_paths()


@pytest.fixture(params=_simd_paths())
def simd(request):
    """Each SIMD build of the CPU kernel this machine can run, selected for the test's duration."""
    from mps_fused_adam import _cpu
    before = _cpu.simd_path()
    _cpu.set_simd_path(request.param)
    yield request.param
    _cpu.set_simd_path(before)


_CLANG_LIBCXX: list[list[str]] = []


def clang_libcxx() -> list[str]:
    """The compiler command of Apple's family here: clang++ (clang++-19 first, which .ci/run
    installs) with ``-stdlib=libc++``, checked by building a small shared object that includes
    <cmath>. Absent or unable to link libc++: :func:`cannot_run` (a failure under MFA_REQUIRE_TOOLS)."""
    if not _CLANG_LIBCXX:
        clang = next((shutil.which(n) for n in ("clang++-19", "clang++") if shutil.which(n)), None)
        if clang is None:
            cannot_run("clang++ not on PATH (Debian: apt install clang-19 libc++-19-dev)")
        import subprocess
        import tempfile
        cmd = [clang, "-stdlib=libc++"]
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run([*cmd, "-std=c++17", "-shared", "-fPIC", "-x", "c++", "-", "-o", f"{tmp}/probe.so"],
                                  input='#include <cmath>\nextern "C" float probe(float x) { return std::fabs(x); }\n',
                                  capture_output=True, text=True)
        if proc.returncode != 0:
            cannot_run(f"{' '.join(cmd)} cannot build a shared object (Debian: apt install libc++-19-dev):\n"
                       f"{proc.stderr[-2000:]}")
        _CLANG_LIBCXX.append(cmd)
    return list(_CLANG_LIBCXX[0])


EMULATOR_COMPILERS = ("default", "clang-libc++")


@pytest.fixture(scope="session", params=EMULATOR_COMPILERS)
def emulator_cxx(request) -> list[str] | None:
    """The host emulator's compiler, for the files that check the kernels bit for bit under each
    (a module's ``emu`` fixture taking this one): the default (CXX, else g++) and clang++ with
    libc++, Apple's compiler family (:func:`clang_libcxx`). Each builds once per session."""
    return None if request.param == "default" else clang_libcxx()


@pytest.fixture(scope="session")
def emu():
    """The host emulator: metal/fused_adam.metal compiled as C++ (tests/support/emulated_mps.py)."""
    from emulated_mps import build_emulator
    return build_emulator()


@pytest.fixture
def pkg(tmp_path):
    """A package directory laid out as the wheel installs it (the metallib is a placeholder:
    the stand-in library runs the emulator built from the same source)."""
    from emulated_mps import METAL_SOURCE
    from mps_fused_adam.backends.mps import METALLIB_NAME
    (tmp_path / METALLIB_NAME).write_bytes(b"MTLB placeholder")
    (tmp_path / "metal").mkdir()
    shutil.copy(METAL_SOURCE, tmp_path / "metal" / "fused_adam.metal")
    return tmp_path


def mps_available() -> bool:
    """MPS usable for numerics. MFA_NO_MPS=1 says no (GitHub's hosted macOS runners report MPS
    but cannot run it); MFA_REQUIRE_MPS=1 (the Apple Silicon job) turns its absence into failures."""
    mps = getattr(torch.backends, "mps", None)
    return not os.environ.get("MFA_NO_MPS") and mps is not None and mps.is_available()


def require_mps() -> None:
    if not mps_available():
        if os.environ.get("MFA_REQUIRE_MPS"):
            pytest.fail("MFA_REQUIRE_MPS is set but no usable MPS device was found")
        pytest.skip("no MPS device (runs on Apple Silicon; the Apple Silicon CI job sets MFA_REQUIRE_MPS=1)")


def choose_backend_afresh(monkeypatch, device_type: str):
    """Forget earlier backend choices, then ask for ``device_type``'s backend twice.
    Returns (first, second, the warning messages issued meanwhile)."""
    import warnings

    from mps_fused_adam import backends
    monkeypatch.setattr(backends, "_chosen", {})
    monkeypatch.setattr(backends, "_reasons", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = backends.get_backend(device_type)
        again = backends.get_backend(device_type)
    return first, again, [str(w.message) for w in caught]
