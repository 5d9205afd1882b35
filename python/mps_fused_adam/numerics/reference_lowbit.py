"""The low-bit rules' contract (``lowbit.py``) in plain torch, one tensor at a time.

Independent reference for the kernels and the tests; also the torch tier of the 8-bit rule on
devices we ship no kernel for. Every operation is a separate fp32 torch op, in the kernels' order;
divisions and the square root use full tensors and a float64 sqrt (see ``reference.py`` for why).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import lowbit, lowbit4
from .lowbit import BLOCK
from .lowbit4 import BLOCK4
from .reference import adam_elements, reference_adam_


# ---- block-wise storage, generic over the map and the block size -----------------------------

def _blocks(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``x`` flattened and zero-padded to whole blocks, as (blocks, block)."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def dequantize_with(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 values ``qmap[code] * absmax`` of the code's block, flat (one code per element)."""
    n = codes.numel()
    return (_blocks(qmap[codes.reshape(-1).long()], block) * absmax.view(-1, 1)).reshape(-1)[:n]


def block_absmax(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``max |x|`` per block (NaN if the block holds a NaN), fp32, one per block."""
    return _blocks(x.abs(), block).amax(dim=1)


def quantize_with(x: torch.Tensor, absmax: torch.Tensor, mids: torch.Tensor, block: int,
                  positive_floor: int = 0) -> torch.Tensor:
    """int64 codes of ``x`` (fp32, flat) in blocks with scales ``absmax``: ``xn = x * inv`` with
    ``inv = 1 / absmax`` (0 for a zero scale), code = the number of ``mids`` strictly below ``xn``
    (the nearest code, ties to the lower code), NaN to code 0; a positive ``xn`` gets at least
    ``positive_floor`` (the 8-bit unsigned map's zero code is 0: floor 1)."""
    inv = torch.where(absmax == 0, torch.zeros_like(absmax), torch.ones_like(absmax) / absmax)
    xn = (_blocks(x, block) * inv.view(-1, 1)).reshape(-1)[: x.numel()]
    codes = torch.searchsorted(mids, xn.contiguous(), right=False)  # number of midpoints < xn
    codes = torch.where(torch.isnan(xn), torch.zeros_like(codes), codes)
    if positive_floor:
        codes = torch.where((codes < positive_floor) & (xn > 0), torch.full_like(codes, positive_floor), codes)
    return codes


# ---- 8-bit: one code byte per element, codes of the param's shape -----------------------------

def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values ``map[code] * absmax`` of the code's block (shape of ``codes``)."""
    return dequantize_with(codes, absmax, lowbit.dynamic_map(signed, codes.device), BLOCK).view(codes.shape)


def quantize(x: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 codes of ``x`` (fp32) in blocks with scales ``absmax``: the contract's nearest code,
    ties to the lower code, NaN to code 0, a positive second moment never to the zero code."""
    codes = quantize_with(x, absmax, lowbit.code_midpoints(signed, x.device), BLOCK,
                          0 if signed else lowbit.UNSIGNED_ZERO_CODE + 1)
    return codes.to(torch.uint8).view(x.shape)


# ---- 4-bit: two codes a byte (lowbit4.pack_codes4), 1-D, blocks of lowbit4.BLOCK4 ------------

def dequantize4(packed: torch.Tensor, absmax: torch.Tensor, signed: bool, numel: int) -> torch.Tensor:
    """The ``numel`` fp32 values (flat) of a 4-bit moment: unpack, then ``map4[code] * absmax``."""
    codes = lowbit4.unpack_codes4(packed, numel)
    return dequantize_with(codes, absmax, lowbit4.map4(signed, packed.device), BLOCK4)


def quantize4(x: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """The packed code bytes of ``x`` (fp32) under block scales ``absmax`` (blocks of ``BLOCK4``):
    nearest code, ties to the lower code, NaN to code 0 (no floor: the unsigned map has no zero)."""
    return lowbit4.pack_codes4(quantize_with(x, absmax, lowbit4.midpoints4(signed, x.device), BLOCK4))


def store_param_(param: torch.Tensor, p32: torch.Tensor, sr_key: Optional[int]) -> None:
    """Write the new fp32 parameter into ``param``: stochastic rounding for bf16 params when
    ``sr_key`` is given, else round to nearest even (``copy_``)."""
    if sr_key is not None and param.dtype == torch.bfloat16:
        param.copy_(lowbit.stochastic_round_bf16(p32, sr_key).view(param.shape))
    else:
        param.copy_(p32)


def _via_cpu(fn, *tensors_then_rest):
    """Run ``fn`` on CPU copies of the leading tensors and write them back: for devices without
    float64 (MPS), which the reference's correctly rounded sqrt needs."""
    n = sum(isinstance(t, torch.Tensor) for t in tensors_then_rest)
    tensors, rest = tensors_then_rest[:n], tensors_then_rest[n:]
    copies = [t.detach().cpu().clone() for t in tensors]
    fn(*copies, *rest)
    with torch.no_grad():
        for t, c in zip(tensors, copies):
            t.copy_(c.to(t.device))


def _needs_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "mps"


@torch.no_grad()
def reference_adam8bit_(param: torch.Tensor, grad: torch.Tensor, exp_avg_codes: torch.Tensor,
                        exp_avg_absmax: torch.Tensor, exp_avg_sq_codes: torch.Tensor,
                        exp_avg_sq_absmax: torch.Tensor, hp, sr_key: Optional[int] = None) -> None:
    """One 8-bit Adam step in place (``hp``: :class:`~.contract.AdamHyper`): dequantize, Adam v2
    with the clamp, new block scales, re-quantize; the param stored in its dtype (stochastically
    for bf16 with ``sr_key``). On MPS the same ops run on CPU copies (no float64 there)."""
    if _needs_cpu(param):
        return _via_cpu(reference_adam8bit_, param, grad, exp_avg_codes, exp_avg_absmax, exp_avg_sq_codes,
                        exp_avg_sq_absmax, hp, sr_key)
    m = dequantize(exp_avg_codes, exp_avg_absmax, signed=True)
    v = dequantize(exp_avg_sq_codes, exp_avg_sq_absmax, signed=False)
    m, v = _lowbit_adam_(param, grad, m, v, hp, sr_key, BLOCK, (exp_avg_absmax, exp_avg_sq_absmax))
    exp_avg_codes.copy_(quantize(m, exp_avg_absmax, signed=True))
    exp_avg_sq_codes.copy_(quantize(v, exp_avg_sq_absmax, signed=False))


def _lowbit_adam_(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hp,
                  sr_key: Optional[int], block: int, absmax: tuple[torch.Tensor, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step both low-bit rules share, on dequantized moments (fp32, the param's element
    order): Adam v2 with the 8-bit rule's clamp, the new block scales written to ``absmax``, the
    param stored; returns the new moments for the caller's quantizer."""
    s = lowbit.adam8bit_scalars(hp)
    shape = param.shape
    p, m, v = adam_elements(param.detach().float().reshape(-1), grad.detach().float().reshape(-1),
                            m.reshape(-1), v.reshape(-1), s, clip=s.clip)
    absmax[0].copy_(block_absmax(m, block))
    absmax[1].copy_(block_absmax(v, block))
    store_param_(param, p.view(shape), sr_key)
    return m.view(shape), v.view(shape)


@torch.no_grad()
def reference_adam4bit_(param: torch.Tensor, grad: torch.Tensor, exp_avg_codes: torch.Tensor,
                        exp_avg_absmax: torch.Tensor, exp_avg_sq_codes: torch.Tensor,
                        exp_avg_sq_absmax: torch.Tensor, hp, sr_key: Optional[int] = None) -> None:
    """One 4-bit Adam step in place (``lowbit4.py``'s contract; ``hp``: :class:`~.contract.AdamHyper`):
    the 8-bit rule (:func:`reference_adam8bit_`) with the 4-bit maps, blocks of 128 and packed
    codes (``ceil(n / 2)`` bytes per moment). On MPS the same ops run on CPU copies."""
    if _needs_cpu(param):
        return _via_cpu(reference_adam4bit_, param, grad, exp_avg_codes, exp_avg_absmax, exp_avg_sq_codes,
                        exp_avg_sq_absmax, hp, sr_key)
    n = param.numel()
    m = dequantize4(exp_avg_codes, exp_avg_absmax, True, n)
    v = dequantize4(exp_avg_sq_codes, exp_avg_sq_absmax, False, n)
    m, v = _lowbit_adam_(param, grad, m, v, hp, sr_key, BLOCK4, (exp_avg_absmax, exp_avg_sq_absmax))
    exp_avg_codes.copy_(quantize4(m.reshape(-1), exp_avg_absmax, True))
    exp_avg_sq_codes.copy_(quantize4(v.reshape(-1), exp_avg_sq_absmax, False))
    exp_avg_sq_absmax.copy_(lowbit4.stored_scale2(exp_avg_sq_absmax))


@torch.no_grad()
def reference_adam_sr_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                       exp_avg_sq: torch.Tensor, hp, sr_key: Optional[int]) -> None:
    """One Adam v2 step (``reference.reference_adam_``, states rounded to their dtype) whose new
    parameter, kept in fp32, is stored by stochastic rounding with ``sr_key`` for bf16 params
    (round to nearest even for other dtypes or without a key). On MPS the same ops run on CPU
    copies (no float64 there)."""
    if _needs_cpu(param):
        return _via_cpu(reference_adam_sr_, param, grad, exp_avg, exp_avg_sq, hp, sr_key)
    p32 = param.detach().float().clone()
    reference_adam_(p32, grad, exp_avg, exp_avg_sq, hp)
    store_param_(param, p32, sr_key)
