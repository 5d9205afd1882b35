"""The optimizer classes: ``FusedAdam`` (DeepSpeed's signature), ``Adam``/``AdamW`` (torch's) and
``CPUAdam`` (DeepSpeed's ``DeepSpeedCPUAdam``), all over one step function.

A step gathers every group's tensors, validates all of them, and only then creates missing state
and hands one call per (device, dtypes, step count) to the backend of that device.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Iterable, Optional

import torch

from . import validate
from .backends import SUPPORTED_DTYPES, get_backend, update_staged
from .contract import AdamHyper

_Params = Iterable[Any]


def _optimizer_method(name: str) -> Callable[..., Any]:
    """``torch.optim.Optimizer.<name>`` without its ``torch._disable_dynamo`` wrapper while
    ``torch._dynamo`` is not loaded: the wrapper's first call imports it, which takes about a
    second, the largest part of the time to a first step. Once torch.compile has loaded it, the
    wrapped method is used, so compiled code never traces into these."""
    fn = getattr(torch.optim.Optimizer, name)
    return fn if "torch._dynamo" in sys.modules else getattr(fn, "__wrapped__", fn)


_CPU = torch.device("cpu")


class _AdamBase(torch.optim.Optimizer):
    """Shared machinery. Group keys: lr, betas, eps, weight_decay, adam_w_mode, bias_correction, maximize."""

    # The update rule (contract.RULES) every step of this class runs.
    _rule = "adam"
    # A subclass restricted to one device type (CPUAdam) sets this.
    _device_type: Optional[str] = None

    def __init__(self, params: _Params, defaults: dict[str, Any]) -> None:
        validate.check_hyperparameters(defaults["lr"], defaults["betas"], defaults["eps"], defaults["weight_decay"])
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _optimizer_method("add_param_group")(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _optimizer_method("zero_grad")(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return _optimizer_method("state_dict")(self)

    # The dtype the moment estimates are kept in: a fixed one, or (None) the param's, as torch does.
    _fixed_state_dtype: Optional[torch.dtype] = None

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self._fixed_state_dtype or p.dtype

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A state dict from torch.optim lacks our group keys: take them from our defaults.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of ours or of ``torch.optim.Adam``/``AdamW``.

        torch casts loaded moments to the parameter's dtype; we re-take them from the saved
        tensors in this optimizer's state dtype (fp32 states of bf16 params stay exact), and keep
        ``step`` as a Python int.
        """
        _optimizer_method("load_state_dict")(self, state_dict)
        saved_state = state_dict["state"]
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for key, p in zip(saved_group["params"], group["params"]):
                saved = saved_state.get(key)
                if saved is None:
                    continue
                st = self.state[p]
                for name in ("exp_avg", "exp_avg_sq"):
                    if isinstance(saved.get(name), torch.Tensor):
                        st[name] = saved[name].to(device=p.device, dtype=self._state_dtype(p),
                                                  memory_format=torch.preserve_format, copy=True)
                if "step" in saved:
                    st["step"] = int(saved["step"])

    def _slots(self, gi: int, params: list) -> list:
        """Each group's states as a list aligned with its params, so a step looks states up by
        position instead of hashing 1,000 tensors (torch's Tensor.__hash__ runs in Python).
        Rebuilt when the group's param list, ``self.state`` or its size changes."""
        cache = self.__dict__.setdefault("_slot_cache", {})
        entry = cache.get(gi)
        state = self.state
        if (entry is None or entry[0] is not params or entry[1] != len(params) or entry[2] is not state
                or entry[3] != len(state)):
            slots = [state[p] if state.get(p) else None for p in params]
            entry = cache[gi] = (params, len(params), state, len(state), slots)
        return entry[4]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # One pass validates every tensor and sorts it into kernel calls; nothing is written
        # (no state created, no step counted) until the whole step is known good.
        plans = [self._plan_group(gi, group) for gi, group in enumerate(self.param_groups)]
        for group, fresh, buckets in plans:
            for p, pi, slots in fresh:
                st = slots[pi] = self.state[p]
                sd = self._state_dtype(p)
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(p, dtype=sd, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, dtype=sd, memory_format=torch.preserve_format)
                key = (p.device, p.dtype, sd, 0)
                bucket = buckets.get(key)
                if bucket is None:
                    bucket = buckets[key] = ([], [], [], [], [])
                bucket[0].append(p)
                bucket[1].append(p.grad)
                bucket[2].append(st["exp_avg"])
                bucket[3].append(st["exp_avg_sq"])
                bucket[4].append(st)
            beta1, beta2 = group["betas"]
            sr = group.get("bf16_stochastic_round", False)
            for (device, pdtype, _, last_step), (ps, gs, ms, vs, states) in buckets.items():
                step = int(last_step) + 1
                for st in states:
                    st["step"] = step
                hp = AdamHyper(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                               weight_decay=float(group["weight_decay"]), step=step,
                               adam_w_mode=bool(group["adam_w_mode"]), bias_correction=bool(group["bias_correction"]),
                               maximize=bool(group["maximize"]))
                if sr and pdtype is torch.bfloat16:
                    _stochastic_round_step(device, ps, gs, ms, vs, states, hp)
                else:
                    update_staged(get_backend(device), self._rule, ps, gs, [ms, vs], hp)
        return loss

    def _plan_group(self, gi: int, group: dict[str, Any]) -> tuple[dict[str, Any], list, dict]:
        """Validate one group; return it, its params that need new state, and its kernel calls
        keyed by (device, param dtype, state dtype, step count so far)."""
        validate.check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                       where=f"param_groups[{gi}]")
        params = group["params"]
        slots = self._slots(gi, params)
        supported, strided, only = SUPPORTED_DTYPES, torch.strided, self._device_type
        fresh: list = []
        buckets: dict[tuple, tuple[list, list, list, list, list]] = {}
        fixed_sd = self._fixed_state_dtype
        cpu = _CPU
        for pi, p in enumerate(params):
            g = p.grad
            if g is None:
                continue
            st = slots[pi]
            dt = p.dtype
            shape = p.shape
            on_cpu = p.is_cpu
            # The common case is this one expression per tensor; any failure (an AttributeError
            # included: a state entry that is not a tensor) re-runs the detailed checks, which
            # raise naming the parameter.
            try:
                ok = dt in supported and g.dtype is dt and g.layout is strided and g.shape == shape
                if st is None:
                    if p.numel() == 0:
                        continue
                    m = v = None
                    ok = ok and (g.is_cpu if on_cpu else g.device == p.device)
                else:
                    m, v = st.get("exp_avg"), st.get("exp_avg_sq")
                    sd = fixed_sd or dt
                    ok = (ok and m.dtype is sd and v.dtype is sd and m.shape == shape and v.shape == shape
                          and ((g.is_cpu and m.is_cpu and v.is_cpu) if on_cpu else
                               (g.device == p.device and m.device == p.device and v.device == p.device)))
                if ok and only is not None:
                    ok = p.device.type == only
            except AttributeError:
                ok = False
            if not ok:
                names = group.get("param_names")
                name = names[pi] if names else f"param_groups[{gi}]['params'][{pi}]"
                validate.check_param(p, g, name, only)
                if st is not None:
                    validate.check_state(p, st, name, self._state_dtype(p))
            if st is None:
                fresh.append((p, pi, slots))
                continue
            key = (cpu if on_cpu else p.device, dt, m.dtype, st.get("step", 0))
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = ([], [], [], [], [])
            bucket[0].append(p)
            bucket[1].append(g)
            bucket[2].append(m)
            bucket[3].append(v)
            bucket[4].append(st)
        return group, fresh, buckets


