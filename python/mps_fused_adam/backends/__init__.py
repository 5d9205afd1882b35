"""Kernel backends: one small interface, chosen once per device type, reported by ``backend_info()``.

A backend updates lists of tensors that the optimizer has already validated, with one update
rule of ``contract.RULES``: ``update(rule, params, grads, states, hyper)``, where ``states`` holds
one list per state of the rule (Adam: ``[exp_avgs, exp_avg_sqs]``). Every list has the same
length; all tensors are on one device, contiguous and non-empty; params and grads share one
dtype, the states share one (possibly different) state dtype; all share one hyperparameter
object of the rule. A backend never fails on such input, so a step that passed validation
cannot leave tensors half-updated.

The storage forms of Adam (the rules of ``contract.RULES`` with a ``base``) are rules of the
same call, with ``sr_keys`` (one ``lowbit.sr_key`` per param: bf16 params stored by stochastic
rounding) and the base rule's ``AdamHyper``: ``"adam_sr"`` (Adam's states, bf16 params) and the
block-quantized ones (``Rule.blocks``; ``"adam8bit"``: states ``[exp_avg_codes, exp_avg_absmax,
exp_avg_sq_codes, exp_avg_sq_absmax]``, codes of the param's shape and one fp32 scale per
block; ``sr_keys`` optional; ``"adam4bit"``: the same four states in the same order, the codes
packed two a byte, 1-D, one scale per 128 elements). Every backend runs them from their registry entry alone (the
foreach tier through ``Rule.reference``). The Metal tiers' own per-tensor form of them
(``Rule.hyper``: ``AdamSRHyper``/``Adam8bitTensorHyper``, one key per call, the rule's Metal
buffers: ``mps.kernel_calls``) is taken too (:func:`lowbit_args`). Adam's ``sr_keys`` mode is
its ``sr_rule``.
"""
from __future__ import annotations

import math
import os
import threading
import warnings
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

import torch

from ..numerics.contract import RULES, AdagradHyper, AdamHyper, LionHyper, adagrad_scalars, adam_scalars, lion_scalars
from ..numerics.contract import resolve
from ..numerics.contract import rule as rule_spec
from .addressing import Addressed, addresses, numels  # noqa: F401  (re-exported: the backends' shared input)
from .kernel import Kernel, describe  # noqa: F401  (re-exported: the key of the Backend protocol)

TensorList = Sequence[torch.Tensor]


class Backend(Protocol):
    """The interface every backend implements (shared design of issues 33 and 34).

    - ``unavailable(kernel)``: None when this backend runs ``kernel``, else the reason it does not
      (a rule it has no form of, a dtype, a Metal pipeline that failed to build or to pass its
      probe). The optimizers ask this instead of testing a backend's class.
    - ``prepare(kernels)``: everything the kernels of one step need before the first of them is
      encoded (a Metal tier builds and probes each kernel's pipeline here, once), so that a step
      is all or nothing. After it, ``update`` of any of those kernels does not fail on validated
      input.
    - ``update(rule, params, grads, states, hp)``: as the module docstring says.
    """
    name: str

    def unavailable(self, kernel: Kernel) -> Optional[str]: ...

    def prepare(self, kernels: Iterable[Kernel]) -> None: ...

    def update(self, rule: str, params: TensorList, grads: TensorList, states: Sequence[TensorList],
               hp: Any, sr_keys: Optional[Sequence[int]] = None) -> None: ...


def lowbit_args(rule: str, states: Sequence[TensorList], hp: Any, sr_keys: Optional[Sequence[int]], n: int
                ) -> tuple[Sequence[TensorList], Any, Optional[Sequence[int]]]:
    """A storage form's call ``(states, base hyper, sr_keys)`` in the optimizers' form (module
    docstring), from either form: the Metal tiers' per-tensor one (``Rule.hyper``: one key in the
    hyper; a block-quantized rule's Metal buffers, ``Rule.states``) or the optimizers' own."""
    adam = getattr(hp, "adam", None)
    if adam is None:
        return states, hp, sr_keys
    blocks = RULES[rule].blocks
    if blocks is not None:
        order = RULES[rule].states
        states = [states[order.index(name)] for name in blocks.names]
    key = hp.sr_key
    return states, adam, None if key is None else [key] * n


