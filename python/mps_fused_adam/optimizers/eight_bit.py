"""``AdamW8bit`` and ``Adam8bit``: Adam with both moments stored as 8-bit block-wise codes
(bitsandbytes' scheme, contract in ``lowbit.py``), optionally with bf16 stochastic rounding.

A step validates every tensor of every group first; only then is state created and any tensor
written, so a rejected step changes nothing.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Iterable, Optional

import torch

from . import dtensor, in_backward, sr_seeds, validate
from ..numerics import lowbit
from ..numerics.contract import AdamHyper
from ..numerics.lowbit import MIN_8BIT_SIZE, SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE, num_blocks
from ..backends import CPUBackend, get_backend, update_staged
from ..backends.versions import bump
from .fused import _optimizer_method, load_state_dict_with_hooks
from .step_entry import fast_step_entry
from ..numerics.reference_lowbit import reference_adam8bit_, reference_adam_sr_

_Params = Iterable[Any]

# State keys of a parameter with 8-bit moments, and of one below min_8bit_size (fp32 moments).
CODE_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")
FP32_KEYS = ("exp_avg", "exp_avg_sq")
SEED_KEY = "sr_seed"


def _check_state(p: torch.Tensor, st: dict, name: str, saved: bool = False) -> None:
    """Existing state must fit its parameter: 8-bit codes and block scales, or fp32 moments, and
    ``step`` a non-negative int; raise a ValueError naming the parameter and the entry otherwise.
    ``saved``: a state dict's entry before it is loaded (``load_state_dict`` then converts scales
    and moments to fp32 on the param's device, ``step`` to int), so only shapes and the codes'
    dtype must fit."""
    if "exp_avg_codes" in st:
        nb = num_blocks(p.numel())
        want = {"exp_avg_codes": (tuple(p.shape), torch.uint8), "exp_avg_sq_codes": (tuple(p.shape), torch.uint8),
                "exp_avg_absmax": ((nb,), torch.float32), "exp_avg_sq_absmax": ((nb,), torch.float32)}
    else:
        want = {k: (tuple(p.shape), torch.float32) for k in FP32_KEYS}
    for key, (shape, dtype) in want.items():
        t = st.get(key)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{validate.describe(p, name)}: optimizer state '{key}' is missing or not a tensor "
                             f"(found {type(t).__name__})")
        fits = (t.is_floating_point() if dtype == torch.float32 else t.dtype == dtype) if saved else \
            (t.dtype == dtype and t.device == p.device)
        if tuple(t.shape) != shape or not fits:
            raise ValueError(f"{validate.describe(p, name)}: optimizer state '{key}' is {validate.describe(t, key)}; "
                             f"expected shape {shape}, {str(dtype).replace('torch.', '')}"
                             + ("" if saved else f", {p.device}"))
    if not saved:
        validate.check_step(p, st, name)


# What a state dict this optimizer loads must have: Adam's group hyperparameters (its states are
# checked per parameter by _check_state, 8-bit or fp32).
_STATE_DICT = validate.StateDictKind("Adam-family", ("betas", "eps"), ("lr_decay",), ())


def _check_group_options(group: dict[str, Any], where: str) -> None:
    size = group.get("min_8bit_size")
    if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{where}: min_8bit_size must be a positive element count (an int), got {size!r}")


class _Adam8bitBase(torch.optim.Optimizer):
    """Shared step of the 8-bit optimizers. Group keys: lr, betas, eps, weight_decay, adam_w_mode,
    bias_correction, maximize, min_8bit_size, bf16_stochastic_round. ``step_in_backward=True``:
    each param stepped from its post-accumulate-grad hook by ``_step_one`` (in_backward.py)."""

    def __init__(self, params: _Params, defaults: dict[str, Any], step_in_backward: bool = False) -> None:
        validate.check_hyperparameters(defaults["lr"], defaults["betas"], defaults["eps"], defaults["weight_decay"])
        _check_group_options(defaults, type(self).__name__)
        in_backward.setup(self, step_in_backward)  # before torch's __init__ adds (and so hooks) the groups
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group`` (also used by the constructor), then the checks a step would
        make of the new group's options and parameter dtypes: a rejected group is removed again,
        so the optimizer is unchanged."""
        _optimizer_method("add_param_group")(self, param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        try:
            _check_group_options(group, f"param_groups[{gi}]")
            validate.check_group_param_dtypes(group, gi)
            in_backward.group_added(self, gi)
        except Exception:
            self.param_groups.pop()
            raise

    def zero_grad(self, set_to_none: bool = True) -> None:
        _optimizer_method("zero_grad")(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return _optimizer_method("state_dict")(self)

    def __getstate__(self) -> dict[str, Any]:
        return in_backward.getstate(self, super().__getstate__())

    def __setstate__(self, state: dict[str, Any]) -> None:
        hooked = in_backward.take_state(state)
        super().__setstate__(state)
        for group in self.param_groups:  # state dicts of other optimizers lack our group keys
            for key, value in self.defaults.items():
                # 'differentiable' is no key of ours: torch's __setstate__ adds it to the defaults
                # only, and a group gaining it would make a round trip change the state dict.
                if key != "differentiable":
                    group.setdefault(key, value)
        in_backward.restore(self, hooked)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of ours (``bnb_compat.from_bitsandbytes`` converts bitsandbytes').

        torch casts floating state tensors to the parameter's dtype; the block scales and fp32
        moments are re-taken from the saved tensors as fp32, ``step`` and ``sr_seed`` as ints.
        torch's load pre- and post-hooks run as torch runs them.
        """
        load_state_dict_with_hooks(self, state_dict, self._check_state_dict, self._retake_states)

    def _check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Before anything is loaded: an Adam-family state dict whose states fit the parameters."""
        validate.check_state_dict(state_dict, self.param_groups, _STATE_DICT,
                                  lambda p, st, name: _check_state(p, st, name, saved=True))

    def _retake_states(self, state_dict: dict[str, Any]) -> None:
        saved_state = state_dict["state"]
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for key, p in zip(saved_group["params"], group["params"]):
                saved = saved_state.get(key)
                if saved is None:
                    continue
                st = self.state[p]
                for name in CODE_KEYS + FP32_KEYS:
                    t = saved.get(name)
                    if isinstance(t, torch.Tensor):
                        dtype = torch.uint8 if name.endswith("_codes") else torch.float32
                        st[name] = t.to(device=p.device, dtype=dtype, copy=True)
                for name in ("step", SEED_KEY):
                    if name in saved:
                        st[name] = int(saved[name])

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        st: dict[str, Any] = {"step": 0}
        if p.numel() >= int(group["min_8bit_size"]):
            nb = num_blocks(p.numel())
            st["exp_avg_codes"] = torch.full_like(p, SIGNED_ZERO_CODE, dtype=torch.uint8,
                                                  memory_format=torch.contiguous_format)
            st["exp_avg_absmax"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
            st["exp_avg_sq_codes"] = torch.full_like(p, UNSIGNED_ZERO_CODE, dtype=torch.uint8,
                                                     memory_format=torch.contiguous_format)
            st["exp_avg_sq_absmax"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
        else:
            for key in FP32_KEYS:
                st[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if group["bf16_stochastic_round"] and p.dtype == torch.bfloat16:
            st[SEED_KEY] = sr_seeds.param_seed(self, p)  # the same whatever order params are stepped in
        return st

    @fast_step_entry
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        in_backward.refuse_closure(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_params((gi, group, enumerate(group["params"])) for gi, group in enumerate(self.param_groups))
        return loss

    def _step_one(self, gi: int, group: dict[str, Any], pi: int, p: torch.Tensor) -> None:
        """Step ``group["params"][pi]`` alone (``step_in_backward``'s hook, in_backward.py).

        The common case (a CPU param with state, everything contiguous and as the kernel expects:
        ``_plain_cpu_state``) goes straight to the kernel call the full path would make for it
        (``_cpu_adam8bit_many`` of this one param, or the backend's Adam kernel for moments below
        min_8bit_size); anything else, and every error, takes the full path, which raises naming
        the param. The full path's Python cost about 90 us a param on a 2-core EPYC, more than the
        kernel of a small tensor."""
        validate.check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                       where=f"param_groups[{gi}]")
        _check_group_options(group, f"param_groups[{gi}]")
        g = p.grad
        st = self.state.get(p)
        step = st.get("step") if st else None
        cpu_ext = _cpu_ext()
        sr = group["bf16_stochastic_round"] and p.dtype is torch.bfloat16
        kind = (_plain_cpu_state(p, g, st) if g is not None and st and type(step) is int and step >= 0
                and cpu_ext is not None else None)
        # Stochastic rounding: a bf16 param's state without its seed gets one in the full path, and
        # fp32 moments with a rounding key take _update's rounding kernel there.
        keyed = kind is not None and SEED_KEY in st and group["bf16_stochastic_round"]
        backend = get_backend(p.device) if kind is not None else None
        # 8-bit: the full path's CPU batch is for the _cpu extension's backend only (not a Metal
        # tier standing in for CPU tensors, as the emulated-MPS tests make it).
        if (kind == "8bit" and isinstance(backend, CPUBackend) and not (sr and SEED_KEY not in st)
                or kind == "fp32" and not sr and not keyed):
            st["step"] = step = step + 1
            beta1, beta2 = group["betas"]
            hp = AdamHyper(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                           weight_decay=float(group["weight_decay"]), step=step, adam_w_mode=bool(group["adam_w_mode"]),
                           bias_correction=bool(group["bias_correction"]), maximize=bool(group["maximize"]))
            key = lowbit.sr_key(st[SEED_KEY], step) if (SEED_KEY in st and group["bf16_stochastic_round"]) else None
            if kind == "8bit":
                _cpu_adam8bit_many([(p, st, hp, key)])
            else:  # contiguous: what update_staged hands the backend
                backend.update("adam", [p], [g], [[st["exp_avg"]], [st["exp_avg_sq"]]], hp)
            bump((p,))
            return
        self._step_params([(gi, group, [(pi, p)])])

    def _step_params(self, selected: Iterable[tuple[int, dict[str, Any], Iterable[tuple[int, torch.Tensor]]]]) -> None:
        """Step the ``(index, param)`` pairs of each ``(group index, group, pairs)`` of ``selected``."""
        work = []
        for gi, group, pairs in selected:
            validate.check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                           where=f"param_groups[{gi}]")
            _check_group_options(group, f"param_groups[{gi}]")
            names = group.get("param_names")
            dt_cls = dtensor.dtensor_type()
            for pi, p in pairs:
                if p.grad is None or p.numel() == 0:
                    continue
                name = names[pi] if names else f"param_groups[{gi}]['params'][{pi}]"
                st = self.state.get(p)
                if dt_cls is not None:
                    if isinstance(p, dt_cls):
                        # Blocks of 256 over each rank's shard would quantize other blocks than over
                        # the whole tensor, and the codes and scales are no DTensors to checkpoint.
                        raise ValueError(f"{name}: {type(self).__name__} does not step DTensor params (FSDP2, "
                                         f"tensor parallel); AdamW, Adam, Lion and Adagrad do")
                    # A DTensor grad or state of a plain param (a sharded state dict loaded into an
                    # unsharded model, say) has the param's global shape but no storage of that size:
                    # the kernel read past its local shard and crashed.
                    tensors = [(k, v) for k, v in (st or {}).items() if isinstance(v, torch.Tensor)]
                    dtensor.check_plain(p, p.grad, [v for _, v in tensors], name, [k for k, _ in tensors])
                validate.check_param(p, p.grad, name, None)
                if st:
                    _check_state(p, st, name)
                work.append((group, p))
        # Everything validated: create state, then update. Tensors that share a kernel call are
        # collected first: CPU tensors with 8-bit moments all go to one call, and fp32-moment
        # tensors of one group, step, device and dtype to one backend call.
        hypers: dict[tuple[int, int], AdamHyper] = {}
        q8: list = []
        small: dict[tuple, list] = {}
        backends: dict[torch.device, Any] = {}
        metal, cpu_ext = _metal_backends(), _cpu_ext()
        for group, p in work:
            st = self.state[p]
            if not st:
                st.update(self._init_state(p, group))
            elif group["bf16_stochastic_round"] and p.dtype == torch.bfloat16 and SEED_KEY not in st:
                # A state made without the option (a loaded or converted checkpoint, the option
                # switched on later, a param cast to bf16 since): its seed now, as Adam's SR does.
                st[SEED_KEY] = sr_seeds.param_seed(self, p)
            st["step"] = step = int(st["step"]) + 1
            hp = hypers.get((id(group), step))
            if hp is None:
                beta1, beta2 = group["betas"]
                hp = hypers[(id(group), step)] = AdamHyper(
                    lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), step=step, adam_w_mode=bool(group["adam_w_mode"]),
                    bias_correction=bool(group["bias_correction"]), maximize=bool(group["maximize"]))
            key = lowbit.sr_key(st[SEED_KEY], step) if (SEED_KEY in st and group["bf16_stochastic_round"]) else None
            backend = backends.get(p.device)
            if backend is None:
                backend = backends[p.device] = get_backend(p.device)
            if ("exp_avg_codes" in st and cpu_ext is not None and not isinstance(backend, metal)
                    and _cpu_batchable(p, st)):
                q8.append((p, st, hp, key))
            elif "exp_avg_codes" not in st and key is None:
                small.setdefault((p.device, id(hp), p.dtype), []).append((p, st, hp))
            else:
                _update(p, p.grad, st, hp, key)
        if q8:
            _cpu_adam8bit_many(q8)
        for members in small.values():
            ps = [m[0] for m in members]
            update_staged(backends[ps[0].device], "adam", ps, [p.grad for p in ps],
                          [[m[1]["exp_avg"] for m in members], [m[1]["exp_avg_sq"] for m in members]], members[0][2])
        bump([p for _, p in work])


_PARAM_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _update(p: torch.Tensor, g: torch.Tensor, st: dict[str, Any], hp: AdamHyper, sr_key: Optional[int]) -> None:
    """One tensor's update on its device's implementation of the rule: the Metal kernels on the
    Metal tiers (untested on Apple hardware), the ``_cpu`` extension's 8-bit kernel for CPU
    tensors, the plain-torch reference elsewhere (a correct, not fast, path). Moments below
    min_8bit_size use the backends' Adam kernel, with stochastic rounding when that option is on."""
    if "exp_avg_codes" in st:
        backend = get_backend(p.device)
        if isinstance(backend, _metal_backends()):
            _metal_adam8bit(backend, p, g, st, hp, sr_key)
        elif p.is_cpu and _cpu_ext() is not None:
            _cpu_adam8bit(p, g, st, hp, sr_key)
        else:
            reference_adam8bit_(p, g, st["exp_avg_codes"], st["exp_avg_absmax"], st["exp_avg_sq_codes"],
                                st["exp_avg_sq_absmax"], hp, sr_key)
    elif sr_key is not None:
        backend = get_backend(p.device)
        if isinstance(backend, CPUBackend) and p.is_contiguous() and g.is_contiguous():
            backend.update("adam", [p], [g], [[st["exp_avg"]], [st["exp_avg_sq"]]], hp, sr_keys=[sr_key])
        elif isinstance(backend, _metal_backends()):
            update_staged(backend, lowbit.ADAM_SR.name, [p], [g], [[st["exp_avg"]], [st["exp_avg_sq"]]],
                          lowbit.AdamSRHyper(hp, sr_key))
        else:
            reference_adam_sr_(p, g, st["exp_avg"], st["exp_avg_sq"], hp, sr_key)
    else:
        update_staged(get_backend(p.device), "adam", [p], [g], [[st["exp_avg"]], [st["exp_avg_sq"]]], hp)


def _metal_backends() -> tuple:
    from ..backends.mps import MetalExtBackend, ShaderLibraryBackend
    return (MetalExtBackend, ShaderLibraryBackend)


def _metal_adam8bit(backend: Any, p: torch.Tensor, g: torch.Tensor, st: dict[str, Any], hp: AdamHyper,
                    sr_key: Optional[int]) -> None:
    """The Metal kernel fused_adam8bit_*_uchar over one tensor (one dispatch: the key is per
    tensor), on contiguous copies of a non-contiguous param or grad."""
    pc, gc = p.contiguous(), g.contiguous()  # codes and scales are always contiguous (ours)
    tables = [[lowbit.kernel_table(True, p.device)], [lowbit.kernel_table(False, p.device)]]
    backend.update(lowbit.ADAM8BIT.name, [pc], [gc],
                   [[st["exp_avg_codes"]], [st["exp_avg_sq_codes"]], [st["exp_avg_absmax"]],
                    [st["exp_avg_sq_absmax"]], *tables],
                   lowbit.Adam8bitTensorHyper(hp, sr_key if p.dtype is torch.bfloat16 else None))
    if pc is not p:
        p.copy_(pc)


def _cpu_ext() -> Any:
    try:
        from .. import _cpu
    except ImportError:
        return None
    return _cpu if hasattr(_cpu, "adam8bit_step") else None


def _cpu_adam8bit(p: torch.Tensor, g: torch.Tensor, st: dict[str, Any], hp: AdamHyper, sr_key: Optional[int]) -> None:
    pc, gc = p.contiguous(), g.contiguous()  # codes and scales are always contiguous (ours)
    _cpu_ext().adam8bit_step(
        pc.data_ptr(), gc.data_ptr(), st["exp_avg_codes"].data_ptr(), st["exp_avg_absmax"].data_ptr(),
        st["exp_avg_sq_codes"].data_ptr(), st["exp_avg_sq_absmax"].data_ptr(), p.numel(), _PARAM_CODES[p.dtype],
        lowbit.kernel_table(True).data_ptr(), lowbit.kernel_table(False).data_ptr(), lowbit.pack_adam8bit(hp),
        0 if sr_key is None else sr_key, sr_key is not None, torch.get_num_threads())
    if pc is not p:
        p.copy_(pc)


def _cpu_batchable(p: torch.Tensor, st: dict[str, Any]) -> bool:
    """Whether an 8-bit tensor (whose device's backend is not a Metal tier, with the ``_cpu``
    extension built) can join the one-call CPU batch: a CPU tensor whose param, grad, codes and
    scales are all contiguous (others take ``_update``'s contiguous copies)."""
    return (p.is_cpu and p.is_contiguous() and p.grad.is_contiguous()
            and all(st[k].is_contiguous() for k in CODE_KEYS))


def _plain_cpu_state(p: torch.Tensor, g: torch.Tensor, st: dict[str, Any]) -> Optional[str]:
    """How the full path would step ``p`` (grad ``g``, non-empty state ``st``) when it passes every
    check of that path (``validate.check_param``, ``_check_state``, the DTensor checks) as plain,
    contiguous CPU tensors: ``"8bit"`` (its one-call CPU batch, ``_cpu_batchable``) or ``"fp32"``
    (moments below min_8bit_size: the backend's Adam kernel); None sends the param through the full
    path, which raises if it must."""
    plain_t = torch.Tensor
    if not (type(g) is plain_t and (type(p) is torch.nn.Parameter or type(p) is plain_t) and p.is_cpu
            and p.dtype in _PARAM_CODES and g.dtype is p.dtype and g.layout is torch.strided and g.is_cpu
            and g.shape == p.shape and not g._is_zerotensor() and p.is_contiguous() and g.is_contiguous()
            and p.numel() > 0):
        return None
    eight = "exp_avg_codes" in st
    nb = num_blocks(p.numel())
    for key in CODE_KEYS if eight else FP32_KEYS:
        t = st.get(key)
        if type(t) is not plain_t or not t.is_cpu or not t.is_contiguous():
            return None
        if key.endswith("_absmax"):
            if t.dtype is not torch.float32 or t.dim() != 1 or t.shape[0] != nb:
                return None
        elif t.dtype is not (torch.uint8 if eight else torch.float32) or t.shape != p.shape:
            return None
    return "8bit" if eight else "fp32"


def _cpu_adam8bit_many(batch: list) -> None:
    """One ``_cpu`` call for every (param, state, hyper, sr key) of ``batch``: their blocks are
    shared among the threads as one range."""
    packed: dict[int, bytes] = {}
    cols: list[list] = [[] for _ in range(11)]
    for p, st, hp, key in batch:
        blob = packed.get(id(hp))
        if blob is None:
            blob = packed[id(hp)] = lowbit.pack_adam8bit(hp)
        for col, value in zip(cols, (p.data_ptr(), p.grad.data_ptr(), st["exp_avg_codes"].data_ptr(),
                                     st["exp_avg_absmax"].data_ptr(), st["exp_avg_sq_codes"].data_ptr(),
                                     st["exp_avg_sq_absmax"].data_ptr(), p.numel(), _PARAM_CODES[p.dtype], blob,
                                     0 if key is None else key, int(key is not None))):
            col.append(value)
    _cpu_ext().adam8bit_step_many(*cols[:8], lowbit.kernel_table(True).data_ptr(),
                                  lowbit.kernel_table(False).data_ptr(), *cols[8:], torch.get_num_threads())


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


def _check_torch_options(cls: str, amsgrad: bool, capturable: bool, differentiable: bool) -> None:
    for option, value in (("amsgrad", amsgrad), ("capturable", capturable), ("differentiable", differentiable)):
        if value:
            raise ValueError(f"{cls} does not support {option}={value!r}")


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
        _check_torch_options(self._name, amsgrad, capturable, differentiable)
        _check_bnb_options(self._name, optim_bits, args, is_paged, percentile_clipping, block_wise)
        decoupled = self._decoupled_default if decoupled_weight_decay is None else bool(decoupled_weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=decoupled,
                                      bias_correction=True, maximize=maximize, min_8bit_size=int(min_8bit_size),
                                      bf16_stochastic_round=bool(bf16_stochastic_round)), step_in_backward)


class AdamW8bit(Adam8bit):
    """AdamW with 8-bit block-wise states: ``torch.optim.AdamW``'s arguments (decoupled weight
    decay, default 1e-2) plus those of :class:`Adam8bit`; the drop-in for
    ``bitsandbytes.optim.AdamW8bit``."""

    _name = "AdamW8bit"
    _decoupled_default = True

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


def state_bytes_per_param(opt: torch.optim.Optimizer) -> float:
    """Bytes of optimizer-state tensors per parameter element over every parameter with state."""
    total = elems = 0
    for p, st in opt.state.items():
        elems += p.numel()
        total += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
    return total / elems if elems else 0.0
