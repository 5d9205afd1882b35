"""Every ```python block of README.md and docs/*.md runs, as written, as a program of its own.

The project's own runner rather than pytest-codeblocks or mktestdocs: both exec each block inside
the pytest process (pytest-codeblocks 0.17.0's ``runtest`` calls ``exec``), where a block's
``deepspeed.initialize``, the rendezvous variables ``install()`` sets and torch's global state
would leak into the next block and into the rest of the suite; neither knows this project's
``<!-- not-run: reason -->`` marker (pytest-codeblocks also runs ``sh``/``bash`` blocks, which
here are the README's set-up commands, and skips without a reason, which the README set-up check
of CI refuses); and either would be one more test requirement for a newcomer to install. Here each
block is one ``python -c`` subprocess in an empty directory; a block that imports deepspeed runs
with no compiler, linker or ninja on PATH (tests/support/deepspeed_support/dsenv.py), so it proves that
nothing is JIT-built.

Conventions (docs/development.md, "Documentation"):
- ```python blocks run and must be complete programs on a CPU-only Linux machine;
- a ```python block directly preceded by the line ``<!-- not-run: reason -->`` is not run (it needs
  a Mac, a GPU or a package the tests do not install; the reason says which);
- ```text, ```sh and ```bash blocks are not Python and are not run here.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support" / "deepspeed_support"))
import dsenv  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOT_RUN = re.compile(r"^<!-- not-run: (\S.*?) -->$")
FENCE = re.compile(r"^(\s*)(`{3,})(.*)$")


def documents() -> list[Path]:
    """README.md and every Markdown page of the docs site (docs/results holds run logs only)."""
    return [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.is_file())


def code_blocks(text: str) -> list[dict]:
    """The fenced blocks of a Markdown text: language, code (fence indentation removed), the line of
    the opening fence (1-based) and the not-run reason when the marker precedes the fence."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, info = m.group(1), m.group(2), m.group(3).strip()
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{ticks}\s*$", lines[j]):
            j += 1
        if j == len(lines):
            raise ValueError(f"line {i + 1}: a code block that never closes")
        body = [line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:j]]
        prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = NOT_RUN.match(prev)
        blocks.append({"lang": info.split()[0] if info else "", "code": "\n".join(body) + "\n",
                       "line": i + 1, "not_run": marker.group(1) if marker else None})
        i = j + 1
    return blocks


def _python_blocks() -> list:
    params = []
    for doc in documents():
        for block in code_blocks(doc.read_text(encoding="utf-8")):
            if block["lang"] == "python" and block["not_run"] is None:
                name = f"{doc.relative_to(ROOT)}:{block['line']}"
                params.append(pytest.param(block["code"], id=name))
    return params


PYTHON_BLOCKS = _python_blocks()


# MFA_NO_MPS=1 (GitHub's hosted macOS runners, whose MPS reports available but cannot allocate;
# tests/conftest.py) reaches the blocks' own `torch.backends.mps.is_available()` too, so that
# they take their CPU branch there; everywhere else the blocks run exactly as written.
NO_MPS_PRELUDE = "import torch; torch.backends.mps.is_available = lambda: False  # MFA_NO_MPS\n"


@pytest.mark.parametrize("code", PYTHON_BLOCKS)
def test_python_block_runs(code, tmp_path):
    if os.environ.get("MFA_NO_MPS"):
        code = NO_MPS_PRELUDE + code
    if re.search(r"^\s*(import deepspeed|from deepspeed|import mps_fused_adam\.deepspeed)", code, re.M):
        dsenv.require_deepspeed()
        env = dsenv.no_compiler_env(tmp_path)
        for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
            env.pop(var, None)  # install() sets up the single process itself, as for a reader
        dsenv.run_python(["-c", code], env, timeout=300, cwd=str(tmp_path))
        assert dsenv.extensions_built(tmp_path) == []
        return
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"--- stdout ---\n{run.stdout[-4000:]}\n--- stderr ---\n{run.stderr[-6000:]}"


def test_the_runner_finds_the_known_blocks():
    """The collection sees the blocks these documents are known to hold, so that an empty or
    shrunken collection cannot pass for a good one."""
    ids = [p.id for p in PYTHON_BLOCKS]
    assert sum(i.startswith("README.md:") for i in ids) >= 4, ids
    for page in ("docs/lowbit.md", "docs/deepspeed.md", "docs/api.md", "docs/index.md"):
        assert any(i.startswith(page + ":") for i in ids), (page, ids)
    hf = [b for b in code_blocks((ROOT / "docs" / "deepspeed.md").read_text(encoding="utf-8"))
          if "transformers" in b["code"]]
    assert hf and all(b["not_run"] for b in hf)


def convention_problems(name: str, text: str) -> list[str]:
    """Python goes in ```python blocks only (another spelling would silently not run), and every
    not-run marker has a reason and stands right before a ```python block."""
    problems = []
    blocks = code_blocks(text)
    for b in blocks:
        if b["lang"] in ("py", "python3", "pycon", "py3", "ipython"):
            problems.append(f"{name}:{b['line']}: ```{b['lang']} (write ```python, or ```text)")
        if b["not_run"] is not None and b["lang"] != "python":
            problems.append(f"{name}:{b['line']}: a not-run marker before a ```{b['lang']} block")
    inside = {n for b in blocks for n in range(b["line"], b["line"] + b["code"].count("\n") + 2)}
    markers = [n + 1 for n, line in enumerate(text.splitlines()) if "<!-- not-run" in line and n + 1 not in inside]
    marked = {b["line"] for b in blocks if b["not_run"] is not None}
    for n in markers:
        if not any(0 < line - n <= 2 for line in marked):
            problems.append(f"{name}:{n}: a not-run marker without a reason or a ```python block after it")
    return problems


def test_block_conventions():
    problems = [p for doc in documents() for p in convention_problems(doc.name, doc.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def test_conventions_catch_what_they_name():
    good = "<!-- not-run: needs a Mac -->\n```python\nx\n```\n```text\n<!-- not-run: an example -->\n```\n"
    assert convention_problems("good.md", good) == []
    assert "```py " in convention_problems("a.md", "```py\nx = 1\n```\n")[0]
    assert "without a reason" in convention_problems("b.md", "<!-- not-run -->\n```python\nx\n```\n")[0]
    assert "without a reason" in convention_problems("c.md", "<!-- not-run: r -->\n\ntext\n\n```python\nx\n```\n")[0]
    assert "before a ```sh block" in convention_problems("d.md", "<!-- not-run: r -->\n```sh\nls\n```\n")[0]


def test_parser_on_a_sample():
    sample = ("text\n```python\nprint(1)\n```\n\n<!-- not-run: needs a Mac -->\n```python\nimport x\n```\n"
              "- item\n\n  ```sh\n  ls\n  ```\n<!-- not-run -->\n```python\ny\n```\n")
    blocks = code_blocks(sample)
    assert [(b["lang"], b["line"], b["not_run"]) for b in blocks] == [
        ("python", 2, None), ("python", 7, "needs a Mac"), ("sh", 12, None), ("python", 16, None)]
    assert blocks[2]["code"] == "ls\n"
    with pytest.raises(ValueError, match="never closes"):
        code_blocks("```python\nx = 1\n")