def sr_rule(rule: str, sr_keys: Optional[Sequence[int]]) -> str:
    """The rule a call of ``rule`` runs: its ``sr_rule`` with ``sr_keys`` (Adam's keys: ``adam_sr``)."""
    if sr_keys is None:
        return rule
    sr = rule_spec(rule).sr_rule
    if sr is None:
        raise NotImplementedError(f"rule {rule!r} has no stochastic-rounding form (contract.RULES)")
    return sr


def _reference_each(rule: str, params: TensorList, grads: TensorList, states: Sequence[TensorList], hp: Any,
                    sr_keys: Optional[Sequence[int]] = None) -> None:
    """A storage form one tensor at a time through its ``Rule.reference`` (a correct, not a fast,
    path: the tier of devices without a kernel of ours)."""
    rule = sr_rule(rule, sr_keys)
    reference = resolve(rule_spec(rule).reference)
    states, hp, sr_keys = lowbit_args(rule, states, hp, sr_keys, len(params))
    keys = sr_keys if sr_keys is not None else [None] * len(params)
    for p, g, *st, key in zip(params, grads, *states, keys):
        reference(p, g, *st, hp, key)


def _foreach_adam(params: TensorList, grads: TensorList, states: Sequence[TensorList], hp: AdamHyper) -> None:
    """Adam (contract v2) in ``torch._foreach_*`` ops, each a separate fp32 op in the kernels' order."""
    s = adam_scalars(hp)
    exp_avgs, exp_avg_sqs = states
    p = [t.float() for t in params]
    g = [t.float() for t in grads]
    m = [t.float() for t in exp_avgs]
    v = [t.float() for t in exp_avg_sqs]
    if s.maximize:
        g = torch._foreach_neg(g)
    if not s.adam_w_mode:
        g = torch._foreach_add(g, torch._foreach_mul(p, s.weight_decay))
    m = torch._foreach_add(torch._foreach_mul(m, s.beta1), torch._foreach_mul(g, s.one_minus_beta1))
    v = torch._foreach_add(torch._foreach_mul(v, s.beta2), torch._foreach_mul(torch._foreach_mul(g, g), s.one_minus_beta2))
    # A float64 sqrt rounded once (torch's fp32 sqrt is not always correctly rounded) and a
    # division by full tensors (torch turns division by a scalar into a reciprocal multiply).
    denom = torch._foreach_add(torch._foreach_mul([t.double().sqrt_().float() for t in v], s.d2), s.eps)
    if s.adam_w_mode:
        p = torch._foreach_mul(p, s.decay)
    p = torch._foreach_sub(p, torch._foreach_mul(torch._foreach_div(m, denom), s.step_size))
    with torch.no_grad():
        torch._foreach_copy_(list(params), p)
        torch._foreach_copy_(list(exp_avgs), m)
        torch._foreach_copy_(list(exp_avg_sqs), v)


def _sign(c: torch.Tensor) -> torch.Tensor:
    """Lion's sign (contract.py): 1, -1, c - c (+0 for both zeros, NaN for NaN)."""
    one = torch.ones_like(c)
    return torch.where(c > 0, one, torch.where(c < 0, -one, c - c))


def _foreach_lion(params: TensorList, grads: TensorList, states: Sequence[TensorList], hp: LionHyper) -> None:
    """Lion (contract.py) in ``torch._foreach_*`` ops, each a separate fp32 op in the kernels' order."""
    s = lion_scalars(hp)
    (exp_avgs,) = states
    p = [t.float() for t in params]
    g = [t.float() for t in grads]
    m = [t.float() for t in exp_avgs]
    if s.maximize:
        g = torch._foreach_neg(g)
    c = torch._foreach_add(torch._foreach_mul(m, s.beta1), torch._foreach_mul(g, s.one_minus_beta1))
    p = torch._foreach_mul(p, s.decay)
    p = torch._foreach_sub(p, torch._foreach_mul([_sign(t) for t in c], s.lr))
    m = torch._foreach_add(torch._foreach_mul(m, s.beta2), torch._foreach_mul(g, s.one_minus_beta2))
    with torch.no_grad():
        torch._foreach_copy_(list(params), p)
        torch._foreach_copy_(list(exp_avgs), m)


