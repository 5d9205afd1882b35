"""The low-bit rules' contract (``lowbit.py``) in plain torch, one tensor at a time.

Independent reference for the kernels and the tests; also the torch tier of the 8-bit rule on
devices we ship no kernel for. Every operation is a separate fp32 torch op, in the kernels' order;
divisions and the square root use full tensors and a float64 sqrt (see ``reference.py`` for why).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import lowbit
from .lowbit import BLOCK
from .reference import adam_elements, reference_adam_


# ---- block-wise 8-bit storage -----------------------------------------------------------------

def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened and zero-padded to whole blocks, as (blocks, BLOCK)."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values ``map[code] * absmax`` of the code's block (shape of ``codes``)."""
    qmap = lowbit.dynamic_map(signed, codes.device)
    vals = _blocks(qmap[codes.reshape(-1).long()])
    return (vals * absmax.view(-1, 1)).reshape(-1)[: codes.numel()].view(codes.shape)


def block_absmax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` per block (NaN if the block holds a NaN), fp32, one per block."""
    return _blocks(x.abs()).amax(dim=1)


def quantize(x: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 codes of ``x`` (fp32) in blocks with scales ``absmax``: the contract's nearest code,
    ties to the lower code, NaN to code 0, a positive second moment never to the zero code."""
    inv = torch.where(absmax == 0, torch.zeros_like(absmax), torch.ones_like(absmax) / absmax)
    xn = (_blocks(x) * inv.view(-1, 1)).reshape(-1)[: x.numel()]
    mids = lowbit.code_midpoints(signed, x.device)
    codes = torch.searchsorted(mids, xn.contiguous(), right=False)  # number of midpoints < xn
    codes = torch.where(torch.isnan(xn), torch.zeros_like(codes), codes)
    if not signed:
        codes = torch.where((codes == 0) & (xn > 0), torch.ones_like(codes), codes)
    return codes.to(torch.uint8).view(x.shape)


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
    s = lowbit.adam8bit_scalars(hp)
    m = dequantize(exp_avg_codes, exp_avg_absmax, signed=True)
    v = dequantize(exp_avg_sq_codes, exp_avg_sq_absmax, signed=False)
    p, m, v = adam_elements(param.detach().float(), grad.detach().float(), m, v, s, clip=s.clip)
    a1, a2 = block_absmax(m), block_absmax(v)
    exp_avg_codes.copy_(quantize(m, a1, signed=True))
    exp_avg_sq_codes.copy_(quantize(v, a2, signed=False))
    exp_avg_absmax.copy_(a1)
    exp_avg_sq_absmax.copy_(a2)
    store_param_(param, p, sr_key)


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
