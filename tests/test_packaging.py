"""The package's metadata says what issue 30 asks and what is true: PEP 639 license fields, the
Alpha status (the Metal kernel is untested on Apple hardware), typed, a console script that is the
main command, a torch floor that CI installs, and no virtual environment or benchmark results in
the sdist."""
from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_license_and_classifiers():
    project = _pyproject()["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")
    classifiers = project["classifiers"]
    assert "Development Status :: 3 - Alpha" in classifiers and "Typing :: Typed" in classifiers
    # PEP 639: the license expression replaces the license classifier (tools reject both).
    assert not [c for c in classifiers if c.startswith("License ::")]
    assert {"Documentation", "Changelog"} <= set(project["urls"])
    requires = " ".join(_pyproject()["build-system"]["requires"])
    floor = re.search(r"scikit-build-core>=([0-9.]+)", requires).group(1)
    assert tuple(int(x) for x in floor.split(".")) >= (0, 11), "PEP 639 metadata needs scikit-build-core 0.11"


def test_torch_floor_is_the_release_ci_installs():
    deps = _pyproject()["project"]["dependencies"]
    torch_req = [d for d in deps if re.match(r"torch\b", d)]
    assert torch_req == ["torch>=2.13"], deps
    for ci_file in (".ci/run", "ci/test_installed_wheel.sh", "README.md"):
        text = (ROOT / ci_file).read_text(encoding="utf-8")
        installs = set(re.findall(r"(?<![\w-])torch==([0-9.]+)", text))
        assert installs <= {"2.13.0"}, (ci_file, installs)
    assert "torch==2.13.0" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_console_script_is_the_main_command():
    scripts = _pyproject()["project"]["scripts"]
    assert scripts == {"mps-fused-adam": "mps_fused_adam.__main__:main"}
    from mps_fused_adam.__main__ import main
    assert callable(main)
    # The installed distribution (editable or wheel) carries the same entry point ...
    eps = importlib.metadata.distribution("mps-fused-adam").entry_points
    assert [(e.name, e.value) for e in eps if e.group == "console_scripts"] == \
        [("mps-fused-adam", "mps_fused_adam.__main__:main")]
    # ... and the script answers as `python -m mps_fused_adam` does.
    script = Path(sys.executable).parent / "mps-fused-adam"
    assert script.is_file(), f"{script} was not installed"
    a = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    b = subprocess.run([sys.executable, "-m", "mps_fused_adam", "--version"], capture_output=True, text=True,
                       timeout=120)
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
    # Its usage line names it as typed, the module form names itself.
    a = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    b = subprocess.run([sys.executable, "-m", "mps_fused_adam", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert a.stdout.startswith("usage: mps-fused-adam "), a.stdout[:80]
    assert b.stdout.startswith("usage: python -m mps_fused_adam "), b.stdout[:80]


def test_installed_metadata_and_py_typed():
    meta = importlib.metadata.metadata("mps-fused-adam")
    assert meta["License-Expression"] == "MIT"
    assert "Development Status :: 3 - Alpha" in meta.get_all("Classifier")
    import mps_fused_adam
    assert (Path(mps_fused_adam.__file__).parent / "py.typed").is_file()


def test_sdist_and_git_ignore_virtual_environments_and_results():
    excludes = _pyproject()["tool"]["scikit-build"]["sdist"]["exclude"]
    for pattern in (".venv/", "build/", "dist/", "site/", "benchmarks/results/", "docs/results"):
        assert pattern in excludes, pattern
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
    for pattern in (".venv/", "build/", "dist/", "/site/"):
        assert pattern in ignored, pattern


def test_benchmarks_folder_stays_small():
    """Scripts users run and results/ (the latest run per machine, the plots): at most 25 files."""
    files = [p for p in (ROOT / "benchmarks").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert 0 < len(files) <= 25, sorted(str(p.relative_to(ROOT)) for p in files)
    assert not [p for p in files if p.name.startswith("diag_")], "concluded diagnostics go to docs/experiments.md"
