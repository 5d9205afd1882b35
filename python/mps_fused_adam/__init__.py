"""Prebuilt fused Adam (and Lion and Adagrad) for PyTorch and DeepSpeed: a Metal kernel for Apple
Silicon (MPS) and a SIMD C++ CPU kernel, with no compiler or JIT build on the user's machine."""
from ._version import __version__
from .backends import backend_info
from .optim import Adagrad, Adam, AdamW, CPUAdam, FusedAdam, FusedLion, Lion

__all__ = ["Adagrad", "Adam", "AdamW", "CPUAdam", "FusedAdam", "FusedLion", "Lion", "backend_info", "__version__"]