def _stochastic_round_step(device: torch.device, ps: list, gs: list, ms: list, vs: list, states: list,
                           hp: AdamHyper) -> None:
    """Adam with bf16 params stored by stochastic rounding (lowbit.py's contract): the CPU kernel
    for contiguous CPU tensors, else the plain-torch reference one tensor at a time (no Metal
    kernel for this option yet). Each param gets its own 64-bit seed in its state (``sr_seed``)
    on its first such step."""
    from . import lowbit
    from .backends import CPUBackend
    from .reference_lowbit import reference_adam_sr_
    for st in states:
        if "sr_seed" not in st:
            st["sr_seed"] = lowbit.new_sr_seed()
    keys = [lowbit.sr_key(int(st["sr_seed"]), hp.step) for st in states]
    backend = get_backend(device)
    if isinstance(backend, CPUBackend) and all(t.is_contiguous() for lst in (ps, gs, ms, vs) for t in lst):
        backend.update("adam", ps, gs, [ms, vs], hp, sr_keys=keys)
        return
    for p, g, m, v, key in zip(ps, gs, ms, vs, keys):
        reference_adam_sr_(p, g, m, v, hp, key)


def _reject(option: str, value: Any, cls: str) -> None:
    raise ValueError(f"{cls} does not support {option}={value!r}; mps_fused_adam implements plain Adam "
                     f"(use torch.optim.{cls} for {option})")


