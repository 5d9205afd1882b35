"""``AdamW4bit`` and ``Adam4bit``: Adam with both moments stored as 4-bit block-wise codes
(Li et al. 2023 as torchao ships it; contract in ``lowbit4.py``), optionally with bf16 stochastic
rounding.

They are the low-bit Adam base (``low_bit.LowBitAdam``) with the 4-bit state format policy
(``state_formats.FourBit``): the validation, step plans, ``step_in_backward`` and load checks of
every class, torch's keywords plus ``min_4bit_size`` and torchao's ``block_size`` (128 only).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from . import state_formats, validate
from .low_bit import LowBitAdam, refuse_bitsandbytes_layout
from ..numerics.lowbit4 import BLOCK4, MIN_4BIT_SIZE

_Params = Iterable[Any]


def _is_torchao_state(t: Any) -> bool:
    return type(t).__name__ == "OptimState4bit" or all(hasattr(t, a) for a in ("codes", "scale", "qmap"))


class _Four(state_formats.FourBit):
    refuses_dtensor = True  # blocks of a shard are not the blocks of the tensor

    def check_saved(self, p: torch.Tensor, st: Any, name: str) -> None:
        if any(_is_torchao_state(st.get(k)) for k in ("exp_avg", "exp_avg_sq")):
            raise ValueError(f"{validate.describe(p, name)}: the state dict is torchao's (OptimState4bit moments); "
                             f"convert it first: "
                             f"opt.load_state_dict(mps_fused_adam.torchao_compat.from_torchao(state_dict))")
        refuse_bitsandbytes_layout(p, st, name)
        super().check_saved(p, st, name)


class Adam4bit(LowBitAdam):
    """Adam with 4-bit block-wise states: ``torch.optim.Adam``'s arguments (L2 weight decay unless
    ``decoupled_weight_decay=True``) plus ``min_4bit_size`` (tensors with fewer elements keep fp32
    moments), ``bf16_stochastic_round`` (bf16 params stored by stochastic rounding),
    ``step_in_backward`` and torchao's ``block_size`` (only its default, 128). ``foreach``/``fused``
    are accepted and ignored; ``amsgrad``, ``capturable`` and ``differentiable`` are rejected.

    ``load_state_dict`` takes a state dict of ours, a ``torch.optim.Adam``/``AdamW`` or an
    ``AdamW8bit``/``Adam8bit`` one (moments quantized to 4-bit codes as a step would store them);
    torchao's converts through ``torchao_compat.from_torchao``.
    """

    _name = "Adam4bit"
    _decoupled_default = False
    _policy = _Four()

    def __init__(self, params: _Params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 decoupled_weight_decay: Optional[bool] = None, min_4bit_size: int = MIN_4BIT_SIZE,
                 block_size: int = BLOCK4, bf16_stochastic_round: bool = False,
                 step_in_backward: bool = False) -> None:
        self._check_options(dict(amsgrad=amsgrad, capturable=capturable, differentiable=differentiable,
                                 block_size=block_size), self._name)
        decoupled = self._decoupled_default if decoupled_weight_decay is None else bool(decoupled_weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=decoupled,
                                      bias_correction=True, maximize=maximize, min_4bit_size=min_4bit_size,
                                      bf16_stochastic_round=bool(bf16_stochastic_round)), step_in_backward)

    def _check_options(self, options: dict[str, Any], who: str) -> None:
        super()._check_options(options, who)
        block_size = options.get("block_size", BLOCK4)
        if block_size != BLOCK4:
            raise ValueError(f"{who}: block_size={block_size!r} is not supported: the 4-bit states are "
                             f"quantized in blocks of {BLOCK4} (torchao's default), which the kernels are built for")


class AdamW4bit(Adam4bit):
    """AdamW with 4-bit block-wise states: ``torch.optim.AdamW``'s arguments (decoupled weight
    decay, default 1e-2) plus those of :class:`Adam4bit`; the counterpart of
    ``torchao.optim.AdamW4bit``."""

    _name = "AdamW4bit"
    _decoupled_default = True
    _always_decoupled = True  # as AdamW (fused._AdamBase)

    def __init__(self, params: _Params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None, min_4bit_size: int = MIN_4BIT_SIZE,
                 block_size: int = BLOCK4, bf16_stochastic_round: bool = False,
                 step_in_backward: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, capturable=capturable,
                         differentiable=differentiable, decoupled_weight_decay=True, min_4bit_size=min_4bit_size,
                         block_size=block_size, bf16_stochastic_round=bf16_stochastic_round,
                         step_in_backward=step_in_backward)
