"""Autograd's version counters of the tensors a step wrote.

The kernels write through data pointers, which autograd does not see. torch's own optimizers update
params with in-place torch ops, each of which bumps the param's version counter, and autograd checks
that counter when a backward unpacks a saved tensor: a graph retained before ``step()`` and run
again afterwards raises "one of the variables needed for gradient computation has been modified by
an inplace operation" instead of silently using the new weights. Every path that writes a param
therefore calls :func:`bump` on it once the write is done (``torch.autograd.graph.increment_version``,
which torch documents for exactly this: custom kernels writing through ``data_ptr``).

A view made with ``.detach()`` shares its base's counter, so bumping it bumps the param; ``.data``
does not (DeepSpeed's optimizers hand ``p.data`` to their kernels, so theirs, and ours behind them,
cannot reach the param's counter: DeepSpeed's CUDA kernels leave it unchanged too).
"""
from __future__ import annotations

from typing import Iterable

import torch

# The C function behind torch.autograd.graph.increment_version, which takes any iterable of tensors
# in one call (its cost per tensor: docs/torch-compat.md); the public wrapper only adds a type test.
_increment = getattr(torch._C, "_increment_version", None)


def bump(tensors: Iterable[torch.Tensor]) -> None:
    """Increment the version counter of every tensor of ``tensors`` (a list or tuple)."""
    if _increment is not None:
        _increment(tensors)
    else:  # pragma: no cover - a torch without the C entry point
        torch.autograd.graph.increment_version(list(tensors))
