"""Self-check of every available backend against the reference (used by ``python -m mps_fused_adam``).

Each backend runs three steps of each update rule of contract.RULES with its own element math
(Adam, Lion, Adagrad), with the rule's example hyperparameters (contract.Example), and on the CPU
kernel's SIMD paths and the Metal tiers also each block-quantized rule (8-bit Adam) and bf16
stochastic rounding, in each mode, from the same start as
the reference, and is judged by what the docs promise for it (docs/cli.md):

- on CPU (every SIMD path of the ``_cpu`` kernel, and the foreach tier) the results must equal the
  reference bit for bit;
- elsewhere (the Metal tiers on an Apple GPU, which may flush fp32 subnormals; torch's MPS ops) each
  tensor must lie within the contract's bound, ``8 * eps(dtype) * max|ref|``, and its error must
  also be small against how far the step moved it (``UPDATE_BOUND``). The second test is what
  catches a backend that leaves the params alone or moves them the wrong way: the params start
  small (``PARAM_SCALE``) so that three steps move them by many ulps even in bf16.

The measured worst difference is reported. :func:`torch_agreement` measures how far the contract
is from ``torch.optim.AdamW``; run through each backend (:func:`check_agreement`) it is a case of
the self-check with its own bound, ``AGREEMENT_BOUND``: it catches a bug in the host scalars,
which the reference shares with the kernels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterator, Optional

import torch

from ..backends import ForeachBackend, get_backend
from ..numerics.contract import RULES, AdamHyper, element_rules, example, resolve
from ..numerics.reference import reference_adam_, reference_step_

# The params start at randn * PARAM_SCALE (|p| up to about 0.2) and three steps at lr 1e-2 move
# them by up to about 0.03: with randn params, 8 eps x max|ref| in bf16 (8 * 2**-7 * 4 = 0.25) was
# larger than the whole movement, so a backend that never wrote the params passed. At this scale
# one bf16 ulp of a param is at most 2**-10, a thirtieth of the movement.
PARAM_SCALE = 0.02
# Largest error of a tensor as a share of its largest movement (|ref - start|) off CPU: a backend
# that does not write a tensor scores 1, one that moves it the wrong way 2; a few ulps of honest
# rounding difference score well under 0.1 at PARAM_SCALE.
UPDATE_BOUND = 0.25

PAIRS = [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.float16, torch.float16),
         (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@dataclass
class CheckResult:
    backend: str
    device: str
    dtypes: str
    worst_in_eps: float  # worst |ours - ref| / (eps(dtype) * max|ref|) over all tensors and modes
    bit_exact: bool
    exact_required: bool = False  # on CPU the contract promises bit identity with the reference
    worst_of_update: float = 0.0  # worst max|ours - ref| / max|ref - start| over the tensors
    bound: float = 8.0  # on worst_in_eps where bit identity is not required
    error: Optional[str] = None  # what the backend raised, if it did

    @property
    def passed(self) -> bool:
        if self.error is not None:
            return False
        if self.exact_required:
            return self.bit_exact
        # A NaN or infinite worst (a NaN on one side only, a code that differs) is a failure, not
        # a number that happens to compare false against the bound.
        return (math.isfinite(self.worst_in_eps) and self.worst_in_eps <= self.bound
                and math.isfinite(self.worst_of_update) and self.worst_of_update <= UPDATE_BOUND)


def _raised(label: str, device: str, dtypes: str, exc: Exception) -> CheckResult:
    """A case whose backend raised: failed, with what it raised, so that the other cases and
    backends are still checked and reported."""
    return CheckResult(label, device, dtypes, math.inf, False, device == "cpu", math.inf,
                       error=f"{type(exc).__name__}: {exc}")


def _abs_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a - b|`` in fp32, element by element, where equal values (both NaN, the same infinity)
    count 0 and a NaN on one side only counts infinity: ``a - b`` would be NaN there, and NaN
    vanishes from a ``max`` (Python's ``max(0.0, nan)`` is 0.0), so a NaN written by a backend
    would pass."""
    a, b = a.float(), b.float()
    d = torch.where((a == b) | (a.isnan() & b.isnan()), 0.0, (a - b).abs())
    return torch.where(a.isnan() ^ b.isnan(), math.inf, d)