def _foreach_adagrad(params: TensorList, grads: TensorList, states: Sequence[TensorList], hp: AdagradHyper) -> None:
    """Adagrad (contract.py) in ``torch._foreach_*`` ops, each a separate fp32 op in the kernels' order."""
    s = adagrad_scalars(hp)
    (sums,) = states
    p = [t.float() for t in params]
    g = [t.float() for t in grads]
    acc = [t.float() for t in sums]
    if s.maximize:
        g = torch._foreach_neg(g)
    if s.l2:
        g = torch._foreach_add(g, torch._foreach_mul(p, s.weight_decay))
    acc = torch._foreach_add(acc, torch._foreach_mul(g, g))
    # float64 sqrt rounded once, and a true division by full tensors (see _foreach_adam).
    denom = torch._foreach_add([t.double().sqrt_().float() for t in acc], s.eps)
    p = torch._foreach_sub(p, torch._foreach_mul(torch._foreach_div(g, denom), s.clr))
    with torch.no_grad():
        torch._foreach_copy_(list(params), p)
        torch._foreach_copy_(list(sums), acc)


class ForeachBackend:
    """Tier 4: ``torch._foreach_*`` ops in fp32 math, rounded back to the storage dtype.

    The ops are separate (no addcmul/addcdiv, which may fuse multiply-adds) and in the kernels'
    order, so in fp32 this tier agrees with the reference bit for bit. One function per rule.
    """

    name = "foreach"
    RULES: dict[str, Callable[..., None]] = {"adam": _foreach_adam, "lion": _foreach_lion, "adagrad": _foreach_adagrad}

    def unavailable(self, kernel: Kernel) -> Optional[str]:
        """Every rule on the storage dtypes the kernels have: the foreach tier is the last one, so it
        runs what any other does (the storage forms through their ``Rule.reference``)."""
        return _standard_kernel(kernel, {*self.RULES, *(n for n, r in RULES.items() if r.reference)},
                                "the foreach tier")

    def prepare(self, kernels: Iterable[Kernel]) -> None:
        """Nothing to build; a kernel it does not run raises here, before anything is updated."""
        _require(self, kernels)

    def update(self, rule: str, params, grads, states, hp, sr_keys=None) -> None:
        fn = self.RULES.get(rule) if sr_keys is None else None
        if fn is None and rule in RULES and RULES[sr_rule(rule, sr_keys)].reference:
            return _reference_each(rule, params, grads, states, hp, sr_keys)
        if fn is None:
            raise NotImplementedError(f"the foreach tier has no form of rule {rule!r}")
        fn(params, grads, states, hp)


_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "uint8": "uint8"}


def _standard_kernel(kernel: Kernel, rules: Iterable[str], who: str) -> Optional[str]:
    """Why ``who`` (a backend with a form of each rule of ``rules`` for every dtype its
    ``contract.RULES`` entry names: by default every param dtype of SUPPORTED_DTYPES, with fp32 or
    same-dtype states) does not run ``kernel``, or None."""
    rule, p, s = kernel
    spec = RULES.get(rule)
    if spec is not None and spec.param_dtypes is not None and _name(p) not in spec.param_dtypes:
        return f"{who} takes only {', '.join(_SHORT_DTYPES.get(d, d) for d in spec.param_dtypes)} params for rule {rule!r}"
    if spec is None or rule not in rules:
        return f"{who} has no form of rule {rule!r}"
    if p not in SUPPORTED_DTYPES:
        return f"{who} has no kernel for {p} params"
    if spec.state_dtypes is not None:
        if _name(s) not in spec.state_dtypes:
            return f"{who} has no {describe(kernel)} kernel (states: {', '.join(spec.state_dtypes)})"
    elif s is not torch.float32 and s is not p:
        return f"{who} has no {describe(kernel)} kernel (states: float32 or the param dtype)"
    return None


