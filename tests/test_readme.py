"""The README's set-up commands are the ones CI runs, and the README and docs say what the code does.

The README's and the docs' Python blocks run in tests/test_doc_blocks.py."""
from __future__ import annotations

import re
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _readme_setup():
    """ci/readme_setup.py, which .ci/run uses to take the set-up commands from the README."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("readme_setup", ROOT / "ci" / "readme_setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setup_commands_are_the_ones_ci_runs():
    text = README.read_text(encoding="utf-8")
    commands = _readme_setup().setup_commands(text).splitlines()
    # A fresh virtual environment first, then install + report, then the tests.
    assert commands[0].startswith("python3 -m venv .venv && . .venv/bin/activate"), commands
    assert "&& python -m mps_fused_adam" in commands[1] and "&& python -m pytest tests" in commands[2], commands
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "ci/test_readme_setup.sh" in ci and "ci/test_installed_wheel.sh" in ci
    assert "readme_setup.py\" commands" in (ROOT / "ci" / "test_readme_setup.sh").read_text(encoding="utf-8")
    wheel_ci = (ROOT / "ci" / "test_installed_wheel.sh").read_text(encoding="utf-8")
    assert "python -m mps_fused_adam\n" in wheel_ci and "python -m pytest tests" in wheel_ci


def test_setup_installs_what_the_tests_need():
    """The README's pip lines install torch pinned, with PyTorch's CPU index as the one extra index
    (CI, which cannot reach it, runs the same line: ci/test_readme_setup.sh), and everything in the
    package's `test` extra; and every test module imports at
    module level only the standard library, torch, pytest, the package and what those lines install
    (a fresh machine would otherwise collect nothing)."""
    import ast
    rs = _readme_setup()
    commands = rs.setup_commands(README.read_text(encoding="utf-8"))
    assert "torch==2.13.0" in commands and "--index-url " not in commands
    assert rs.index_urls(commands) == ["https://download.pytorch.org/whl/cpu"], commands
    # torch and the checkout in one pip call, so the CPU build is what the package's torch>=2.13 meets.
    assert re.search(r"pip install torch==2.13.0 [^\n&]*\. [^\n&]*--extra-index-url", commands), commands
    installed = rs.pip_installs(commands)
    assert "https://download.pytorch.org/whl/cpu" not in installed
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    extra = re.search(r"^test = \[(.*?)\]", pyproject, flags=re.M).group(1)
    test_extra = {re.split(r"[=<>!~\[]", name)[0].lower() for name in re.findall(r'"([^"]+)"', extra)}
    assert test_extra and test_extra <= installed, f"the test extra {test_extra} is not all installed by {installed}"
    tests = Path(__file__).resolve().parent
    by_stem = {f.stem: f for f in tests.rglob("*.py")}
    local = set(by_stem) | {d.name for d in tests.iterdir() if d.is_dir()}
    known = set(sys.stdlib_module_names) | {"torch", "pytest", "_pytest", "mps_fused_adam"} | local | installed

    def module_level_imports(f: Path) -> list[str]:
        names = []
        for node in ast.parse(f.read_text(encoding="utf-8")).body:
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        return names

    # What collection imports: the test modules and conftest.py, and the helper modules of tests/
    # they import at module level, transitively. A helper imported only inside a test (the
    # Apple-only pyobjc driver, say) is that test's business: it cannot stop collection.
    todo = [f for f in tests.rglob("*.py") if f.name.startswith("test_") or f.name == "conftest.py"]
    seen, undeclared = set(), set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for n in module_level_imports(f):
            top = n.split(".")[0]
            if top not in known:
                undeclared.add(f"{f.name}: {n}")
            elif top in by_stem:
                todo.append(by_stem[top])
    assert len(seen) > 40 and not undeclared, undeclared


def test_optional_tools_table_matches_the_tests():
    """Each optional thing the README names is one a test really asks for (no stale rows), and the
    checks of the newcomer's run accept exactly the skips for them."""
    rs = _readme_setup()
    names = rs.optional_names(README.read_text(encoding="utf-8"))
    # Names only, compared as text: portable to darwin.
    assert {"aarch64-linux-gnu-g++", "qemu-aarch64", "clang++", "deepspeed", "MFA_WHEEL", "MFA_DS_CPU_ADAM_SO"} <= set(names)
    sources = "\n".join(f.read_text(encoding="utf-8") for f in Path(__file__).resolve().parent.rglob("*.py"))
    for name in names:
        assert name in sources, f"the README names {name!r} as optional, but no test mentions it"
    ok = ("SKIPPED [2] tests/test_x.py:3: required tools not on PATH: clang++\n"
          "=== 1000 passed, 2 skipped in 9.0s ===\n")
    assert rs.check_log(ok, names, 1000) == []
    assert rs.check_log(ok, names, 1001)  # below the floor
    stray = ok.replace("clang++", "gfortran")
    assert any("does not name as optional" in p for p in rs.check_log(stray, names, 10))
    assert rs.check_log("=== 1 failed, 999 passed in 9.0s ===\n", names, 10)
    assert rs.check_log("Interrupted: 1 error during collection\n=== 1 error in 2.0s ===\n", names, 0)


def test_cli_options_are_documented():
    from mps_fused_adam.__main__ import build_parser
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    options = [o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert {"--no-bench", "--check", "--json", "--version"} <= set(options)
    for option in options:
        if option != "--self-check-only":  # the long alias of --check
            assert f"`{option}`" in text, option


def test_readme_shape():
    """What issue 30 asks of the README: at most 400 lines; how to replace torch.optim.AdamW within
    the first 60; the CPU-torch index inside the one set-up block, said why right after it; links
    into the docs that exist."""
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 400, len(lines)
    head = "\n".join(lines[:60])
    assert "torch.optim.AdamW" in head and "mfa.AdamW(" in head
    setup = _readme_setup().setup_section(text)
    block = setup.index("```bash")
    assert setup.count("```bash") == 1 and "```sh" not in setup, "one set-up block"
    assert block < setup.index("download.pytorch.org/whl/cpu") < setup.index("```", block + 7), "inside the block"
    assert "CPU-only build" in setup[setup.index("```", block + 7):]
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).is_file(), target


def test_compiler_advice_is_the_same_in_readme_and_cmake():
    """What the README's Set-up says to install for a compiler is what CMake's error says."""
    section = _readme_setup().setup_section(README.read_text(encoding="utf-8"))
    cmake = (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    for command in ("sudo apt install g++", "sudo dnf install gcc-c++", "xcode-select --install"):
        assert command in section and command in cmake, command
    assert "Set-up section" in cmake
