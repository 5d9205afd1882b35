"""The README's quick-start examples run as written, and its set-up commands are the ones CI runs."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):text.index("## API")]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_quick_start_has_examples():
    assert len(quick_start_blocks()) >= 2


@pytest.mark.parametrize("index", range(2))
def test_quick_start_example_runs(index):
    code = quick_start_blocks()[index]
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_setup_commands_are_the_ones_ci_runs():
    text = README.read_text(encoding="utf-8")
    assert "python -m mps_fused_adam" in text and "python -m pytest tests" in text
    ci = (README.parent / "ci" / "test_installed_wheel.sh").read_text(encoding="utf-8")
    assert "python -m mps_fused_adam\n" in ci and "python -m pytest tests" in ci