def _name(dtype: torch.dtype) -> str:
    """A torch dtype as ``contract.Rule`` names it (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).replace("torch.", "")


def _require(backend: Any, kernels: Iterable[Kernel]) -> None:
    refused = [f"{describe(Kernel(*k))}: {why}" for k in kernels if (why := backend.unavailable(Kernel(*k)))]
    if refused:
        raise RuntimeError(f"the {backend.name} backend does not run " + "; ".join(refused))


# Every SIMD path the C++ kernel can be built with (src/cpu/dispatch.cpp), best first; which of
# them a CPU supports is _cpu.simd_paths().
KNOWN_SIMD_PATHS = ("avx512bf16", "avx512", "avx2", "neon", "scalar")


class CPUBackend:
    """The ``_cpu`` extension: SIMD C++ kernel on a persistent thread pool, GIL released."""

    name = "cpu"

    def __init__(self) -> None:
        from .. import _cpu  # noqa: F401  (ImportError tells the caller why this tier is out)
        self._cpu = _cpu
        # Its own rules (_cpu.rules()), a storage form of one through that rule's kernel with
        # sr_keys, a block-quantized one through its entry (Rule.blocks.cpu_entry) where built.
        own = set(_cpu.rules())
        self._rules = frozenset(own | {name for name, r in RULES.items() if r.base in own and (
            hasattr(_cpu, r.blocks.cpu_entry) if r.blocks else True)})
        self.simd = _cpu.simd_path()
        wanted = os.environ.get("MPS_FUSED_ADAM_SIMD")
        if wanted and wanted != self.simd:
            why = "is not supported on this CPU" if wanted in KNOWN_SIMD_PATHS else \
                f"is unknown (known: {', '.join(KNOWN_SIMD_PATHS)})"
            warnings.warn(f"mps_fused_adam: MPS_FUSED_ADAM_SIMD={wanted!r} {why} "
                          f"(supported here: {', '.join(_cpu.simd_paths())}); using {self.simd}", RuntimeWarning)
        prefetch = os.environ.get("MPS_FUSED_ADAM_PREFETCH")
        if prefetch and not (prefetch.isascii() and prefetch.isdigit() and int(prefetch) <= 65536):
            # The extension ignores such a value (src/cpu/dispatch.cpp); say so instead of silently.
            warnings.warn(f"mps_fused_adam: MPS_FUSED_ADAM_PREFETCH={prefetch!r} is not a byte count from 0 to "
                          f"65536; using the per-CPU-vendor prefetch distance", RuntimeWarning)
        pool = os.environ.get("MPS_FUSED_ADAM_POOL")
        if pool and pool != "own":
            # The extension takes only "own" (src/cpu/torch_openmp.cpp) and ignores anything else.
            warnings.warn(f"mps_fused_adam: MPS_FUSED_ADAM_POOL={pool!r} is not recognised (the only value is "
                          f"'own'); using the default, torch's OpenMP threads where they can be borrowed "
                          f"(_cpu.thread_pool() says which pool runs)", RuntimeWarning)

    def unavailable(self, kernel: Kernel) -> Optional[str]:
        """The rules this build of ``_cpu`` has (``_cpu.rules()``), on fp32, fp16 and bf16 params with
        fp32 or same-dtype states; a storage form of one as its rule's kernel with ``sr_keys``
        (``adam_sr``: the bf16 stochastic-rounding store), a block-quantized one through its
        ``Rule.blocks.cpu_entry`` (``adam8bit``: ``_cpu.adam8bit_step_many``; ``adam4bit``:
        ``_cpu.adam4bit_step_many``) where this build has it."""
        return _standard_kernel(kernel, self._rules, "the _cpu extension")

    def prepare(self, kernels: Iterable[Kernel]) -> None:
        """Nothing to build (the kernels are compiled in); a kernel it does not run raises here."""
        _require(self, kernels)

    def update(self, rule: str, params, grads, states, hp, sr_keys=None) -> None:
        """``sr_keys``: for bf16 params, one ``lowbit.sr_key`` per param to store them by
        stochastic rounding (lowbit.py's contract); None rounds to nearest even. The low-bit
        rules as the module docstring says, in one call for all the tensors."""
        spec = RULES.get(rule)
        if spec is not None and spec.base is not None:
            states, hp, sr_keys = lowbit_args(rule, states, hp, sr_keys, len(params))
            if spec.blocks is not None:
                return self._blocks(spec, params, grads, states, hp, sr_keys)
            rule = spec.base
        self._cpu.step(
            rule, addresses(params), addresses(grads), [addresses(lst) for lst in states], numels(params),
            _DTYPE_CODES[params[0].dtype], _DTYPE_CODES[states[0][0].dtype],
            packed_scalars(rule, hp), torch.get_num_threads(), sr_keys,
        )

    def _blocks(self, spec: Any, params, grads, states, hp, sr_keys) -> None:
        """One call of the rule's ``Rule.blocks.cpu_entry`` (``adam8bit_step_many``'s arguments): the
        tensors' blocks are shared among the threads as one range."""
        n = len(params)
        table1, table2 = resolve(spec.blocks.tables)("cpu")
        getattr(self._cpu, spec.blocks.cpu_entry)(
            addresses(params), addresses(grads), *(addresses(lst) for lst in states), numels(params),
            [_DTYPE_CODES[params[0].dtype]] * n, table1.data_ptr(), table2.data_ptr(),
            [packed_scalars(spec.name, hp)] * n, [0] * n if sr_keys is None else list(sr_keys),
            [int(sr_keys is not None)] * n, torch.get_num_threads())



