"""The release configuration holds together: cibuildwheel's test-sources cover every repository file
the tests read, the Apple Silicon job installs the test extra, the publish job can check out the
repository, and the macOS deployment target is given where scikit-build-core names the wheel from.

These read pyproject.toml, the workflow and the tests as text (no YAML parser: the per-wheel test
environments have only the `test` extra), so they also run in cibuildwheel's scratch directory.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs Python 3.11+ or tomli")
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _test_sources() -> list[str]:
    sources = _pyproject()["tool"]["cibuildwheel"]["test-sources"]
    return sources.split() if isinstance(sources, str) else list(sources)


def _covered(rel: str, sources: list[str]) -> bool:
    rel = rel.strip("/")
    return any(rel == s or rel.startswith(s.rstrip("/") + "/") for s in sources)


# --- which repository files the tests read ---------------------------------------------------

def _is_repo_root(node: ast.AST) -> bool:
    """ROOT / REPO (bound to the checkout in the test modules), or Path(__file__)...parents[1] /
    .parent.parent written out."""
    text = ast.unparse(node)
    return text in ("ROOT", "REPO") or ("__file__" in text and ("parents[1]" in text or "parents[2]" in text or "parent.parent" in text))


def _leading_strings(nodes) -> list[str]:
    parts = []
    for n in nodes:
        if not (isinstance(n, ast.Constant) and isinstance(n.value, str)):
            break
        parts.append(n.value)
    return parts


def _join_repo_dir(call: ast.Call) -> str | None:
    """os.path.join(os.path.dirname(__file__), os.pardir, "a", "b") -> "a/b" (tests/ is one level down)."""
    if not (isinstance(call.func, ast.Attribute) and ast.unparse(call.func) == "os.path.join"):
        return None
    args = [ast.unparse(a) for a in call.args]
    if len(args) >= 3 and "__file__" in args[0] and args[1] in ("os.pardir", "'..'"):
        parts = _leading_strings(call.args[2:])
        return "/".join(parts) if parts else None
    return None


def repo_paths_read(tree: ast.Module) -> set[str]:
    """Repository-relative paths a test module names as ROOT / "a" / "b" (the longest run of string
    parts), or through os.path.join(dirname(__file__), os.pardir, ...)."""
    inner = {id(n.left) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)}
    # A directory put on sys.path is not read as a file: repo_modules_imported checks what is
    # imported from it.
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "sys.path.insert" and len(n.args) == 2:
            inner |= {id(a) for a in ast.walk(n.args[1])}
    found = set()
    for node in ast.walk(tree):
        if id(node) in inner:
            continue
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts, cur = [], node
            while isinstance(cur, ast.BinOp) and isinstance(cur.op, ast.Div):
                parts.append(cur.right)
                cur = cur.left
            if _is_repo_root(cur):
                strings = _leading_strings(reversed(parts))
                if strings:
                    found.add("/".join(strings))
        elif isinstance(node, ast.Call):
            rel = _join_repo_dir(node)
            if rel:
                found.add(rel)
    return found


def repo_modules_imported(tree: ast.Module) -> set[str]:
    """Files of a repository directory outside tests/ that a test puts on sys.path and then imports:
    for each sys.path.insert(..., <repo dir>), the modules imported in the same function (or module)
    that are not importable without that directory."""
    found = set()
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        body = list(ast.walk(scope)) if scope is not tree else [n for s in tree.body for n in ast.walk(s)
                                                                 if not isinstance(s, (ast.FunctionDef, ast.ClassDef))]
        dirs = []
        for n in body:
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "sys.path.insert" and len(n.args) == 2:
                arg = n.args[1]
                rel = _join_repo_dir(arg) if isinstance(arg, ast.Call) else None
                if rel is None and isinstance(arg, ast.Call) and ast.unparse(arg.func) == "str":
                    arg = arg.args[0]
                if rel is None and isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Div):
                    rel = next(iter(repo_paths_read(ast.Module(body=[ast.Expr(arg)], type_ignores=[]))), None)
                if rel and rel.split("/")[0] != "tests":
                    dirs.append(rel)
        if not dirs:
            continue
        names = set()
        for n in body:
            if isinstance(n, ast.Import):
                names |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                names.add(n.module.split(".")[0])
        for name in names:
            if name in sys.stdlib_module_names or name in ("torch", "pytest", "mps_fused_adam"):
                continue
            for d in dirs:
                if (ROOT / d / f"{name}.py").exists() or importlib.util.find_spec(name) is None:
                    found.add(f"{d}/{name}.py")
    return found


def _test_modules():
    for f in sorted(TESTS.rglob("*.py")):
        yield f, ast.parse(f.read_text(encoding="utf-8"))


def test_the_finder_sees_the_known_reads():
    """The scan finds what the suite is known to read, so an empty result cannot pass for a good one."""
    read, imported = set(), set()
    for _, tree in _test_modules():
        read |= repo_paths_read(tree)
        imported |= repo_modules_imported(tree)
    assert {"ci/check_wheel.py", "examples/deepspeed_zero.py", "README.md", ".ci/run", "metal/fused_adam.metal"} <= read
    sample = ast.parse('import os, sys\n'
                       'def test_x():\n'
                       '    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))\n'
                       '    from nowhere_module_xyz import f\n')
    assert repo_modules_imported(sample) == {"tools/nowhere_module_xyz.py"}


def test_test_sources_cover_every_repository_file_the_tests_read():
    """cibuildwheel runs the suite from a scratch directory holding only test-sources (and
    ci/test_installed_wheel.sh does the same): a test reading a repository file outside them fails
    only there, for every wheel (as tests/test_bench.py's `from lowbit import ...` did)."""
    sources = _test_sources()
    missing = set()
    for f, tree in _test_modules():
        for rel in repo_paths_read(tree) | repo_modules_imported(tree):
            if not _covered(rel, sources):
                missing.add(f"{f.relative_to(TESTS)}: {rel}")
    assert not missing, f"read by tests but not in [tool.cibuildwheel] test-sources: {sorted(missing)}"


def test_test_sources_exist():
    """Every test-sources path is in the checkout (or in the scratch copy made from it)."""
    assert [s for s in _test_sources() if not (ROOT / s).exists()] == []


# --- the workflow ---------------------------------------------------------------------------

def _workflow() -> str:
    return (ROOT / "ci" / "workflows" / "wheels.yml").read_text(encoding="utf-8")


def _job(name: str) -> str:
    """The text of one job under `jobs:` (two-space indented keys)."""
    text = _workflow()
    jobs = text[text.index("\njobs:\n"):]
    m = re.search(rf"^  {re.escape(name)}:\n(.*?)(?=^  [A-Za-z0-9_-]+:\n|\Z)", jobs, flags=re.M | re.S)
    assert m, f"no job {name!r} in wheels.yml"
    return m.group(1)


def _runs(job: str) -> str:
    """Every `run: |` block of a job, without comments."""
    return "\n".join(line.split("#", 1)[0] for line in job.splitlines())


def test_apple_silicon_job_installs_the_test_extra():
    """The self-hosted job runs the whole suite, which needs the `test` extra (numpy, nanobind,
    lion-pytorch), not only pytest: it installs the wheel with [test], from the wheel's own file."""
    job = _job("apple-silicon")
    runs = _runs(job)
    install = re.search(r'pip install\b[^\n]*"\$wheel\[test\]"', runs)
    assert install, "the apple-silicon job must install the wheel as \"$wheel[test]\" (the package's test extra)"
    assert "torch==2.13.0" in runs
    assert runs.index(install.group(0)) < runs.index("python -m pytest"), "the extra must be installed before the suite runs"
    assert "test" in _pyproject()["project"]["optional-dependencies"]


def test_publish_job_can_check_out():
    """A job-level `permissions:` replaces the workflow's, so every permission it omits is none:
    the publish job needs contents: read for actions/checkout beside id-token: write."""
    job = _job("publish")
    m = re.search(r"^    permissions:\n((?:      .*\n)+)", job, flags=re.M)
    assert m, "the publish job sets its own permissions (id-token: write for trusted publishing)"
    perms = {k: v for k, v in re.findall(r"^      ([a-z-]+):\s*([a-z]+)", m.group(1), flags=re.M)}
    assert perms.get("id-token") == "write" and perms.get("contents") in ("read", "write"), perms


# --- the macOS deployment target ------------------------------------------------------------

def test_macos_deployment_target_is_visible_to_scikit_build_core():
    """scikit-build-core tags the wheel from a cmake.define (1.0+) or MACOSX_DEPLOYMENT_TARGET, never
    from CMakeLists.txt: a darwin override defines it, with the value the other places use."""
    data = _pyproject()
    darwin = [o for o in data["tool"]["scikit-build"].get("overrides", [])
              if re.search(o.get("if", {}).get("platform-system", "^$"), "darwin")]
    defined = [o["cmake"]["define"]["CMAKE_OSX_DEPLOYMENT_TARGET"] for o in darwin
               if "CMAKE_OSX_DEPLOYMENT_TARGET" in o.get("cmake", {}).get("define", {})]
    assert defined, "no [[tool.scikit-build.overrides]] for darwin defines CMAKE_OSX_DEPLOYMENT_TARGET"
    target = defined[-1]
    assert not [o for o in data["tool"]["scikit-build"].get("overrides", [])
                if re.search(o.get("if", {}).get("platform-system", "^$"), "linux")
                and "CMAKE_OSX_DEPLOYMENT_TARGET" in o.get("cmake", {}).get("define", {})]
    assert data["tool"]["cibuildwheel"]["macos"]["environment"]["MACOSX_DEPLOYMENT_TARGET"] == target
    cmake = (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    assert re.search(rf"set\(CMAKE_OSX_DEPLOYMENT_TARGET {re.escape(target)} ", cmake)
    assert f"set(MFA_MACOS_MIN {target})" in (ROOT / "cmake" / "apple_metal.cmake").read_text(encoding="utf-8")
    major = target.split(".")[0]
    assert f"macosx_{major}_0_arm64" in _workflow()


# --- the hosted macOS job: torch MPS where it works ---------------------------------------------

def _mps_test_files() -> set[str]:
    """The test files that need a real MPS device: those calling conftest's require_mps."""
    return {f.name for f in TESTS.glob("test_*.py")
            if re.search(r"\brequire_mps\(\)", f.read_text(encoding="utf-8"))}


def _steps(job: str) -> list[str]:
    """The text of each step of a job (a `      - ` item under `    steps:`)."""
    body = job[job.index("\n    steps:\n"):]
    return ["      - " + s for s in re.split(r"^      - ", body, flags=re.M)[1:]]


def test_hosted_job_runs_the_mps_test_files_where_torch_mps_works():
    """metal-hosted: macos-15 required, macos-14 and macos-26 reported beside it; the probe
    (ci/mps_probe.py) first, then every MPS test file under MFA_REQUIRE_MPS=1 where it said
    works=true, and a skip with its exact error where it did not. MPS is never switched off there."""
    job = _job("metal-hosted")
    legs = re.findall(r"^          - \{ os: (macos-\d+), required: (true|false) \}$", job, flags=re.M)
    assert sorted(legs) == [("macos-14", "false"), ("macos-15", "true"), ("macos-26", "false")], legs
    assert "    continue-on-error: ${{ !matrix.required }}\n" in job
    assert "MFA_NO_MPS" not in _runs(job)
    steps = _steps(job)
    probe = [i for i, s in enumerate(steps) if "id: mps\n" in s]
    assert len(probe) == 1 and 'ci/mps_probe.py" --github-output "$GITHUB_OUTPUT"' in steps[probe[0]]
    assert "if: always()" in steps[probe[0]]
    run = [s for s in steps[probe[0]:] if "steps.mps.outputs.works == 'true'" in s]
    skip = [s for s in steps[probe[0]:] if "steps.mps.outputs.works != 'true'" in s]
    assert len(run) == 1 and len(skip) == 1
    assert 'MFA_REQUIRE_MPS: "1"' in run[0] and "python -m pytest" in run[0]
    named = set(re.findall(r"tests/(test_\w+\.py)", run[0]))
    assert _mps_test_files() and named == _mps_test_files(), (named, _mps_test_files())
    assert "${{ steps.mps.outputs.error }}" in skip[0] and "::warning" in skip[0]
    assert "MFA_REQUIRE_MPS" not in skip[0]
    # The Metal harness step keeps its place before the probe.
    assert any("MFA_REQUIRE_METAL" in s for s in steps[:probe[0]])


def test_mps_probe_says_what_failed(tmp_path):
    """ci/mps_probe.py's answer, here: works=true with a matmul equal to the CPU's on a machine
    whose MPS runs, else works=false and the error, the same text it prints."""
    import subprocess
    out = tmp_path / "github_output"
    proc = subprocess.run([sys.executable, str(ROOT / "ci" / "mps_probe.py"), "--github-output", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    fields = dict(line.split("=", 1) for line in out.read_text().splitlines())
    import torch
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_available():
        assert fields["works"] == "false" and fields["error"].startswith("torch.backends.mps.is_available() is False")
        assert proc.stdout.startswith("torch MPS does not work") and fields["error"] in proc.stdout
    else:
        assert fields["works"] == "true" or fields["error"] in proc.stdout, (fields, proc.stdout)
