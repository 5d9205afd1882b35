"""Prebuilt fused Adam (and Lion and Adagrad) for PyTorch and DeepSpeed: a Metal kernel for Apple
Silicon (MPS) and a SIMD C++ CPU kernel, with no compiler or JIT build on the user's machine."""
from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__

# The submodule of each public name, imported on first use (PEP 562): `python -m mps_fused_adam
# --help` runs this file first and must answer without importing torch (a second or more).
_PUBLIC = {"Adagrad": "optimizers.fused", "Adam": "optimizers.fused", "Adam4bit": "optimizers.four_bit", "Adam8bit": "optimizers.eight_bit", "AdamW": "optimizers.fused", "AdamW4bit": "optimizers.four_bit", "AdamW8bit": "optimizers.eight_bit", "CPUAdam": "optimizers.fused", "FusedAdam": "optimizers.fused",
           "FusedLion": "optimizers.fused", "Lion": "optimizers.fused", "backend_info": "backends"}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