_PACKED: dict[tuple, tuple[Any, bytes]] = {}
_PACKED_MAX = 256  # distinct (rule, hyper) pairs kept: a group's last steps and a scheduler's values


def packed_scalars(rule: str, hp: Any) -> bytes:
    """``rule_spec(rule).pack(hp)``, remembered: a step of one param at a time (step_in_backward)
    packs the same hyperparameters once per param, and packing costs more than a planned param's
    whole step path. The key holds the
    sign of every zero field besides ``hp`` (whose equality takes -0.0 for 0.0, which the kernels
    may not); an entry counts only for the very rule object that packed it, so a rule replaced in
    ``contract.RULES`` (as the self-check's tests do) is packed afresh. The struct is the one the
    CPU kernel reads (``Rule.host_pack``: a block-quantized rule's of its ``AdamHyper`` ``hp``)."""
    spec = rule_spec(rule)
    try:
        key = (rule, hp, tuple(math.copysign(1.0, v) for v in vars(hp).values() if v == 0))
        packer, packed = _PACKED[key]
        if packer is spec:
            return packed
    except KeyError:
        pass
    except TypeError:  # an unhashable field: no memo
        return spec.host_pack(hp)
    packed = spec.host_pack(hp)
    if len(_PACKED) >= _PACKED_MAX:
        _PACKED.clear()
    _PACKED[key] = (spec, packed)
    return packed


class TorchFusedBackend:
    """Devices we ship no kernel for (CUDA, XPU): torch's fused Adam where it keeps the contract.

    torch's fused kernel computes in fp32 (opmath) for every storage dtype, but it needs params
    and states in one dtype; other mixes, other rules, and devices without a fused kernel, use the
    foreach tier.
    """

    name = "torch-fused"

    def __init__(self) -> None:
        self._fallback = ForeachBackend()

    def unavailable(self, kernel: Kernel) -> Optional[str]:
        """What the foreach tier runs: torch's fused Adam where it keeps the contract, foreach for the rest."""
        return self._fallback.unavailable(kernel)

    def prepare(self, kernels: Iterable[Kernel]) -> None:
        _require(self, kernels)

    def update(self, rule: str, params, grads, states, hp, sr_keys=None) -> None:
        if rule != "adam" or sr_keys is not None or states[0][0].dtype != params[0].dtype:
            return self._fallback.update(rule, params, grads, states, hp, sr_keys)
        exp_avgs, exp_avg_sqs = states
        fused = torch._fused_adamw_ if hp.adam_w_mode else torch._fused_adam_
        steps = [torch.tensor(float(hp.step), device=params[0].device)] * len(params)
        bc_off = not hp.bias_correction
        # torch's fused kernel always bias-corrects; step=inf makes beta**step vanish.
        if bc_off:
            steps = [torch.tensor(float("inf"), device=params[0].device)] * len(params)
        fused(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], steps,
              lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
              amsgrad=False, maximize=hp.maximize)


def update_staged(backend: Backend, rule: str, params: TensorList, grads: TensorList,
                  states: Sequence[TensorList], hp: Any, sr_keys: Optional[Sequence[int]] = None) -> None:
    """``backend.update`` for tensors that need not be contiguous: non-contiguous ones go through
    contiguous copies that are written back, so their update is never lost (DeepSpeed's CPU Adam
    silently loses it)."""
    extra = {} if sr_keys is None else {"sr_keys": sr_keys}
    lists = (params, grads, *states)
    if all(t.is_contiguous() for tensors in lists for t in tensors):
        backend.update(rule, params, grads, states, hp, **extra)
        return
    staged = [[t.contiguous() for t in tensors] for tensors in lists]
    backend.update(rule, staged[0], staged[1], staged[2:], hp, **extra)
    written = [(params, staged[0])] + list(zip(states, staged[2:]))
    for originals, copies in written:
        for orig, copy in zip(originals, copies):
            if copy is not orig:
                orig.copy_(copy)


_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
SUPPORTED_DTYPES = tuple(_DTYPE_CODES)

_lock = threading.Lock()
_chosen: dict[str, Backend] = {}
_reasons: dict[str, list[str]] = {}