class Adam(_AdamBase):
    """Drop-in for ``torch.optim.Adam``: same arguments and defaults, L2 weight decay unless
    ``decoupled_weight_decay=True``. ``foreach`` and ``fused`` are accepted and ignored (this is
    always fused); ``amsgrad``, ``capturable`` and ``differentiable`` are rejected.

    ``bf16_stochastic_round=True``: bf16 parameters are stored from the fp32 update by stochastic
    rounding (unbiased; random bits from a hash of the param's ``sr_seed`` state, the step and the
    element index: reproducible under ``torch.manual_seed``); other dtypes are unaffected."""

    _name = "Adam"

    def __init__(self, params: _Params, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, *, foreach: Optional[bool] = None, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
                 decoupled_weight_decay: bool = False, bf16_stochastic_round: bool = False) -> None:
        self._check_unsupported(amsgrad, capturable, differentiable)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      adam_w_mode=decoupled_weight_decay, bias_correction=True,
                                      maximize=maximize, bf16_stochastic_round=bool(bf16_stochastic_round)))

    def _check_unsupported(self, amsgrad: bool, capturable: bool, differentiable: bool) -> None:
        for option, value in (("amsgrad", amsgrad), ("capturable", capturable), ("differentiable", differentiable)):
            if value:
                _reject(option, value, self._name)


class AdamW(Adam):
    """Drop-in for ``torch.optim.AdamW`` (decoupled weight decay, default 1e-2)."""

    _name = "AdamW"

    def __init__(self, params: _Params, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False, foreach: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
                 bf16_stochastic_round: bool = False) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         decoupled_weight_decay=True, bf16_stochastic_round=bf16_stochastic_round)


class FusedAdam(_AdamBase):
    """DeepSpeed's ``FusedAdam`` signature, on any device: Metal on MPS, the C++ kernel on CPU,
    torch's fused kernel or the fp32 foreach tier elsewhere. States are kept in the param dtype.
    ``bf16_stochastic_round=True`` as for :class:`Adam`."""

    def __init__(self, params: _Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 bf16_stochastic_round: bool = False) -> None:
        if amsgrad:
            raise ValueError("FusedAdam does not support the AMSGrad variant (amsgrad=True)")
        self.set_grad_none = set_grad_none
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      adam_w_mode=adam_w_mode, bias_correction=bias_correction, maximize=False,
                                      bf16_stochastic_round=bool(bf16_stochastic_round)))

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def step(self, closure: Optional[Callable[[], Any]] = None, grads: Any = None, output_params: Any = None,
             scale: Any = None, grad_norms: Any = None, grad_scaler: Any = None) -> Any:
        """One step. DeepSpeed's legacy arguments (``grads``, ``output_params``, ``scale``,
        ``grad_norms``, ``grad_scaler``) are rejected, as DeepSpeed's FusedAdam does."""
        if any(a is not None for a in (grads, output_params, scale, grad_norms, grad_scaler)):
            raise RuntimeError("FusedAdam has been updated; simply initialize it identically to torch.optim.Adam "
                               "and call step() with no arguments except an optional closure")
        return super().step(closure)


class CPUAdam(_AdamBase):
    """DeepSpeed's ``DeepSpeedCPUAdam`` signature on the prebuilt C++ kernel: CPU tensors only.

    With ``fp32_optimizer_states=True`` (default) the moments are fp32 whatever the param dtype;
    otherwise they are kept in the param dtype.
    """

    _device_type = "cpu"

    def __init__(self, model_params: _Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("CPUAdam does not support the AMSGrad variant (amsgrad=True)")
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                            adam_w_mode=adamw_mode, bias_correction=bias_correction, maximize=False))

    @property
    def _fixed_state_dtype(self) -> Optional[torch.dtype]:  # type: ignore[override]
        return torch.float32 if self.fp32_optimizer_states else None