def _scale(ref: torch.Tensor) -> float:
    """``eps(dtype) * max|ref|`` over the finite values (an infinite reference value would make
    every difference vanish)."""
    r = ref.float().abs()
    big = torch.where(r.isfinite(), r, 0.0).max().item() if r.numel() else 0.0
    return torch.finfo(ref.dtype).eps * max(big, torch.finfo(torch.float32).tiny)


def _hypers(rule: str, step: int, flag: bool) -> Any:
    """Three steps of each rule in its two modes (``flag``: the first of contract's
    ``Example.modes``), maximize on the third step, with the rule's example hyperparameters."""
    ex = example(rule)
    return ex.hyper(step, maximize=step == 3, **ex.modes[0 if flag else 1])


def check_backend(backend: Any, device: str, label: str, n: int = 4099) -> Iterator[CheckResult]:
    for i, rule in enumerate(element_rules()):
        nstates = len(RULES[rule].states)
        for j, (pd, sd) in enumerate(PAIRS):
            label_dtypes = f"{str(pd)[6:]}/{str(sd)[6:]}" if rule == "adam" else f"{rule} {str(pd)[6:]}/{str(sd)[6:]}"
            # Inputs seeded per case: a case that raised halfway must not change the next one's.
            gen = torch.Generator().manual_seed(100 * i + j)
            try:
                worst, of_update, exact = _check_case(backend, device, rule, nstates, pd, sd, n, gen)
            except Exception as exc:
                yield _raised(label, device, label_dtypes, exc)
                continue
            yield CheckResult(label, device, label_dtypes, worst, exact, device == "cpu", of_update)


def _check_case(backend: Any, device: str, rule: str, nstates: int, pd: torch.dtype, sd: torch.dtype, n: int,
                gen: torch.Generator) -> tuple[float, float, bool]:
    """One rule and dtype pair, three steps in each mode: :func:`_compare`'s figures."""
    ours_all, ref_all, start_all = [], [], []
    for flag in (True, False):
        base = [(torch.randn(n, generator=gen) * PARAM_SCALE).to(pd), (torch.randn(n, generator=gen) * 0.1).to(pd)]
        base += [torch.zeros(n, dtype=sd) for _ in range(nstates)]
        ref = [t.clone() for t in base]
        ours = [t.to(device, copy=True) for t in base]  # a copy on CPU too: base is the start
        for step in (1, 2, 3):
            hp = _hypers(rule, step, flag)
            backend.update(rule, [ours[0]], [ours[1]], [[t] for t in ours[2:]], hp)
            reference_step_(rule, ref[0], ref[1], ref[2:], hp)
        ours_all += ours
        ref_all += ref
        start_all += base
    return _compare(ours_all, ref_all, start_all)


def _compare(ours: list[torch.Tensor], ref: list[torch.Tensor],
             start: list[torch.Tensor]) -> tuple[float, float, bool]:
    """(worst difference in units of eps(dtype) x max|ref|, worst difference as a share of the
    tensor's largest movement from ``start``, bit-exact) over the tensors. A code tensor (uint8)
    that differs anywhere is infinitely wrong."""
    worst, of_update, exact = 0.0, 0.0, True
    for a, b, s in zip(ours, ref, start):
        a = a.cpu()
        exact &= torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        if b.is_floating_point():
            err = _abs_diff(a, b).max().item()
            worst = max(worst, err / _scale(b))
            moved = _abs_diff(b, s)
            moved = torch.where(moved.isfinite(), moved, 0.0).max().item()
            if moved > 0:  # a tensor the step leaves alone is judged by the first bound only
                of_update = max(of_update, err / moved)
            elif err > 0:
                of_update = math.inf
        elif not torch.equal(a, b):  # a code differs: not within any bound
            worst = of_update = math.inf
    return worst, of_update, exact


def many_sizes(threads: int, count: int = 5) -> list[int]:
    """Sizes of the several-tensor case: none a multiple of 64, together more than twice
    ``32768 * threads`` elements. The CPU kernel gives each thread at least 32768 elements
    (src/cpu/step.cpp, ``kMinElementsPerThread``) at boundaries on multiples of 64, so below that
    a call runs on fewer threads, and with sizes off the 64 grid tensor ends fall inside a thread's
    range: the 4099-element cases run on one thread and never reach the split."""
    base = (2 * 32768 * max(threads, 1) + 4099) // count
    return [size + 1 if size % 64 == 0 else size for size in (base + 37 * i for i in range(count))]


