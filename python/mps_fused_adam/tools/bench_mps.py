"""The benchmark's MPS section: each of our Metal tiers against torch's own optimizers on MPS,
with the chip's copy bandwidth measured in the same run as the yardstick. Adam in every dtype
pair and tensor count, then the other rules on one flat tensor: Lion and Adagrad (fp32), Adam
with bf16 stochastic rounding, 8-bit and 4-bit Adam (fp32 and bf16 params).

Called by ``bench.py``; prints "no MPS device" where there is none (every Linux machine).
Contenders run interleaved (one repetition of each in turn), so drifts of clock and temperature
hit all of them alike. Times are medians; every timed call ends with ``torch.mps.synchronize()``.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..numerics import lowbit
from ..numerics.contract import RULES, AdamHyper, element_rules, example, resolve
from .timing import bytes_per_elem, interleaved

# Rules after Adam: (rule, param dtype, state dtype): every other rule of contract.RULES with its
# own element math in fp32, then the storage forms of Adam: stochastic rounding (bf16 params, fp32
# states), each block-quantized rule with fp32 and bf16 params. Bytes per element: bytes_moved().
RULE_CASES = ([(name, torch.float32, torch.float32) for name in element_rules() if name != "adam"]
              + [(name, getattr(torch, r.param_dtypes[0]), torch.float32) for name, r in RULES.items()
                 if r.base and r.blocks is None]
              + [(name, p, getattr(torch, r.state_dtypes[0])) for name, r in RULES.items() if r.blocks
                 for p in (torch.float32, torch.bfloat16)])


def bench_hyper(rule: str, step: int):
    """A rule's hyperparameters in the benchmarks: its example (contract.Example) without weight
    decay, as torch's optimizers default to (Adagrad's L2 term is skipped at 0)."""
    return example(rule).hyper(step, weight_decay=0.0)


def bytes_moved(rule: str, pdtype: torch.dtype, sdtype: torch.dtype) -> float:
    """Bytes one step of ``rule`` moves per element (reads and writes; a block-quantized rule: its
    fresh states' bytes, codes and scales, of a tensor of whole blocks)."""
    blocks = RULES[rule].blocks
    if blocks is not None:
        n = 1 << 16
        states = resolve(blocks.new_states)((n,), "cpu")
        return 3 * pdtype.itemsize + 2 * sum(t.numel() * t.element_size() for t in states) / n
    return bytes_per_elem(pdtype, sdtype, len(RULES[rule].states))


def _rule_contenders(rule: str, tensors: list[torch.Tensor], pdtype, sdtype,
                     tiers) -> tuple[dict[str, Callable[[], None]], list[str]]:
    """Ours per tier for one rule after Adam, and torch's (or lion_pytorch's) where it has one."""
    params = [torch.nn.Parameter(t) for t in tensors]
    grads = [torch.randn_like(t) * 1e-2 for t in tensors]
    for p, g in zip(params, grads):
        p.grad = g
    raw = [p.detach() for p in params]
    step = [0]
    spec = RULES[rule]
    if spec.blocks is not None:  # the optimizers' form; kernel_calls turns it into the Metal buffers
        fresh = [resolve(spec.blocks.new_states)(t.shape, t.device) for t in tensors]
        states = [list(lst) for lst in zip(*fresh)]
    else:
        states = [[torch.zeros_like(t, dtype=sdtype) for t in tensors] for _ in range(len(spec.states))]

    def hyper():
        step[0] += 1
        if spec.base is None:
            return bench_hyper(rule, step[0])
        adam = AdamHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step[0])
        sr = lowbit.sr_key(1234, step[0]) if pdtype is torch.bfloat16 else None
        return adam, (None if sr is None else [sr] * len(tensors))

    out: dict[str, Callable[[], None]] = {}
    notes: list[str] = []
    for label, factory in tiers:
        try:
            backend = factory()
            if spec.base is None:
                out[f"ours {rule} ({label})"] = (lambda b: lambda: b.update(rule, raw, grads, states, hyper()))(backend)
            else:  # one kernel call per tensor with its key (mps.kernel_calls)
                out[f"ours {rule} ({label})"] = (lambda b: lambda: b.update(rule, raw, grads, states,
                                                                             *hyper()))(backend)
        except Exception as exc:
            notes.append(f"{label}: unavailable ({exc})")
    if rule == "adagrad":
        out["torch Adagrad(foreach=True)"] = torch.optim.Adagrad(params, lr=1e-2, foreach=True).step
    elif rule == "lion":
        try:
            import lion_pytorch
            out["lion_pytorch Lion"] = lion_pytorch.Lion(params, lr=1e-4, weight_decay=0.01).step
        except ImportError:
            notes.append("lion_pytorch: not installed")
    else:  # Adam with bf16 params, or 8-bit/4-bit: torch's fused AdamW in the param dtype is the yardstick
        out["torch AdamW(fused=True)"] = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True).step
    return out, notes


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return mps is not None and mps.is_available()


def _copy_bandwidth(numel: int, repeats: int, device: str, sync: Callable[[], None]) -> float:
    """Bytes per second of a device-to-device fp32 copy (one read and one write per element)."""
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    t = interleaved({"copy": lambda: dst.copy_(src)}, repeats, sync)["copy"]
    return 2 * numel * 4 / t


