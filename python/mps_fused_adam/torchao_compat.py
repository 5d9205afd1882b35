"""State dicts of ``torchao.optim.AdamW4bit``/``Adam4bit`` to ours (``AdamW4bit``/``Adam4bit``).

Both keep Li et al.'s 4-bit Adam states with the same maps, the same block size and the same
packing (``numerics/lowbit4.py``), so codes and scales are copied, not re-quantized. torchao's
layout has stayed the same from its first 4-bit optimizer (``prototype.low_bit_optim``, 2024)
through torchao 0.18 and its main branch (checked in its history of ``subclass_4bit.py``):

=================================================  ==========================================
torchao (``OptimState4bit`` moments)               mps_fused_adam ``AdamW4bit``/``Adam4bit``
=================================================  ==========================================
``step`` (0-dim float tensor)                      ``step`` (int)
``exp_avg.codes`` uint8[n / 2], high nibble first  ``exp_avg_codes4``
``exp_avg.scale`` fp32[n / block_size]             ``exp_avg_absmax4``
``exp_avg_sq.codes``, ``exp_avg_sq.scale``         ``exp_avg_sq_codes4``, ``exp_avg_sq_absmax4``
``.qmap`` fp32[16], ``.signed``                    (constants: ``lowbit4.map4``; checked)
the moment's ``.shape`` (the param's)              ``param_shape4``
plain ``exp_avg``/``exp_avg_sq`` (small tensors)   ``exp_avg``/``exp_avg_sq`` fp32
=================================================  ==========================================

torchao quantizes only tensors of at least 4096 elements whose count is a multiple of its block
size; the others keep plain moments, which our ``load_state_dict`` quantizes where the param has at
least ``min_4bit_size`` elements. torchao clips a block's scale to at least 1e-12 (a zero block
reads as ``map[code] * 1e-12``); the scales are copied as they are. Refused, naming why: a block
size other than 128, a map other than ours (another torchao quantization), torchao's 8-bit or FP8
states, ``amsgrad`` (a third moment we do not keep), sharded (DTensor) states.

A torchao state dict does not say whether ``AdamW4bit`` (decoupled weight decay) or ``Adam4bit``
(L2) saved it: ``adamw`` says which (default: AdamW).
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch

from .numerics import lowbit4

_GROUP_KEYS = ("betas", "eps", "weight_decay", "params")


def _as_int_step(step: Any) -> int:
    value = float(step)
    if not value.is_integer() or value < 0:
        raise ValueError(f"step {step!r} is not a non-negative whole number")
    return int(value)


def _quantized(key: Any, name: str, t: Any, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of one torchao ``OptimState4bit`` moment, checked against our layout."""
    where = f"state of parameter {key!r}: {name}"
    codes, scale, qmap = t.codes, t.scale, t.qmap
    if not (isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8 and codes.dim() == 1):
        raise ValueError(f"{where}: codes must be a 1-D uint8 tensor, got {codes!r:.80}")
    if not (isinstance(scale, torch.Tensor) and scale.dim() == 1 and scale.numel() > 0):
        raise ValueError(f"{where}: scale must be a 1-D tensor with one value per block")
    numel = math.prod(tuple(getattr(t, "_shape", None) or t.shape))
    if codes.numel() * 2 != numel:
        raise ValueError(f"{where}: {codes.numel()} code bytes for {numel} elements; torchao packs two codes a "
                         f"byte (expected {numel // 2})")
    block = codes.numel() * 2 // scale.numel()
    if block != lowbit4.BLOCK4 or scale.numel() * block != numel:
        raise ValueError(f"{where}: block size {codes.numel() * 2 / scale.numel():g} ({scale.numel()} scales for "
                         f"{numel} elements); only torchao's default block size {lowbit4.BLOCK4} converts (our "
                         f"kernels quantize in blocks of {lowbit4.BLOCK4})")
    if bool(getattr(t, "signed", signed)) != signed:
        raise ValueError(f"{where}: signed={not signed}, expected signed={signed} for this moment")
    want = lowbit4.map4(signed)
    got = qmap.detach().cpu().float().contiguous() if isinstance(qmap, torch.Tensor) else None
    if got is None or got.shape != want.shape or not torch.equal(got.view(torch.int32), want.view(torch.int32)):
        what = "create_dynamic_map(True, 3, 4)" if signed else "linspace(0, 1, 17)[1:]"
        raise ValueError(f"{where}: qmap is not torchao's 4-bit {'signed' if signed else 'unsigned'} map ({what}); "
                         f"only that map converts")
    return codes.detach().clone(), scale.detach().float().clone()