@lru_cache(maxsize=2)
def _many_case(threads: int) -> tuple:
    """Start (params, grads, states) and the reference after three Adam steps, for
    :func:`check_many`: made once for every backend checked."""
    gen = torch.Generator().manual_seed(2)
    sizes = many_sizes(threads)
    params = [(torch.randn(n, generator=gen) * PARAM_SCALE).bfloat16() for n in sizes]
    grads = [(torch.randn(n, generator=gen) * 0.1).bfloat16() for n in sizes]
    states = [[torch.zeros(n) for n in sizes] for _ in range(2)]
    ref = [[t.clone() for t in params], [[t.clone() for t in ts] for ts in states]]
    for step in (1, 2, 3):
        for i, g in enumerate(grads):
            reference_adam_(ref[0][i], g, ref[1][0][i], ref[1][1][i], _hypers("adam", step, True))
    return params, grads, states, ref


def check_many(backend: Any, device: str, label: str) -> CheckResult:
    """Adam (bf16 params, fp32 states) on several tensors in one call, enough elements to use
    every thread of the CPU kernel (:func:`many_sizes`), three steps, judged as
    :func:`check_backend` judges."""
    threads = torch.get_num_threads()
    params, grads, states, ref = _many_case(threads)
    dtypes = f"{len(params)} tensors, {sum(p.numel() for p in params)} elements, bfloat16/float32"
    try:
        ours = [t.to(device, copy=True) for t in params]
        ours_states = [[t.to(device, copy=True) for t in ts] for ts in states]
        ours_grads = [g.to(device) for g in grads]
        for step in (1, 2, 3):
            backend.update("adam", ours, ours_grads, ours_states, _hypers("adam", step, True))
        worst, of_update, exact = _compare([*ours, *ours_states[0], *ours_states[1]],
                                           [*ref[0], *ref[1][0], *ref[1][1]],
                                           [*params, *states[0], *states[1]])
    except Exception as exc:
        return _raised(label, device, dtypes, exc)
    return CheckResult(label, device, dtypes, worst, exact, device == "cpu", of_update)


def block_rules() -> list[str]:
    """The block-quantized rules of contract.RULES (``Rule.blocks``: 8-bit and 4-bit Adam), in its order."""
    return [name for name, r in RULES.items() if r.blocks is not None]


@lru_cache(maxsize=2)
def _lowbit_cases(n: int) -> tuple:
    """The low-bit checks' inputs and reference results, made once for every backend checked:
    per block-quantized rule and param dtype (rule, start param, start state, grads per step, sr
    keys, reference param and state), then per stochastic-rounding state dtype (start tensors,
    grads, keys, references)."""
    from ..numerics import lowbit
    from ..numerics.reference_lowbit import reference_adam_sr_
    gen = torch.Generator().manual_seed(1)
    q8, sr = [], []
    for rule in block_rules():
        spec = RULES[rule]
        reference = resolve(spec.reference)
        for pd in (torch.float32, torch.float16, torch.bfloat16):
            p = (torch.randn(n, generator=gen) * PARAM_SCALE).to(pd)
            st = dict(zip(spec.blocks.names, resolve(spec.blocks.new_states)((n,), "cpu")))
            grads = [(torch.randn(n, generator=gen) * 0.1).to(pd) for _ in range(3)]
            keys = [lowbit.sr_key(5, step) if pd is torch.bfloat16 else None for step in (1, 2, 3)]
            ref = [p.clone()] + [t.clone() for t in st.values()]
            for step, g, key in zip((1, 2, 3), grads, keys):
                reference(ref[0], g, *ref[1:], _hypers("adam", step, True), key)
            q8.append((rule, p, st, grads, keys, ref))
    for sd in (torch.float32, torch.bfloat16):
        base = [(torch.randn(n, generator=gen) * PARAM_SCALE).bfloat16(), torch.zeros(n, dtype=sd),
                torch.zeros(n, dtype=sd)]
        grads = [(torch.randn(n, generator=gen) * 0.1).bfloat16() for _ in range(3)]
        keys = [lowbit.sr_key(9, step) for step in (1, 2, 3)]
        ref = [t.clone() for t in base]
        for step, g, key in zip((1, 2, 3), grads, keys):
            reference_adam_sr_(ref[0], g, ref[1], ref[2], _hypers("adam", step, step != 2), key)
        sr.append((base, grads, keys, ref))
    return q8, sr


