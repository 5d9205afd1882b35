"""What the low-bit Adam classes share (``eight_bit.py``, ``four_bit.py``): the Adam rule of the one
optimizer base with a block-wise state format policy (``state_formats.EightBit``/``FourBit``), the
group's minimum quantized size, the load of fp32 (``torch.optim``) moments into codes, the torch
options they refuse, and the state-size measure."""
from __future__ import annotations

import numbers
from typing import Any, Mapping

import torch

from . import validate
from .fused import _AdamBase
from ..bnb_compat import BNB_WRAP_KEY


class LowBitAdam(_AdamBase):
    """Adam with a low-bit policy (``_policy``, whose ``size_key`` names the group key of the
    smallest quantized param). Group keys: lr, betas, eps, weight_decay, adam_w_mode,
    bias_correction, maximize, the size key, bf16_stochastic_round."""

    _policy: Any = None

    @property
    def _kept_group_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("bf16_stochastic_round", self._policy.size_key)

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        super()._check_group(group, where)
        self._check_added_group(group, where or type(self).__name__)

    def _check_added_group(self, group: dict[str, Any], where: str) -> None:
        key = self._policy.size_key
        size = group.get(key)
        if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{where}: {key} must be a positive element count (an int), got {size!r}")
        self._check_options(group, where if where.startswith(self._name) else f"{self._name} {where}")

    def _check_options(self, options: Mapping[str, Any], who: str) -> None:
        """The options the class refuses, on its constructor's keywords or on a group given them
        (``add_param_group``; a key left out takes the keyword's default), so that a refused
        option is never stepped without. Subclasses add their own."""
        check_torch_options(who, options.get("amsgrad", False), options.get("capturable", False),
                            options.get("differentiable", False))

    def _retake_states(self, state_dict: dict[str, Any]) -> None:
        super()._retake_states(state_dict)
        fmt, key = self._policy.quantized, self._policy.size_key
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and "exp_avg" in st and p.numel() >= int(group[key]):
                    st.update(fmt.quantized(st.pop("exp_avg"), st.pop("exp_avg_sq"), p.device))


def refuse_bitsandbytes_layout(p: torch.Tensor, st: Mapping[str, Any], name: str) -> None:
    """A state dict entry in bitsandbytes' layout, refused naming the converter (which every
    low-bit class loads the result of)."""
    if BNB_WRAP_KEY in st or "state1" in st:
        raise ValueError(f"{validate.describe(p, name)}: the state dict is in bitsandbytes' layout (keys "
                         f"{sorted(map(str, st))}); convert it first: "
                         f"opt.load_state_dict(mps_fused_adam.bnb_compat.from_bitsandbytes(state_dict))")


def check_torch_options(cls: str, amsgrad: bool, capturable: bool, differentiable: bool) -> None:
    """torch.optim.Adam's options that change the algorithm, refused by name."""
    for option, value in (("amsgrad", amsgrad), ("capturable", capturable), ("differentiable", differentiable)):
        if value:
            raise ValueError(f"{cls} does not support {option}={value!r}")


def state_bytes_per_param(opt: torch.optim.Optimizer) -> float:
    """Bytes of optimizer-state tensors per parameter element over every parameter with state."""
    total = elems = 0
    for p, st in opt.state.items():
        elems += p.numel()
        total += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
    return total / elems if elems else 0.0
