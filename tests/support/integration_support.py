"""The training libraries the integration tests run against (transformers, accelerate, Lightning):
imported, or the test skipped, unless MFA_REQUIRE_INTEGRATION=1 (.ci/run), where a missing one
fails."""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(name: str) -> ModuleType:
    if os.environ.get("MFA_REQUIRE_INTEGRATION"):
        return importlib.import_module(name)
    return pytest.importorskip(name)
