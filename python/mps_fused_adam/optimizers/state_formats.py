"""State formats: how an optimizer keeps a param's rule state, as a policy of the one optimizer base.

A *format* creates a param's state tensors, checks existing (or loaded) ones, re-takes them from a
state dict and names the backend rule (``contract.RULES``; 8-bit: ``"adam8bit"``) whose kernel
updates them. A *policy* picks the format of each param: every class but the 8-bit ones has one
format (:class:`Moments`: the rule's states in one dtype and the param's shape); the 8-bit classes
keep block-wise codes (:class:`Blockwise8bit`) and fp32 moments below ``min_8bit_size``, the
4-bit ones packed 4-bit codes (:class:`Blockwise4bit`) and fp32 moments below ``min_4bit_size``. The step
(``fused.py``) buckets params by format, so a new format is a new class here and a rule of the
backends, nothing else of the step path.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from . import validate
from ..numerics.contract import RULES
from ..numerics import lowbit4, reference_lowbit
from ..numerics.lowbit import SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE, num_blocks

SEED_KEY = "sr_seed"  # a bf16 param's stochastic-rounding seed, in its state (sr_seeds.py)
# The shape of the param a 4-bit state was made for (lowbit4.shape_tensor says why and how);
# torch's load casts it like a moment, so loads re-take it from the saved dict.
SHAPE_KEY4 = "param_shape4"


def _made_for(st: Mapping[str, Any]) -> Optional[tuple[int, ...]]:
    t = st.get(SHAPE_KEY4)
    if isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_floating_point() and not t.is_complex():
        return tuple(t.tolist())
    return None


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


class _Blockwise:
    """Both Adam moments as uint8 codes and one fp32 scale per block (the low-bit formats): a
    subclass says the rule, the state names (the backends' order: codes1, absmax1, codes2,
    absmax2), the codes' shape and the block count, the fresh codes, and how fp32 moments are
    quantized into it."""

    plain = False
    rule = sr_rule = ""  # stochastic rounding: a switch of the same kernel
    names: tuple[str, str, str, str] = ("", "", "", "")

    def codes_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        raise NotImplementedError

    def blocks(self, numel: int) -> int:
        raise NotImplementedError

    def fresh_codes(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        raise NotImplementedError

    def quantized(self, m: torch.Tensor, v: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        """fp32 moments (a ``torch.optim.AdamW`` checkpoint's) as this format's states: what a step
        stores (the contract's quantizer), computed on the CPU."""
        raise NotImplementedError

    def state_dtype(self, opt: Any, p: torch.Tensor) -> torch.dtype:
        return torch.uint8

    def new(self, opt: Any, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        nb = self.blocks(p.numel())
        c1, a1, c2, a2 = self.names
        return {c1: self.fresh_codes(p, True), a1: torch.zeros(nb, dtype=torch.float32, device=p.device),
                c2: self.fresh_codes(p, False), a2: torch.zeros(nb, dtype=torch.float32, device=p.device)}

    def _expected(self, p: torch.Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        shape, nb = self.codes_shape(p), (self.blocks(p.numel()),)
        c1, a1, c2, a2 = self.names
        return {c1: (shape, torch.uint8), a1: (nb, torch.float32), c2: (shape, torch.uint8), a2: (nb, torch.float32)}

    def fits(self, p: torch.Tensor, states: list, on_cpu: bool, st: Mapping[str, Any]) -> bool:
        """The step's one-expression check of existing state ``st`` (its tensors ``states``;
        ``check`` names what does not fit)."""
        plain_t, shape = torch.Tensor, self.codes_shape(p)
        c1, a1, c2, a2 = states
        nb = (self.blocks(p.numel()),)
        return (type(c1) is plain_t and type(c2) is plain_t and type(a1) is plain_t and type(a2) is plain_t
                and c1.dtype is torch.uint8 and c2.dtype is torch.uint8 and c1.shape == shape and c2.shape == shape
                and a1.dtype is torch.float32 and a2.dtype is torch.float32
                and a1.shape == nb and a2.shape == nb
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
        return f"{type(self).__name__}()"


class Blockwise8bit(_Blockwise):
    """Both Adam moments as uint8 codes of the param's shape and one fp32 scale per block of
    ``lowbit.BLOCK`` elements (``lowbit.py``'s contract; bitsandbytes' layout and key names)."""

    rule = sr_rule = "adam8bit"  # stochastic rounding: a switch of the same kernel (its sr_rule)
    names = RULES[rule].blocks.names  # the backends' order of the rule's state lists

    def codes_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        return tuple(p.shape)

    def blocks(self, numel: int) -> int:
        return num_blocks(numel)

    def fresh_codes(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        return torch.full_like(p, SIGNED_ZERO_CODE if signed else UNSIGNED_ZERO_CODE, dtype=torch.uint8,
                               memory_format=torch.contiguous_format)

    def quantized(self, m: torch.Tensor, v: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        out = {}
        for (codes, absmax), t, signed in ((self.names[:2], m, True), (self.names[2:], v, False)):
            t = t.detach().to("cpu", torch.float32).contiguous()
            scale = reference_lowbit.block_absmax(t)
            out[codes] = reference_lowbit.quantize(t, scale, signed).to(device)
            out[absmax] = scale.contiguous().to(device)
        return out

    def moments(self, st: Mapping[str, Any], p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A saved 8-bit entry's moments as fp32 tensors of the param's shape (on the CPU)."""
        c1, a1, c2, a2 = (st[k].detach().cpu() for k in self.names)
        return (reference_lowbit.dequantize(c1.to(torch.uint8).reshape(p.shape), a1.float(), True),
                reference_lowbit.dequantize(c2.to(torch.uint8).reshape(p.shape), a2.float(), False))


class Blockwise4bit(_Blockwise):
    """Both Adam moments as 4-bit codes packed two a byte (a 1-D uint8 tensor of ``ceil(n / 2)``
    bytes whatever the param's shape) and one fp32 scale per block of ``lowbit4.BLOCK4``
    elements (``lowbit4.py``'s contract; torchao's maps, blocks and packing)."""

    rule = sr_rule = "adam4bit"
    names = RULES[rule].blocks.names

    def codes_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        return (lowbit4.packed_size(p.numel()),)

    def blocks(self, numel: int) -> int:
        return lowbit4.num_blocks4(numel)

    def fresh_codes(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        return lowbit4.fresh_codes4(p.numel(), signed, p.device)

    def quantized(self, m: torch.Tensor, v: torch.Tensor, device: torch.device) -> dict[str, Any]:
        out: dict[str, Any] = {SHAPE_KEY4: lowbit4.shape_tensor(m.shape)}
        for (codes, absmax), t, signed in ((self.names[:2], m, True), (self.names[2:], v, False)):
            t = t.detach().to("cpu", torch.float32).reshape(-1).contiguous()
            scale = reference_lowbit.block_absmax(t, lowbit4.BLOCK4)
            out[codes] = reference_lowbit.quantize4(t, scale, signed).to(device)
            out[absmax] = (scale if signed else lowbit4.stored_scale2(scale)).contiguous().to(device)
        return out

    def new(self, opt: Any, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        st: dict[str, Any] = super().new(opt, p, group)
        st[SHAPE_KEY4] = lowbit4.shape_tensor(p.shape)
        return st

    def fits(self, p: torch.Tensor, states: list, on_cpu: bool, st: Mapping[str, Any]) -> bool:
        return super().fits(p, states, on_cpu, st) and _made_for(st) == p.shape

    def check(self, opt: Any, p: torch.Tensor, st: Mapping[str, Any], name: str, saved: bool = False) -> None:
        super().check(opt, p, st, name, saved)
        made_for = _made_for(st)
        if made_for is None:
            found = st.get(SHAPE_KEY4)
            raise ValueError(f"{validate.describe(p, name)}: optimizer state '{SHAPE_KEY4}' (the shape of the param "
                             f"its 4-bit codes were made for, a 1-D integer tensor) is "
                             f"{'missing' if found is None else repr(found)}; a 4-bit state dict of a development "
                             f"version before it loads once it is set: state['{SHAPE_KEY4}'] = "
                             f"torch.tensor(param.shape)")
        if made_for != tuple(p.shape):
            raise ValueError(f"{validate.describe(p, name)}: its 4-bit states were made for a param of shape "
                             f"{made_for} ('{SHAPE_KEY4}'), not {tuple(p.shape)}: the codes of one would be "
                             f"applied to the elements of the other")

    def retake(self, opt: Any, p: torch.Tensor, saved: Mapping[str, Any], st: dict[str, Any]) -> None:
        super().retake(opt, p, saved, st)
        st[SHAPE_KEY4] = lowbit4.shape_tensor(saved[SHAPE_KEY4])


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


class _LowBit:
    """A low-bit class's policy: its block-wise format for params of at least the group's
    ``size_key`` elements (``min_8bit_size``/``min_4bit_size``), fp32 :class:`Moments` of the Adam
    rule below (as bitsandbytes and torchao)."""

    only = None
    size_key = ""

    def __init__(self, quantized: _Blockwise) -> None:
        self.quantized = quantized
        self.small = Moments("adam", torch.float32)
        self.formats = (quantized, self.small)
        # Adam's group hyperparameters; the states are checked per param by the format they are in.
        self.kind = validate.StateDictKind("Adam-family", ("betas", "eps"), ("lr_decay",), ())

    def of_state(self, st: Mapping[str, Any]) -> Any:
        return self.quantized if self.quantized.names[0] in st else self.small

    def for_new(self, p: torch.Tensor, group: dict[str, Any]) -> Any:
        return self.quantized if p.numel() >= int(group[self.size_key]) else self.small

    def check_saved(self, p: torch.Tensor, st: Mapping[str, Any], name: str) -> None:
        self.of_state(st).check_saved(p, st, name)


class EightBit(_LowBit):
    """The 8-bit classes' policy: :class:`Blockwise8bit` from ``min_8bit_size`` elements up."""

    size_key = "min_8bit_size"

    def __init__(self) -> None:
        super().__init__(Blockwise8bit())
        self.q8 = self.quantized


class _From8bit:
    """An 8-bit entry of a state dict loaded by a 4-bit class: checked as :class:`Blockwise8bit`
    checks it, re-taken as the fp32 moments its codes stand for (which the class then quantizes
    to 4-bit codes, as it does a ``torch.optim.AdamW`` checkpoint's). Never a live state's format."""

    plain = False
    names = Blockwise8bit.names

    def __init__(self) -> None:
        self.q8 = Blockwise8bit()

    def check_saved(self, p: torch.Tensor, st: Mapping[str, Any], name: str) -> None:
        self.q8.check_saved(p, st, name)

    def retake(self, opt: Any, p: torch.Tensor, saved: Mapping[str, Any], st: dict[str, Any]) -> None:
        m, v = self.q8.moments(saved, p)
        for key in self.names:
            st.pop(key, None)
        st["exp_avg"], st["exp_avg_sq"] = m.to(p.device), v.to(p.device)

    def fits(self, p: torch.Tensor, states: list, on_cpu: bool, st: Mapping[str, Any]) -> bool:
        return False

    def check(self, opt: Any, p: torch.Tensor, st: Mapping[str, Any], name: str) -> None:
        raise ValueError(f"{validate.describe(p, name)}: the optimizer state holds 8-bit codes "
                         f"({', '.join(self.names)}); {type(opt).__name__} keeps 4-bit ones. Load an 8-bit "
                         f"state dict with load_state_dict, which converts it")


class FourBit(_LowBit):
    """The 4-bit classes' policy: :class:`Blockwise4bit` from ``min_4bit_size`` elements up; a
    state dict's 8-bit entries load converted (:class:`_From8bit`)."""

    size_key = "min_4bit_size"

    def __init__(self) -> None:
        super().__init__(Blockwise4bit())
        self.q4 = self.quantized
        self.from8 = _From8bit()

    def of_state(self, st: Mapping[str, Any]) -> Any:
        if self.q4.names[0] in st:
            return self.q4
        return self.from8 if Blockwise8bit.names[0] in st else self.small
