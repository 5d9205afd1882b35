"""What a backend reads from each tensor of a step, carried along when the caller has it already."""
from __future__ import annotations

from typing import Optional, Sequence

import torch


class Addressed(list):
    """A list of tensors that also carries what a backend would otherwise read from each of them:
    ``addresses`` (``data_ptr()``) and, where known, ``numels``. The optimizer's step plans hand
    these over (step_plan.py), having read and checked the addresses this step."""

    addresses: list[int]
    numels: Optional[list[int]]


def addresses(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Every tensor's ``data_ptr()``, taken from an :class:`Addressed` list when it has them."""
    return tensors.addresses if type(tensors) is Addressed else [t.data_ptr() for t in tensors]


def numels(tensors: Sequence[torch.Tensor]) -> list[int]:
    known = tensors.numels if type(tensors) is Addressed else None
    return known if known is not None else [t.numel() for t in tensors]