def _kind(t: Any) -> str:
    return type(t).__name__


def from_torchao(state_dict: dict[str, Any], *, adamw: bool = True) -> dict[str, Any]:
    """A state dict for our ``AdamW4bit``/``Adam4bit`` from one of ``torchao.optim.AdamW4bit``/
    ``Adam4bit`` (``adamw``: which of the two saved it). Tensors are copied; the input is not
    modified. Raises ValueError naming the parameter and the reason for a layout that does not
    convert (module docstring)."""
    state: dict[Any, dict[str, Any]] = {}
    for key, st in state_dict["state"].items():
        if "max_exp_avg_sq" in st:
            raise ValueError(f"state of parameter {key!r}: max_exp_avg_sq (amsgrad=True) has no counterpart; "
                             f"AdamW4bit implements Adam without amsgrad")
        out: dict[str, Any] = {"step": _as_int_step(st["step"])}
        m, v = st["exp_avg"], st["exp_avg_sq"]
        for name, t in (("exp_avg", m), ("exp_avg_sq", v)):
            if _kind(t) == "DTensor":
                raise ValueError(f"state of parameter {key!r}: {name} is a DTensor (FSDP2-sharded torchao state); "
                                 f"AdamW4bit does not step DTensor params. Gather the full state first "
                                 f"(DTensor.full_tensor()) on one rank")
            if _kind(t) in ("OptimState8bit", "OptimStateFp8"):
                raise ValueError(f"state of parameter {key!r}: {name} is torchao's {_kind(t)} (its 8-bit or FP8 "
                                 f"optimizer); only its 4-bit states (OptimState4bit) convert")
        quantized = [hasattr(t, "codes") for t in (m, v)]
        if all(quantized):
            c1, a1 = _quantized(key, "exp_avg", m, True)
            c2, a2 = _quantized(key, "exp_avg_sq", v, False)
            if c1.numel() != c2.numel():
                raise ValueError(f"state of parameter {key!r}: exp_avg and exp_avg_sq have different sizes")
            out.update(exp_avg_codes4=c1, exp_avg_absmax4=a1, exp_avg_sq_codes4=c2, exp_avg_sq_absmax4=a2,
                       param_shape4=lowbit4.shape_tensor(getattr(m, "_shape", None) or m.shape))
        elif not any(quantized) and all(isinstance(t, torch.Tensor) for t in (m, v)):
            out["exp_avg"] = m.detach().float().clone()
            out["exp_avg_sq"] = v.detach().float().clone()
        else:
            raise ValueError(f"state of parameter {key!r}: exp_avg is {_kind(m)} and exp_avg_sq {_kind(v)}; "
                             f"expected both OptimState4bit or both plain tensors")
        state[key] = out
    groups = []
    for g in state_dict["param_groups"]:
        if g.get("amsgrad"):
            raise ValueError("a param group has amsgrad=True, which AdamW4bit/Adam4bit do not implement")
        ng = {k: copy.deepcopy(g[k]) for k in _GROUP_KEYS if k in g}
        lr = g["lr"]
        ng["lr"] = float(lr) if isinstance(lr, torch.Tensor) else lr  # torchao keeps lr as a 0-dim tensor
        ng["adam_w_mode"] = bool(adamw)
        groups.append(ng)
    return {"state": state, "param_groups": groups}
