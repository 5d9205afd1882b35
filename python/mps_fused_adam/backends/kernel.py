"""The key of one kernel a backend may run (``backends.Kernel``), in its own module so that the
backends' modules (mps.py, chain.py) share it without importing the package's ``__init__``."""
from __future__ import annotations

from typing import NamedTuple

import torch


class Kernel(NamedTuple):
    """What one bucket of a step asks of a backend: a rule of the one rule table, the params'
    (and grads') dtype and the states' storage dtype (``torch.uint8`` for 8-bit codes).

    A backend runs a set of kernels; ``Backend.unavailable`` says whether it runs this one and,
    when not, why (for ``backend_info()`` and for routing the bucket to the next tier)."""
    rule: str
    param_dtype: torch.dtype
    state_dtype: torch.dtype


_SHORT = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.uint8: "uint8"}


def describe(kernel: Kernel) -> str:
    """``rule param/state``, e.g. ``adam bfloat16/float32``: how messages name a kernel."""
    rule, p, s = kernel
    return f"{rule} {_SHORT.get(p, p)}/{_SHORT.get(s, s)}"


def kernel_of(rule: str, params, states) -> Kernel:
    """The kernel an ``update(rule, params, grads, states, hp)`` call runs."""
    return Kernel(rule, params[0].dtype, states[0][0].dtype)
