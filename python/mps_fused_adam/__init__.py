"""Prebuilt fused Adam for PyTorch and DeepSpeed: a Metal kernel for Apple Silicon (MPS) and a
SIMD C++ CPU Adam, with no compiler or JIT build on the user's machine."""
from ._version import __version__
from .backends import backend_info
from .optim import Adam, AdamW, CPUAdam, FusedAdam
from .optim8bit import Adam8bit, AdamW8bit

__all__ = ["Adam", "AdamW", "Adam8bit", "AdamW8bit", "CPUAdam", "FusedAdam", "backend_info", "__version__"]
