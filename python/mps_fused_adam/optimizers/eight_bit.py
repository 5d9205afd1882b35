"""``AdamW8bit`` and ``Adam8bit``: Adam with both moments stored as 8-bit block-wise codes
(bitsandbytes' scheme, contract in ``lowbit.py``), optionally with bf16 stochastic rounding.

They are the Adam rule of the one optimizer base (``fused._AdamBase``) with the 8-bit state
format policy (``state_formats.EightBit``): the same validation, step plans, ``step_in_backward``
and load checks as every class, bitsandbytes' keywords and group keys.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from . import state_formats, validate
from .low_bit import LowBitAdam, check_torch_options, refuse_bitsandbytes_layout, state_bytes_per_param  # noqa: F401
from ..numerics import lowbit
from ..numerics.lowbit import MIN_8BIT_SIZE

_Params = Iterable[Any]


class _Eight(state_formats.EightBit):
    refuses_dtensor = True  # blocks of a shard are not the blocks of the tensor

    def check_saved(self, p: torch.Tensor, st: Any, name: str) -> None:
        refuse_bitsandbytes_layout(p, st, name)
        if state_formats.Blockwise4bit.names[0] in st:
            raise ValueError(f"{validate.describe(p, name)}: the state dict holds 4-bit states (keys "
                             f"{sorted(map(str, st))}); load it into AdamW4bit/Adam4bit, which saved it")
        super().check_saved(p, st, name)


class _Adam8bitBase(LowBitAdam):
    """Adam with the 8-bit policy. Group keys: lr, betas, eps, weight_decay, adam_w_mode,
    bias_correction, maximize, min_8bit_size, bf16_stochastic_round."""

    _policy = _Eight()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of ours, with tensor or int steps (``bnb_compat.from_bitsandbytes``
        converts bitsandbytes'; one in bitsandbytes' layout is refused saying so).

        torch casts floating state tensors to the parameter's dtype; the block scales and fp32
        moments are re-taken from the saved tensors as fp32, ``step`` and ``sr_seed`` as ints.
        fp32 moments of a param of at least its group's ``min_8bit_size`` elements (a
        ``torch.optim.AdamW``/``Adam`` checkpoint) are quantized to 8-bit codes, as the next step
        would store them, so the optimizer keeps its 2 bytes of state per element. torch's load
        pre- and post-hooks run as torch runs them.
        """
        super().load_state_dict(state_dict)


def _check_bnb_options(cls: str, optim_bits: int, args: Any, is_paged: bool, percentile_clipping: int,
                       block_wise: bool) -> None:
    if optim_bits != 32:
        raise ValueError(f"{cls}: optim_bits={optim_bits!r} is not supported: the states are always 8-bit "
                         "(bitsandbytes 0.50 accepts only the default 32 here too; use AdamW for 32-bit states)")
    if args is not None:
        raise ValueError(f"{cls}: args (a bitsandbytes GlobalOptimManager config) is not supported; pass "
                         "hyperparameters as arguments or per param group")
    if is_paged:
        raise ValueError(f"{cls}: is_paged=True is not supported: paging moves CUDA states to host memory; "
                         "on Apple Silicon and CPU memory is already unified")
    if percentile_clipping != 100:
        raise ValueError(f"{cls}: percentile_clipping={percentile_clipping!r} is not implemented (bitsandbytes "
                         "0.50 removed it too); clip gradients with torch.nn.utils.clip_grad_norm_")
    if not block_wise:
        raise ValueError(f"{cls}: block_wise=False is not supported: states are always quantized in blocks of "
                         f"{lowbit.BLOCK}")


class Adam8bit(_Adam8bitBase):
    """Adam with 8-bit block-wise states: ``torch.optim.Adam``'s arguments (L2 weight decay unless
    ``decoupled_weight_decay=True``) plus bitsandbytes' ``min_8bit_size`` (tensors with fewer
    elements keep fp32 moments) and ``bf16_stochastic_round`` (bf16 params stored by stochastic
    rounding). ``foreach``/``fused`` are accepted and ignored; ``amsgrad``, ``capturable``,
    ``differentiable``, ``optim_bits`` other than its default, ``args``, ``is_paged=True``,
    ``percentile_clipping`` other than 100 and ``block_wise=False`` are rejected.

    Note: bitsandbytes' ``Adam8bit`` applies its weight decay decoupled (as AdamW); this class
    follows ``torch.optim.Adam``. A converted bitsandbytes state dict keeps bitsandbytes' meaning.
    """

    _name = "Adam8bit"
    _decoupled_default = False

    def __init__(self, params: _Params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, optim_bits: int = 32,
                 args: Any = None, min_8bit_size: int = MIN_8BIT_SIZE, is_paged: bool = False, *,
                 maximize: bool = False, foreach: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 decoupled_weight_decay: Optional[bool] = None, percentile_clipping: int = 100,
                 block_wise: bool = True, bf16_stochastic_round: bool = False, step_in_backward: bool = False) -> None:
        self._check_options(dict(amsgrad=amsgrad, capturable=capturable, differentiable=differentiable,
                                 optim_bits=optim_bits, args=args, is_paged=is_paged,
                                 percentile_clipping=percentile_clipping, block_wise=block_wise), self._name)
        decoupled = self._decoupled_default if decoupled_weight_decay is None else bool(decoupled_weight_decay)
        # min_8bit_size as given: the constructor's check is add_param_group's (no int() that takes '4096').
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=decoupled,
                                      bias_correction=True, maximize=maximize, min_8bit_size=min_8bit_size,
                                      bf16_stochastic_round=bool(bf16_stochastic_round)), step_in_backward)

    def _check_options(self, options: dict[str, Any], who: str) -> None:
        super()._check_options(options, who)
        _check_bnb_options(who, options.get("optim_bits", 32), options.get("args"), options.get("is_paged", False),
                           options.get("percentile_clipping", 100), options.get("block_wise", True))


class AdamW8bit(Adam8bit):
    """AdamW with 8-bit block-wise states: ``torch.optim.AdamW``'s arguments (decoupled weight
    decay, default 1e-2) plus those of :class:`Adam8bit`; the drop-in for
    ``bitsandbytes.optim.AdamW8bit``."""

    _name = "AdamW8bit"
    _decoupled_default = True
    _always_decoupled = True  # as AdamW (fused._AdamBase)

    def __init__(self, params: _Params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, optim_bits: int = 32,
                 args: Any = None, min_8bit_size: int = MIN_8BIT_SIZE, is_paged: bool = False, *,
                 maximize: bool = False, foreach: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None, percentile_clipping: int = 100,
                 block_wise: bool = True, bf16_stochastic_round: bool = False, step_in_backward: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size, is_paged,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         decoupled_weight_decay=True, percentile_clipping=percentile_clipping,
                         block_wise=block_wise, bf16_stochastic_round=bf16_stochastic_round,
                         step_in_backward=step_in_backward)