def check_lowbit(blocks: Callable[..., None], adam_sr: Callable[..., None], device: str, label: str,
                 n: int = 4099, runs: Callable[[str], bool] = lambda rule: True) -> Iterator[CheckResult]:
    """The low-bit rules (lowbit.py, lowbit4.py) against their references, three steps each: each
    block-quantized rule (:func:`block_rules`: 8-bit and 4-bit Adam) that ``runs(rule)`` for each
    param dtype (``blocks(rule, p, g, state, hyper, sr_key)``), and Adam with bf16 stochastic
    rounding for both state dtypes (``adam_sr(p, g, m, v, hyper, sr_key)``). Codes must match
    exactly; params and moments as in :func:`check_backend`."""
    q8, sr = _lowbit_cases(n)
    for rule, p, st, grads, keys, ref in q8:
        if not runs(rule):
            continue
        dtypes = f"{rule} {str(p.dtype)[6:]}/{RULES[rule].state_dtypes[0]}"
        try:
            ours_p, ours_st = p.clone().to(device), {k: t.clone().to(device) for k, t in st.items()}
            for step, g, key in zip((1, 2, 3), grads, keys):
                blocks(rule, ours_p, g.to(device), ours_st, _hypers("adam", step, True), key)
            worst, of_update, exact = _compare([ours_p, *ours_st.values()], ref, [p, *st.values()])
        except Exception as exc:
            yield _raised(label, device, dtypes, exc)
            continue
        yield CheckResult(label, device, dtypes, worst, exact, device == "cpu", of_update)
    for base, grads, keys, ref in sr:
        dtypes = f"adam-sr bfloat16/{str(base[1].dtype)[6:]}"
        try:
            ours = [t.clone().to(device) for t in base]
            for step, g, key in zip((1, 2, 3), grads, keys):
                adam_sr(ours[0], g.to(device), ours[1], ours[2], _hypers("adam", step, step != 2), key)
            worst, of_update, exact = _compare(ours, ref, base)
        except Exception as exc:
            yield _raised(label, device, dtypes, exc)
            continue
        yield CheckResult(label, device, dtypes, worst, exact, device == "cpu", of_update)


def _lowbit(backend: Any) -> tuple[Callable[..., None], Callable[..., None]]:
    """A backend's block-quantized rules and its stochastic-rounding mode of Adam, one tensor a call."""

    def blocks(rule, p, g, st, hp, key):
        backend.update(rule, [p], [g], [[st[k]] for k in RULES[rule].blocks.names], hp,
                       sr_keys=None if key is None else [key])
    return (blocks,
            lambda p, g, m, v, hp, key: backend.update("adam_sr", [p], [g], [[m], [v]], hp, sr_keys=[key]))


def _cpu_runs(cpu: Any) -> Callable[[str], bool]:
    """Whether the CPU backend runs a block-quantized rule: a ``_cpu`` built without one's entry
    (``Rule.blocks.cpu_entry``) has no kernel of it to check. (The MPS tiers' refusals are on
    their tier lines instead.)"""
    from ..backends.kernel import Kernel
    return lambda rule: cpu.unavailable(Kernel(rule, torch.float32, torch.uint8)) is None


