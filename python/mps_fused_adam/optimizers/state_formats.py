"""State formats: how an optimizer keeps a param's rule state, as a policy of the one optimizer base.

A *format* creates a param's state tensors, checks existing (or loaded) ones, re-takes them from a
state dict and names the backend rule (``contract.RULES``; 8-bit: ``"adam8bit"``) whose kernel
updates them. A *policy* picks the format of each param: every class but the 8-bit ones has one
format (:class:`Moments`: the rule's states in one dtype and the param's shape); the 8-bit classes
keep block-wise codes (:class:`Blockwise8bit`) and fp32 moments below ``min_8bit_size``. The step
(``fused.py``) buckets params by format, so a new format (4-bit, say) is a new class here and a
rule of the backends, nothing else of the step path.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from . import validate
from ..numerics.contract import RULES
from ..numerics.lowbit import SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE, num_blocks

SEED_KEY = "sr_seed"  # a bf16 param's stochastic-rounding seed, in its state (sr_seeds.py)


class Moments:
    """The rule's states (``contract.RULES[rule].states``), each of the param's shape, in one dtype:
    ``dtype`` where fixed, else the optimizer's (``_state_dtype``: the param's, CPUAdam's fp32)."""

    plain = True  # the step's inlined checks cover it (fused._plan_group)

    def __init__(self, rule: str, dtype: Optional[torch.dtype] = None) -> None:
        self.rule = rule
        # The rule with bf16 params stored by stochastic rounding (Adam's adam_sr; the others have none).
        self.sr_rule = RULES[rule].sr_rule or rule
        self.names: tuple[str, ...] = RULES[rule].states
        self.dtype = dtype

    def state_dtype(self, opt: Any, p: torch.Tensor) -> torch.dtype:
        return self.dtype or opt._state_dtype(p)

    def new(self, opt: Any, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        sd = self.state_dtype(opt, p)
        return {name: opt._new_state(p, name, sd, group) for name in self.names}

    def check(self, opt: Any, p: torch.Tensor, st: Mapping[str, Any], name: str) -> None:
        validate.check_state(p, st, name, self.state_dtype(opt, p), self.names)

    def check_saved(self, p: torch.Tensor, st: Mapping[str, Any], name: str) -> None:
        """A state dict's entry before it is loaded: floating tensors of the param's shape."""
        for key in self.names:
            t = st.get(key)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{validate.describe(p, name)}: optimizer state '{key}' is missing or not a tensor "
                                 f"(found {type(t).__name__})")
            if t.shape != p.shape or not t.is_floating_point():
                want = str(self.dtype or p.dtype).replace("torch.", "")
                raise ValueError(f"{validate.describe(p, name)}: optimizer state '{key}' is "
                                 f"{validate.describe(t, key)}; expected shape {tuple(p.shape)}, {want}")

    def retake(self, opt: Any, p: torch.Tensor, saved: Mapping[str, Any], st: dict[str, Any]) -> None:
        """Take ``saved``'s state tensors in this format's dtype (torch's load cast them to the param's)."""
        sd = self.state_dtype(opt, p)
        for name in self.names:
            if isinstance(saved.get(name), torch.Tensor):
                st[name] = saved[name].to(device=p.device, dtype=sd, memory_format=torch.preserve_format, copy=True)

    def __repr__(self) -> str:
        return f"Moments({self.rule!r}{'' if self.dtype is None else ', ' + str(self.dtype)})"


