"""torch's own constructor checks for the classes that stand in for ``torch.optim.Adam``/``AdamW``
and ``Adagrad``, in torch's order and with torch's exception types and messages (torch 2.13), so
that code moving between torch's class and ours meets the same errors.

The comparisons are torch's: ``0.0 <= lr`` on the value as given, so a string raises torch's
``TypeError`` and a Tensor is compared as a Tensor. The per-step group checks (``validate.py``)
come after these and add which group a value belongs to.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

try:  # torch's check of a param its fused kernels take (torch.optim.optimizer, torch 2.x)
    from torch.optim.optimizer import _device_dtype_check_for_fused as _torch_fused_check
except ImportError:  # pragma: no cover - a torch without it: the same test, the same message
    _torch_fused_check = None

_Tensor = torch.Tensor


def check_adam_args(lr: Any, betas: Any, eps: Any, weight_decay: Any, foreach: Optional[bool],
                    capturable: bool) -> tuple[Any, Any]:
    """``torch.optim.Adam.__init__``'s checks; returns the betas as torch keeps them (a 1-element
    Tensor beta as a 0-dim one)."""
    if isinstance(lr, _Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not ((isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], _Tensor) and isinstance(betas[1], _Tensor))):
        raise ValueError("betas must be either both floats or both Tensors")
    for i in (0, 1):
        if isinstance(betas[i], _Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
            if betas[i].numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
    return tuple(b.squeeze() if isinstance(b, _Tensor) and b.dim() != 0 else b for b in betas)


def check_adagrad_args(lr: Any, lr_decay: Any, weight_decay: Any, initial_accumulator_value: Any, eps: Any) -> None:
    """``torch.optim.Adagrad.__init__``'s checks."""
    if isinstance(lr, _Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= lr_decay:
        raise ValueError(f"Invalid lr_decay value: {lr_decay}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not 0.0 <= initial_accumulator_value:
        raise ValueError(f"Invalid initial_accumulator_value value: {initial_accumulator_value}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")


def check_fused_flags(fused: Optional[bool], foreach: Optional[bool], differentiable: bool) -> None:
    """The checks torch makes of ``fused=True`` once the groups exist (torch raises RuntimeError)."""
    if fused:
        if differentiable:
            raise RuntimeError("`fused` does not support `differentiable`")
        if foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def check_fused_param(p: torch.Tensor) -> None:
    """What torch's fused implementation requires of a param before it creates the param's state
    (``_device_dtype_check_for_fused``): a floating-point tensor on a device torch's fused kernels
    support, which leaves out meta tensors. Ours runs on any device, but a group that asked for
    ``fused=True`` gets torch's answer, so a model that steps with ours steps with torch's too."""
    if _torch_fused_check is not None:
        _torch_fused_check(p)
        return
    if p.device.type == "meta" or not torch.is_floating_point(p):  # pragma: no cover
        raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of "
                           f"supported devices but {p.dtype} and {p.device.type}")