def all_checks() -> Iterator[CheckResult]:
    cpu = get_backend("cpu")
    if cpu.name == "cpu":
        from .. import _cpu
        before = _cpu.simd_path()
        try:
            for path in _cpu.simd_paths():
                _cpu.set_simd_path(path)
                yield from check_backend(cpu, "cpu", f"_cpu ({path})")
                yield from check_lowbit(*_lowbit(cpu), "cpu", f"_cpu ({path})", runs=_cpu_runs(cpu))
                yield check_many(cpu, "cpu", f"_cpu ({path})")
                yield check_agreement(cpu, "cpu", f"_cpu ({path})")
        finally:
            _cpu.set_simd_path(before)
    yield from check_backend(ForeachBackend(), "cpu", "foreach")
    yield check_many(ForeachBackend(), "cpu", "foreach")
    yield check_agreement(ForeachBackend(), "cpu", "foreach")
    if _mps_usable():
        for tier in mps_tier_states():
            if tier.backend is None:  # its line (tier_lines) says why; nothing to check
                continue
            backend, label, runs = tier.backend, tier.label, tier.runs
            yield from filter(runs, check_backend(backend, "mps", label))
            yield from filter(runs, check_lowbit(*_lowbit(backend), "mps", label))
            yield from filter(runs, [check_many(backend, "mps", label)])
            yield check_agreement(backend, "mps", label)
        yield from check_backend(ForeachBackend(), "mps", "foreach")
        yield check_many(ForeachBackend(), "mps", "foreach")
        yield check_agreement(ForeachBackend(), "mps", "foreach")


def _mps_usable() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


@dataclass
class TierState:
    """One MPS tier as the self-check found it: loaded (``backend``) or why not (``reason``), and
    the kernels it refuses after building and probing all of them (``describe`` -> why)."""
    number: int
    label: str
    backend: Any = None
    reason: Optional[str] = None
    refused: dict = None  # type: ignore[assignment]

    def runs(self, result: CheckResult) -> bool:
        """Whether ``result`` checks a kernel this tier runs (a refused one is on its line instead).
        The cases' labels name their kernel's dtypes last: ``float32/float32`` (Adam), ``lion
        float32/float32``, ``adam-sr bfloat16/float32``, ``5 tensors, N elements, bfloat16/float32``."""
        words = result.dtypes.split(", ")[-1].split(" ")
        kernel = f"adam {words[0]}" if len(words) == 1 else f"{words[0].replace('adam-sr', 'adam_sr')} {words[1]}"
        return kernel not in (self.refused or {})

    def line(self, total: int, width: int = 120) -> str:
        """One line: ``tier N label: state[, reason]`` (reasons cut to ``width`` characters)."""
        def cut(text: str) -> str:
            return text if len(text) <= width else text[:width - 3] + "..."
        head = f"  tier {self.number} {self.label}:"
        if self.backend is None:
            return f"{head} not loaded: {cut(self.reason or '')}"
        if not self.refused:
            return f"{head} loaded, runs all {total} kernels"
        first, why = next(iter(self.refused.items()))
        more = f" and {len(self.refused) - 1} more" if len(self.refused) > 1 else ""
        return f"{head} loaded, runs {total - len(self.refused)} of {total} kernels; refuses {first}{more}: {cut(why)}"


_TIER_STATES: list[TierState] = []


def mps_tier_states(tiers: Optional[list] = None) -> list[TierState]:
    """Each MPS tier loaded on its own (not only those the chain of ``get_backend("mps")`` has
    needed), every kernel built and probed; remembered for the process when ``tiers`` is None."""
    if tiers is None and _TIER_STATES:
        return _TIER_STATES
    from ..backends.mps import KERNELS, mps_tiers
    out = []
    for i, (label, make) in enumerate(tiers if tiers is not None else mps_tiers(), 1):
        try:
            backend = make()
        except Exception as exc:
            out.append(TierState(i, label, reason=f"{type(exc).__name__}: {exc}", refused={}))
            continue
        try:
            backend.prepare(KERNELS)
        except Exception:  # each refusal is in kernels_unavailable()
            pass
        out.append(TierState(i, label, backend, refused=backend.kernels_unavailable()))
    if tiers is None:
        _TIER_STATES[:] = out
    return out


def tier_lines(tiers: Optional[list] = None) -> list[str]:
    """One line per MPS tier with its state and reason (none without an MPS device, unless
    ``tiers`` is given)."""
    if tiers is None and not _mps_usable():
        return []
    from ..backends.mps import KERNELS
    return [t.line(len(KERNELS)) for t in mps_tier_states(tiers)]


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance between fp32 tensors in units in the last place (0: identical bits; 1: neighbours)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(torch.int32).long()
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordered(a) - ordered(b)).abs()