class Blockwise8bit:
    """Both Adam moments as uint8 codes of the param's shape and one fp32 scale per block of
    ``lowbit.BLOCK`` elements (``lowbit.py``'s contract; bitsandbytes' layout and key names)."""

    plain = False
    rule = sr_rule = "adam8bit"  # stochastic rounding: a switch of the same kernel (its sr_rule)
    # The backends' order of the rule's state lists (backends.Backend.update).
    names = RULES[rule].blocks.names

    def state_dtype(self, opt: Any, p: torch.Tensor) -> torch.dtype:
        return torch.uint8

    def new(self, opt: Any, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        nb = num_blocks(p.numel())
        return {"exp_avg_codes": torch.full_like(p, SIGNED_ZERO_CODE, dtype=torch.uint8,
                                                 memory_format=torch.contiguous_format),
                "exp_avg_absmax": torch.zeros(nb, dtype=torch.float32, device=p.device),
                "exp_avg_sq_codes": torch.full_like(p, UNSIGNED_ZERO_CODE, dtype=torch.uint8,
                                                    memory_format=torch.contiguous_format),
                "exp_avg_sq_absmax": torch.zeros(nb, dtype=torch.float32, device=p.device)}

    def _expected(self, p: torch.Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        shape, nb = tuple(p.shape), (num_blocks(p.numel()),)
        return {"exp_avg_codes": (shape, torch.uint8), "exp_avg_absmax": (nb, torch.float32),
                "exp_avg_sq_codes": (shape, torch.uint8), "exp_avg_sq_absmax": (nb, torch.float32)}

    def fits(self, p: torch.Tensor, states: list, on_cpu: bool) -> bool:
        """The step's one-expression check of existing state (``check`` names what does not fit)."""
        plain_t, shape = torch.Tensor, p.shape
        c1, a1, c2, a2 = states
        nb = num_blocks(p.numel())
        return (type(c1) is plain_t and type(c2) is plain_t and type(a1) is plain_t and type(a2) is plain_t
                and c1.dtype is torch.uint8 and c2.dtype is torch.uint8 and c1.shape == shape and c2.shape == shape
                and a1.dtype is torch.float32 and a2.dtype is torch.float32
                and a1.shape == (nb,) and a2.shape == (nb,)
                and all((t.is_cpu if on_cpu else t.device == p.device) for t in states))

    def check(self, opt: Any, p: torch.Tensor, st: Mapping[str, Any], name: str, saved: bool = False) -> None:
        """Raise a ValueError naming the param and the entry that does not fit. ``saved``: a state
        dict's entry before it is loaded (then converted to the param's device and the dtypes
        here), so only shapes and the codes' dtype must fit."""
        for key, (shape, dtype) in self._expected(p).items():
            t = st.get(key)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{validate.describe(p, name)}: optimizer state '{key}' is missing or not a tensor "
                                 f"(found {type(t).__name__})")
            fits = (t.is_floating_point() if dtype == torch.float32 else t.dtype == dtype) if saved else \
                (t.dtype == dtype and t.device == p.device)
            if tuple(t.shape) != shape or not fits:
                raise ValueError(f"{validate.describe(p, name)}: optimizer state '{key}' is "
                                 f"{validate.describe(t, key)}; expected shape {shape}, "
                                 f"{str(dtype).replace('torch.', '')}" + ("" if saved else f", {p.device}"))
        if not saved:
            validate.check_step(p, st, name)

    def check_saved(self, p: torch.Tensor, st: Mapping[str, Any], name: str) -> None:
        self.check(None, p, st, name, saved=True)

    def retake(self, opt: Any, p: torch.Tensor, saved: Mapping[str, Any], st: dict[str, Any]) -> None:
        for key, (_, dtype) in self._expected(p).items():
            t = saved.get(key)
            if isinstance(t, torch.Tensor):
                st[key] = t.to(device=p.device, dtype=dtype, copy=True)

    def __repr__(self) -> str:
        return "Blockwise8bit()"


class OneFormat:
    """The policy of every class but the 8-bit ones: one :class:`Moments` format for all params."""

    def __init__(self, rule: str) -> None:
        self.only = Moments(rule)
        self.formats = (self.only,)
        self.kind = None  # the class's own validate.StateDictKind
        self.check_saved = None  # validate.check_state_dict checks the states of kind

    def of_state(self, st: Mapping[str, Any]) -> Moments:
        return self.only

    def for_new(self, p: torch.Tensor, group: dict[str, Any]) -> Moments:
        return self.only


class EightBit:
    """The 8-bit classes' policy: :class:`Blockwise8bit` for params of at least the group's
    ``min_8bit_size`` elements, fp32 :class:`Moments` of the Adam rule below (as bitsandbytes)."""

    only = None

    def __init__(self) -> None:
        self.q8 = Blockwise8bit()
        self.small = Moments("adam", torch.float32)
        self.formats = (self.q8, self.small)
        # Adam's group hyperparameters; the states are checked per param by the format they are in.
        self.kind = validate.StateDictKind("Adam-family", ("betas", "eps"), ("lr_decay",), ())

    def of_state(self, st: Mapping[str, Any]) -> Any:
        return self.q8 if "exp_avg_codes" in st else self.small

    def for_new(self, p: torch.Tensor, group: dict[str, Any]) -> Any:
        return self.q8 if p.numel() >= int(group["min_8bit_size"]) else self.small

    def check_saved(self, p: torch.Tensor, st: Mapping[str, Any], name: str) -> None:
        self.of_state(st).check_saved(p, st, name)
