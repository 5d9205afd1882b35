"""State dicts of ``bitsandbytes.optim.AdamW8bit``/``Adam8bit`` (0.50) to ours and back.

The mapping, per parameter (both use the same maps, block size and code indices, so codes and
scales are copied, not re-quantized):

=============================================  ==============================================
bitsandbytes                                   mps_fused_adam ``AdamW8bit``/``Adam8bit``
=============================================  ==============================================
``step`` (int)                                 ``step``
``state1`` uint8, ``absmax1`` fp32[blocks]     ``exp_avg_codes``, ``exp_avg_absmax``
``state2`` uint8, ``absmax2`` fp32[blocks]     ``exp_avg_sq_codes``, ``exp_avg_sq_absmax``
``qmap1``, ``qmap2`` fp32[256]                 (constants: ``lowbit.dynamic_map``; checked)
``state1``/``state2`` fp32 (small tensors)     ``exp_avg``/``exp_avg_sq`` fp32
=============================================  ==============================================

bitsandbytes 0.50's ``state_dict()`` nests these tensors under the key
``"__bnb_optimizer_quant_state__"`` of each parameter's state (for FSDP); both forms are read,
and :func:`to_bitsandbytes` writes the nested form, which its ``load_state_dict`` unwraps.
Param groups keep ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``params``. bitsandbytes'
8-bit Adam applies weight decay decoupled in both its classes, so a converted group says
``adam_w_mode=True``.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from .numerics import lowbit

BNB_WRAP_KEY = "__bnb_optimizer_quant_state__"
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "params")


def _unwrap(st: dict[str, Any]) -> dict[str, Any]:
    st = dict(st)
    st.update(st.pop(BNB_WRAP_KEY, {}))
    return st


def from_bitsandbytes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict for our ``AdamW8bit``/``Adam8bit`` from one of bitsandbytes' 8-bit Adam
    (tensors are copied; the input is not modified)."""
    maps = {"qmap1": lowbit.dynamic_map(True), "qmap2": lowbit.dynamic_map(False)}
    state: dict[Any, dict[str, Any]] = {}
    for key, raw in state_dict["state"].items():
        st = _unwrap(raw)
        out: dict[str, Any] = {"step": int(st["step"])}
        s1, s2 = st["state1"], st["state2"]
        if s1.dtype == torch.uint8:
            for name, want in maps.items():
                got = st.get(name)
                if got is None or not torch.equal(got.detach().cpu().float().view(torch.int32), want.view(torch.int32)):
                    raise ValueError(f"state of parameter {key!r}: {name} is not bitsandbytes' dynamic map "
                                     f"(create_dynamic_map(signed={name == 'qmap1'})); only that map converts")
            out["exp_avg_codes"] = s1.clone()
            out["exp_avg_absmax"] = st["absmax1"].float().clone()
            out["exp_avg_sq_codes"] = s2.clone()
            out["exp_avg_sq_absmax"] = st["absmax2"].float().clone()
        else:
            out["exp_avg"] = s1.float().clone()
            out["exp_avg_sq"] = s2.float().clone()
        state[key] = out
    groups = []
    for g in state_dict["param_groups"]:
        ng = {k: copy.deepcopy(g[k]) for k in _GROUP_KEYS if k in g}
        ng["adam_w_mode"] = True
        groups.append(ng)
    return {"state": state, "param_groups": groups}


def to_bitsandbytes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict for ``bitsandbytes.optim.AdamW8bit`` from one of our ``AdamW8bit``/``Adam8bit``.
    bf16 stochastic-rounding seeds have no bitsandbytes counterpart and are dropped."""
    state: dict[Any, dict[str, Any]] = {}
    for key, st in state_dict["state"].items():
        quant: dict[str, Any]
        if "exp_avg_codes" in st:
            dev = st["exp_avg_codes"].device
            quant = {"state1": st["exp_avg_codes"].clone(), "qmap1": lowbit.dynamic_map(True, dev).clone(),
                     "state2": st["exp_avg_sq_codes"].clone(), "qmap2": lowbit.dynamic_map(False, dev).clone(),
                     "absmax1": st["exp_avg_absmax"].clone(), "absmax2": st["exp_avg_sq_absmax"].clone()}
        else:
            quant = {"state1": st["exp_avg"].float().clone(), "state2": st["exp_avg_sq"].float().clone()}
        state[key] = {"step": int(st["step"]), BNB_WRAP_KEY: quant}
    groups = []
    for g in state_dict["param_groups"]:
        ng = {k: copy.deepcopy(g[k]) for k in _GROUP_KEYS if k in g}
        ng.update(alpha=0.0, t_alpha=None, t_beta3=None)  # bitsandbytes' own group keys
        groups.append(ng)
    return {"state": state, "param_groups": groups}