# How far the contract may be from torch.optim.AdamW after torch_agreement's 100 steps, in units
# of eps(fp32) x max|p|. torch orders the same operations differently (its denominator divides by
# sqrt(bc2) where the contract multiplies by 1 / sqrt(bc2); addcdiv instead of a product), so each
# step's update may differ by an ulp or two of the update, which is about lr = 1e-3, far below
# |p|: measured 0.66 (100K params) and 0.46 (20K). A bound of 4 leaves a margin of six; a bug in
# the host scalars that the reference and the kernels share (a bias correction dropped, a wrong
# beta) moves the params by ~5e5 of these units, which no comparison with the reference can see.
AGREEMENT_BOUND = 4.0
AGREEMENT_LABEL = "AdamW vs torch.optim.AdamW"


@lru_cache(maxsize=2)
def _torch_adamw(steps: int, n: int, weight_decay: float) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The start, the grads of every step and torch.optim.AdamW's result (``foreach=False``):
    made once per size for every backend compared with it. Through torch's functional
    ``adamw``, the function ``AdamW.step`` calls, where it takes these arguments: constructing the
    class imports torch._dynamo, a slow import that ``--check`` need not pay."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 1e-2 for _ in range(steps)]
    p, m, v, step = p0.clone(), torch.zeros(n), torch.zeros(n), torch.tensor(0.0)
    try:
        from torch.optim.adamw import adamw
        for g in grads:
            adamw([p], [g.clone()], [m], [v], [], [step], foreach=False, amsgrad=False, beta1=0.9,
                  beta2=0.999, lr=1e-3, weight_decay=weight_decay, eps=1e-8, maximize=False)
    except (ImportError, TypeError):  # another torch's functional form: the class, as users call it
        tp = torch.nn.Parameter(p0.clone())
        opt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=weight_decay, foreach=False)
        for g in grads:
            tp.grad = g.clone()
            opt.step()
        p = tp.detach().clone()
    return p0, grads, p


def torch_agreement(step_fn: Callable[..., None] | None = None, steps: int = 100, n: int = 100_000,
                    weight_decay: float = 0.01, device: str = "cpu") -> dict[str, Any]:
    """fp32 params after ``steps`` AdamW steps (lr 1e-3, default betas and eps) by ``step_fn``
    (default: the contract's reference; called as ``step_fn(p, g, m, v, hyper)`` on ``device``)
    against ``torch.optim.AdamW(foreach=False)`` from the same start and gradients: the mean and
    the largest distance in ulps, the share of bit-identical elements, the largest difference in
    units of ``eps(fp32) * max|p|`` and whether that is within ``AGREEMENT_BOUND``."""
    step_fn = step_fn or reference_adam_
    p0, grads, theirs = _torch_adamw(steps, n, weight_decay)
    p = p0.to(device, copy=True)
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    for step, g in enumerate(grads, 1):
        step_fn(p, g.to(device, copy=True), m, v, AdamHyper(1e-3, 0.9, 0.999, 1e-8, weight_decay, step))
    p = p.cpu()
    u = ulps(p, theirs)
    scale = torch.finfo(torch.float32).eps * theirs.abs().max().item()
    max_in_eps = _abs_diff(p, theirs).max().item() / scale
    return {"mean_ulps": u.double().mean().item(), "max_ulps": float(u.max().item()),
            "identical": (u == 0).double().mean().item(), "max_in_eps": max_in_eps,
            "bound": AGREEMENT_BOUND, "passed": math.isfinite(max_in_eps) and max_in_eps <= AGREEMENT_BOUND}


def check_agreement(backend: Any, device: str, label: str, n: int = 20_000) -> CheckResult:
    """:func:`torch_agreement` through ``backend`` as one self-check case (100 steps of ``n`` fp32
    params; 20K keeps it to a tenth of a second on CPU)."""
    try:
        a = torch_agreement(lambda p, g, m, v, hp: backend.update("adam", [p], [g], [[m], [v]], hp), n=n,
                            device=device)
    except Exception as exc:
        return _raised(label, device, AGREEMENT_LABEL, exc)
    return CheckResult(label, device, AGREEMENT_LABEL, a["max_in_eps"], a["identical"] == 1.0,
                       bound=AGREEMENT_BOUND)