def load_tier(device_type: str, label: str, make: Callable[[], Backend]) -> tuple[Optional[Backend], Optional[str]]:
    """``(make(), None)``, or ``(None, why)`` once ``why`` is recorded for ``backend_info()`` and
    warned: any load failure means say why once and use the next tier."""
    try:
        return make(), None
    except Exception as exc:
        msg = f"mps_fused_adam: {label} backend unavailable for {device_type} tensors: {exc!r}"
        _reasons.setdefault(device_type, []).append(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
        return None, msg


def _try(device_type: str, factories: Sequence[tuple[str, Callable[[], Backend]]]) -> Backend:
    _reasons.setdefault(device_type, [])
    for label, make in factories:
        backend, _ = load_tier(device_type, label, make)
        if backend is not None:
            return backend
    return ForeachBackend()


def _tiers(device_type: str) -> list[tuple[str, Callable[[], Backend]]]:
    if device_type == "cpu":
        return [("_cpu extension", CPUBackend)]
    if device_type == "mps":
        from .mps import mps_tiers
        return mps_tiers()
    if device_type in ("cuda", "xpu"):
        return [("torch fused", TorchFusedBackend)]
    return []


def _choose(device_type: str) -> Backend:
    """One backend for CPU and CUDA/XPU; for MPS the chain of its tiers, kernel by kernel (chain.py)."""
    if device_type != "mps":
        return _try(device_type, _tiers(device_type))
    from .chain import TierChain
    _reasons.setdefault(device_type, [])
    return TierChain(device_type, [*_tiers(device_type), ("foreach tier", ForeachBackend)],
                     lambda label, make: load_tier(device_type, label, make))


def get_backend(device: torch.device | str) -> Backend:
    """The backend for tensors on ``device``, chosen on first use and kept for the process."""
    device_type = torch.device(device).type
    backend = _chosen.get(device_type)
    if backend is None:
        with _lock:
            backend = _chosen.get(device_type)
            if backend is None:
                backend = _chosen[device_type] = _choose(device_type)
    return backend


_FOREACH = ForeachBackend()


def backend_for(device: torch.device | str, kernel: Kernel) -> Backend:
    """The backend that runs ``kernel`` for tensors on ``device``: the device's (``get_backend``)
    where it runs the kernel (``unavailable``), else the foreach tier, which runs every rule."""
    backend = get_backend(device)
    unavailable = getattr(backend, "unavailable", None)
    if unavailable is None or unavailable(kernel) is None:
        return backend
    return _FOREACH


def prepare(kernels_by_device: dict[torch.device, set]) -> None:
    """``prepare`` each device's backend with the kernels a step is about to run, before any update
    (a step is all or nothing). A device whose backend routes kernels to its tiers (``TierChain``,
    MPS) is handed them all; another the ones it runs (the rest run on the foreach tier, which
    has nothing to prepare)."""
    for device, kernels in kernels_by_device.items():
        backend = get_backend(device)
        prep = getattr(backend, "prepare", None)
        if prep is None:
            continue
        if hasattr(backend, "tier_of"):
            prep(list(kernels))
        else:
            prep([k for k in kernels if backend.unavailable(k) is None])


def backend_info() -> dict[str, dict[str, object]]:
    """What is active per device type tried so far (CPU always; MPS when available), and why not the rest.

    Each entry: ``backend`` (its name; on MPS the first tier that loaded), ``unavailable`` (why each
    preferred tier did not load), and where they apply ``simd`` (the CPU kernel's SIMD path) and
    ``fast_math`` (MPS: what torch's ``PYTORCH_MPS_FAST_MATH`` changes for the active Metal tier).
    On MPS also ``tiers`` (per tier: label, name, state, reason, the kernels it does not run and
    why), ``kernels_unavailable`` (tier label -> kernel -> why, for tiers that refuse any) and
    ``routes`` (kernel -> the tier that runs it, for the kernels used so far)."""
    get_backend("cpu")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        get_backend("mps")
    info = {}
    for device_type, backend in _chosen.items():
        entry: dict[str, object] = {"backend": backend.name, "unavailable": list(_reasons.get(device_type, []))}
        if hasattr(backend, "simd"):
            entry["simd"] = backend.simd
        if hasattr(backend, "tiers_info"):
            tiers = backend.tiers_info()
            entry["tiers"] = tiers
            entry["kernels_unavailable"] = {t["tier"]: t["kernels_unavailable"] for t in tiers
                                            if t["kernels_unavailable"]}
            entry["routes"] = backend.routes()
        if device_type == "mps":
            from .mps import fast_math_note
            note = fast_math_note(backend.name)
            if note is not None:
                entry["fast_math"] = note
        info[device_type] = entry
    return info