def _contenders(tensors: list[torch.Tensor], pdtype, sdtype,
                tiers) -> tuple[dict[str, Callable[[], None]], list[str]]:
    params = [torch.nn.Parameter(t) for t in tensors]
    grads = [torch.randn_like(t) for t in tensors]
    for p, g in zip(params, grads):
        p.grad = g
    ms = [torch.zeros_like(t, dtype=sdtype) for t in tensors]
    vs = [torch.zeros_like(t, dtype=sdtype) for t in tensors]
    raw = [p.detach() for p in params]
    step = [0]
    notes: list[str] = []
    out: dict[str, Callable[[], None]] = {}

    def ours(backend) -> Callable[[], None]:
        def run() -> None:
            step[0] += 1
            hp = AdamHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step[0])
            backend.update("adam", raw, grads, [ms, vs], hp)
        return run

    for label, factory in tiers:
        try:
            out[f"ours ({label})"] = ours(factory())
        except Exception as exc:  # a tier that cannot load is reported, not fatal
            notes.append(f"{label}: unavailable ({exc})")
    if sdtype == pdtype:  # torch keeps states in the param dtype only
        for kind in ("fused", "foreach"):
            opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **{kind: True})
            out[f"torch AdamW({kind}=True)"] = opt.step
    return out, notes


def mps_benchmark_section(numel: int = 64 * 2**20, many: tuple[int, int] = (1000, 65536),
                          tiny: tuple[int, int] = (1000, 4), repeats: int = 10,
                          out: Callable[[str], None] = print) -> list[dict]:
    """Measure and print the MPS table; returns its rows (empty without an MPS device).

    Cases: one flat tensor of ``numel`` elements (fp32; bf16 params and states; bf16 params with
    fp32 states), ``many`` = (count, size) tensors in fp32, and ``tiny`` tensors whose time is
    almost all dispatch cost (reported per tensor).
    """
    if not _mps_available():
        out("MPS: no MPS device; the Metal section runs on Apple Silicon only")
        return []
    from ..backends.mps import mps_tiers
    return _run_section(numel, many, tiny, repeats, out, device="mps", sync=torch.mps.synchronize,
                        tiers=mps_tiers())


def _run_section(numel, many, tiny, repeats, out, *, device: str, sync: Callable[[], None],
                 tiers) -> list[dict]:
    """The measurement itself; the device, its sync and the tiers are parameters so the tests can
    run it on CPU tensors with the emulated tiers."""
    bandwidth = _copy_bandwidth(numel, repeats, device, sync)
    out(f"{device.upper()} copy bandwidth (fp32 copy_, {numel} elements): {bandwidth / 1e9:.1f} GB/s")
    cases = [(f"flat {numel}", [numel], torch.float32, torch.float32),
             (f"flat {numel}", [numel], torch.bfloat16, torch.bfloat16),
             (f"flat {numel}", [numel], torch.bfloat16, torch.float32),
             (f"{many[0]} x {many[1]}", [many[1]] * many[0], torch.float32, torch.float32),
             (f"{tiny[0]} x {tiny[1]}", [tiny[1]] * tiny[0], torch.float32, torch.float32)]
    rows: list[dict] = []
    out(f"{'case':<22} {'dtypes':<16} {'implementation':<38} {'ns/elem':>8} {'GB/s':>7} {'% copy bw':>9} {'us/tensor':>9}")
    def measure(case: str, sizes: list[int], pdtype, sdtype, rule: str, make) -> None:
        """One case: its contenders interleaved, one row each (printed and kept)."""
        tensors = [torch.randn(n, device=device).to(pdtype) for n in sizes]
        contenders, notes = make(tensors)
        for note in notes:
            out(f"  {note}")
        elems, nbytes = sum(sizes), bytes_moved(rule, pdtype, sdtype)
        for name, t in interleaved(contenders, repeats, sync).items():
            gbs = elems * nbytes / t / 1e9
            row = dict(case=case, param_dtype=str(pdtype), state_dtype=str(sdtype), implementation=name,
                       ns_per_elem=t / elems * 1e9, gb_per_s=gbs, frac_copy_bw=gbs * 1e9 / bandwidth,
                       us_per_tensor=t / len(sizes) * 1e6)
            if rule != "adam":
                row["rule"] = rule
            rows.append(row)
            dt = f"{str(pdtype)[6:]}/{str(sdtype)[6:]}"
            out(f"{case:<22} {dt:<16} {name:<38} {row['ns_per_elem']:>8.3f} {gbs:>7.1f} "
                f"{100 * row['frac_copy_bw']:>8.0f}% {row['us_per_tensor']:>9.2f}")
        del tensors, contenders
        if device == "mps":
            torch.mps.empty_cache()

    for case, sizes, pdtype, sdtype in cases:
        measure(case, sizes, pdtype, sdtype, "adam", lambda ts: _contenders(ts, pdtype, sdtype, tiers))
    for rule, pdtype, sdtype in RULE_CASES:
        measure(f"flat {numel}", [numel], pdtype, sdtype, rule,
                lambda ts: _rule_contenders(rule, ts, pdtype, sdtype, tiers))
    return rows
