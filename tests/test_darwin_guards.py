"""Every use of a Linux-only facility in the test files sits behind a guard, so that cibuildwheel's
macOS test step (the whole suite against the macOS wheel, pyproject.toml's test-command) meets
no `/proc`, glibc, ELF tool, fork start method, KiB `ru_maxrss` or cross tool unguarded.

Grep-like, on purpose: a line naming a facility of ``LINUX_ONLY`` (docstrings aside) must have a
guard of ``GUARDS`` in its top-level statement (a test function or class with its decorators, a
module-level constant), or the file a module-level skip. Where a use is portable as written (a
name in a list, a script run only by a guarded test), a comment there saying so with the word
"darwin" is the guard. docs/apple-testing.md lists what the macOS test step skips and why.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# What macOS lacks or does otherwise: name -> pattern.
LINUX_ONLY = {
    "/proc": r"/proc/",
    "glibc malloc tunables": r"\bMALLOC_[A-Z_]+",
    "ELF tools": r"\b(ldd|readelf|patchelf|auditwheel)\b",
    "the fork start method": r"""get_context\(\s*["']fork["']|set_start_method\(\s*["']fork|\bos\.fork\(""",
    "ru_maxrss (KiB on Linux, bytes on macOS)": r"\bru_maxrss\b",
    "CPU affinity": r"\bsched_(get|set)affinity\b",
    "cross tools": r"aarch64-linux-gnu|qemu-aarch64",
    "Linux shared-library names": r"libtorch_cpu\.so\b|\bLD_(PRELOAD|LIBRARY_PATH)\b",
}
# What makes a use safe on macOS: a platform test, a skip when a tool or file is missing, an
# OSError caught, an x86-only branch (the macOS wheels are arm64 only).
GUARDS = (r"\bsys\.platform\b|\bplatform\.system\(\)|\bdarwin\b|\blinux_only\b|\bplatform\.machine\(\)"
          r"""|\bhasattr\(os,\s*["'](fork|sched_getaffinity|sched_setaffinity)["']\)"""
          r"|\brequire_tool\(|\bcannot_run\(|\bos\.path\.exists\(|\.exists\(\)|\.is_file\(\)|\bexcept\s+\(?(OSError|FileNotFoundError)")
MODULE_SKIP = r"allow_module_level\s*=\s*True|^pytestmark\s*=.*skipif"


def _scopes(tree: ast.Module) -> list[tuple[int, int]]:
    """(first line, last line) of each top-level statement, a function's or class's decorators
    included."""
    return [(min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]), node.end_lineno)
            for node in tree.body]


def _docstring_lines(tree: ast.Module) -> set[int]:
    """Lines of the module's, classes' and functions' docstrings (prose, not uses)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out |= set(range(first.lineno, first.end_lineno + 1))
    return out


def unguarded(text: str) -> list[tuple[int, str, str]]:
    """(line number, facility, line) of each use in ``text`` (a test file) with no guard in its scope."""
    lines = text.splitlines()
    tree = ast.parse(text)
    scopes, prose = _scopes(tree), _docstring_lines(tree)
    # A module-level skip covers the file when it is itself a guard (not, say, a missing source tree).
    for first, last in scopes:
        statement = "\n".join(lines[first - 1:last])
        if re.search(MODULE_SKIP, statement, flags=re.M) and re.search(GUARDS, statement):
            return []
    found = []
    for number, line in enumerate(lines, start=1):
        if number in prose:
            continue
        code = line.split("#", 1)[0]
        for name, pattern in LINUX_ONLY.items():
            if not re.search(pattern, code):
                continue
            first, last = next(((a, b) for a, b in scopes if a <= number <= b), (number, number))
            if not re.search(GUARDS, "\n".join(lines[first - 1:last])):
                found.append((number, name, line.strip()))
    return found


def test_every_linux_only_use_is_guarded():
    problems = []
    for f in sorted(TESTS.glob("*.py")):
        if f.name == Path(__file__).name:
            continue
        for number, name, line in unguarded(f.read_text(encoding="utf-8")):
            problems.append(f"{f.name}:{number}: {name} without a darwin guard: {line}")
    assert not problems, "\n".join(problems)


def test_the_check_sees_an_unguarded_use():
    """The check finds each kind of use, and accepts each kind of guard."""
    bare = "def test_x():\n    return open('/proc/self/status').read()\n"
    assert [n for _, n, _ in unguarded(bare)] == ["/proc"]
    for name, use in (("the fork start method", "mp.get_context('fork')"), ("glibc malloc tunables", "MALLOC_ARENA_MAX"),
                      ("ru_maxrss (KiB on Linux, bytes on macOS)", "r.ru_maxrss"), ("ELF tools", "run(['ldd', so])"),
                      ("CPU affinity", "os.sched_getaffinity(0)"), ("cross tools", "cxx = 'aarch64-linux-gnu-g++'")):
        assert [n for _, n, _ in unguarded(f"def test_x():\n    {use}\n")] == [name], use
    guarded = [
        "@pytest.mark.skipif(sys.platform != 'linux', reason='Linux')\ndef test_x():\n    open('/proc/self/status')\n",
        "def test_x():\n    if not os.path.exists('/proc/self/status'):\n        pytest.skip('x')\n    open('/proc/self/status')\n",
        "def test_x():\n    try:\n        open('/proc/cpuinfo')\n    except OSError:\n        return\n",
        "def test_x():\n    cxx, = require_tool('aarch64-linux-gnu-g++')\n",
        "import pytest\nif sys.platform == 'darwin':\n    pytest.skip('x', allow_module_level=True)\ndef test_x():\n    os.fork()\n",
        "SCRIPT = (  # run by the linux_only test below\n    'open(\"/proc/self/status\")')\n",
    ]
    for text in guarded:
        assert unguarded(text) == [], text
    # A module-level skip for another reason does not count, nor a guard in another test.
    assert unguarded("pytestmark = pytest.mark.skipif(not SRC, reason='x')\ndef test_x():\n    os.fork()\n")
    other = "def test_a():\n    sys.platform\n\n\ndef test_b():\n    open('/proc/x')\n"
    assert [n for n, _, _ in unguarded(other)] == [6]
