"""Shared fixtures. The tests import the installed package (CI runs them against the built wheel)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

DTYPE_PAIRS = [  # (param dtype, state dtype) pairs the kernels are instantiated for
    (torch.float32, torch.float32),
    (torch.float16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
]


def pair_id(pair) -> str:
    return "-".join(str(d).replace("torch.", "") for d in pair)


def require_tool(*names: str) -> list[str]:
    """Paths of the named tools. Missing tools skip the test on a developer machine but fail it
    where MFA_REQUIRE_TOOLS=1, as .ci/run sets after installing them: a skipped check must never
    pass for a run one. (Not keyed on CI: GitHub sets CI=true in cibuildwheel's per-wheel test
    environments too, which do not carry the cross tools.)"""
    found = [shutil.which(n) for n in names]
    missing = [n for n, f in zip(names, found) if f is None]
    if missing:
        msg = f"required tools not on PATH: {', '.join(missing)}"
        if os.environ.get("MFA_REQUIRE_TOOLS"):
            pytest.fail(msg + " (MFA_REQUIRE_TOOLS is set; .ci/run installs them)")
        pytest.skip(msg)
    return found  # type: ignore[return-value]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
