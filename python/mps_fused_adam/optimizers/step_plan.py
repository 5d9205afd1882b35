"""Cached step plans: a group's validation and bucketing done once, re-checked each step in C++.

A full step (``fused._FusedOptimizer._plan_group``) validates every tensor in Python and sorts it
into kernel calls, several times the cost of the check below (docs/benchmarks.md). Between two steps of a training loop almost nothing
of that changes: the same params, with the same dtype, shape, device and address, the same state
dicts holding the same moment tensors at the same addresses. Only the grads are new tensors
(``zero_grad(set_to_none=True)`` drops them every step). So after a step that passed the full
validation, :func:`build` records what it saw in a ``_cpu.GroupPlan``, and the next step only
proves, in one C++ loop, that

- the group's param list holds the same param objects, and the params that were skipped (no grad)
  still have none;
- each planned param has the planned dtype, shape, contiguity and address (this notices ``.data``
  assignment, resizing, a dtype or device change);
- each grad is a dense, contiguous tensor of the param's dtype, shape and device (its address is
  gathered for the kernel on the way);
- each state dict still holds the planned state tensors of its state format (Adam: ``exp_avg``,
  ``exp_avg_sq``; 8-bit: codes and block scales: state_formats.py), at the planned addresses, with
  the planned dtype and shape and contiguous (an in-place ``resize_``, ``t_`` or ``unsqueeze_`` of a
  state keeps the object and its address), and the planned step count;

and, once per step, that the optimizer's ``state`` dict is the same object with the same keys and
per-param dicts (``_cpu.DictSnapshot``: this notices ``load_state_dict`` and a replaced or removed
per-param state). The loop reads the tensors through torch's AOTInductor C shim where this torch
has it (``src/cpu/tensor_handles.h``: a plan holds a handle per param and state tensor, which
sees any later change of its metadata, and each check makes one per grad), otherwise through
their ordinary Python attributes; ``MPS_FUSED_ADAM_TENSOR_HANDLES=0`` chooses the latter. In a
group of hundreds of tensors the shim reads, mostly cache misses after a kernel pass, are shared
by the kernel's threads (``torch.get_num_threads()``): on torch's OpenMP threads, those of the
planned params and states while the caller makes the Python reads (state dicts, ``p.grad``), then
those of the new grads.
Any difference, or anything the check cannot read, sends the group through the
full validation again, which raises the same errors as before (naming the parameter, what was
expected and what was found) or runs the step and plans anew. The check writes nothing, so a
rejected step still changes nothing.
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import dtensor
from ..backends import Addressed, Kernel


@dataclass
class Bucket:
    """One kernel call of a planned group: entries ``[begin, end)`` of its ``GroupPlan``."""

    device: torch.device
    begin: int
    end: int
    step: int  # the step count the entries have now; the next update takes step + 1
    params: Addressed = field(repr=False)
    states: list[Addressed] = field(repr=False)  # one list per state of the format
    fmt: Any = None  # the entries' state format (state_formats.py): its rule is the kernel's
    kernel: Any = None  # backends.Kernel of the bucket
    sts: list = field(default_factory=list, repr=False)  # the entries' state dicts (stochastic rounding's seeds)


@dataclass
class Plan:
    """A group's plan: its ``_cpu.GroupPlan`` and its buckets, for one param list object."""

    params: list = field(repr=False)
    native: Any  # _cpu.GroupPlan
    buckets: list[Bucket]
    uses: int = 0  # steps it served
    backoff: int = 1  # full steps to wait before planning again if it fails before serving one


@dataclass
class Wait:
    """No plan for ``left`` more full steps: the group's last plan failed at once (its grads come
    and go, or are not contiguous), so planning again each step would only add cost."""

    left: int
    length: int


MAX_WAIT = 64


def native() -> Any:
    """The ``_cpu`` extension, which holds the C++ checks; None where it is not built."""
    try:
        from .. import _cpu
    except ImportError:
        return None
    if not _HANDLES_TRIED:
        _enable_tensor_handles(_cpu)
    return _cpu


_HANDLES_TRIED: list = []


def _enable_tensor_handles(cpu: Any) -> bool:
    """Let the checks read tensors through torch's AOTInductor C shim (``src/cpu/tensor_handles.h``:
    a stable C ABI in libtorch_cpu, found at run time): about a third of the per-tensor cost of
    reading their Python attributes. Where this torch or platform lacks it, the checks read the
    attributes as before."""
    _HANDLES_TRIED.append(True)
    setting = os.environ.get("MPS_FUSED_ADAM_TENSOR_HANDLES", "1")
    if setting == "0":
        return False
    if setting not in ("1", ""):  # once per process, as this runs once
        warnings.warn(f"mps_fused_adam: MPS_FUSED_ADAM_TENSOR_HANDLES={setting!r} is not 0 or 1; using the "
                      f"tensor handles where this torch has them (the default)", RuntimeWarning)
    alloc = getattr(getattr(torch._C, "_aoti", None), "unsafe_alloc_void_ptrs_from_tensors", None)
    name = {"darwin": "libtorch_cpu.dylib", "win32": "torch_cpu.dll"}.get(sys.platform, "libtorch_cpu.so")
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", name)
    return alloc is not None and os.path.exists(lib) and bool(cpu.enable_tensor_handles(lib, alloc))


def replan(native_module: Any, previous: Any, params: list, state: Any, policy: Any) -> Any:
    """What a group that just took the full path keeps for the next step: a new :class:`Plan`, or
    a :class:`Wait` when plans keep failing for it (doubling up to ``MAX_WAIT`` steps)."""
    if isinstance(previous, Wait) and previous.left > 0:
        previous.left -= 1
        return previous
    if isinstance(previous, Plan) and previous.uses == 0:
        length = min(2 * previous.backoff, MAX_WAIT)
        return Wait(length, length)
    plan = build(native_module, params, state, policy)
    if plan is None:
        return Wait(MAX_WAIT, MAX_WAIT)
    if isinstance(previous, Wait):
        plan.backoff = previous.length
    return plan


def _addressed(tensors: list[torch.Tensor], addresses: list[int], with_numels: bool = False) -> Addressed:
    out = Addressed(tensors)
    out.addresses = addresses
    out.numels = [t.numel() for t in tensors] if with_numels else None
    return out


def build(native_module: Any, params: list, state: Any, policy: Any) -> Optional[Plan]:
    """The plan of a group whose step has just passed the full validation, or None when the group
    cannot be planned (a non-contiguous param or state tensor: those go through staging copies;
    a DTensor param, whose local shards the full path steps: dtensor.py).
    ``policy``: the optimizer's state formats (state_formats.py), each param's state in one of them."""
    if dtensor.any_dtensor(params):
        return None
    state_get = state.get
    rows = []
    idle: list = []
    for i, p in enumerate(params):
        st = state_get(p)
        if not st:
            idle.append((i, True) if p.grad is not None and p.numel() == 0 else i)  # empty: skipped whatever its grad
            continue
        if p.grad is None:
            idle.append(i)
            continue
        fmt = policy.of_state(st)
        tensors = tuple(st[name] for name in fmt.names)
        if not (p.is_contiguous() and all(t.is_contiguous() for t in tensors)):
            return None
        rows.append((p.device, p.dtype, fmt, tensors[0].dtype, int(st["step"]), i, p, st, tensors))
    # Kernel calls as the full step makes them: one per (device, param dtype, format, state dtype, step).
    order: dict[tuple, list] = {}
    for row in rows:
        order.setdefault(row[:5], []).append(row)
    default = policy.formats[0].names
    active, buckets = [], []
    for (device, dtype, fmt, sdtype, step), members in order.items():
        begin = len(active)
        own = () if fmt.names == default else (fmt.names,)
        for _, _, _, _, _, i, p, st, tensors in members:
            active.append((i, p, dtype, p.shape, device, p.data_ptr(), st, tensors,
                           tuple(t.data_ptr() for t in tensors), st["step"], *own))
        ps = [r[6] for r in members]
        per_state = [[r[8][k] for r in members] for k in range(len(fmt.names))]
        buckets.append(Bucket(device, begin, len(active), step,
                              _addressed(ps, [t.data_ptr() for t in ps], with_numels=True),
                              [_addressed(ts, [t.data_ptr() for t in ts]) for ts in per_state],
                              fmt, Kernel(fmt.rule, dtype, sdtype), [r[7] for r in members]))
    native = native_module.GroupPlan(params, list(default), active, idle)
    return Plan(params, native, buckets)


def check(plan: Plan, params: list) -> Optional[list[tuple[Bucket, Addressed, None]]]:
    """Each bucket with this step's grads (and None: no stochastic-rounding seeds), or None when
    the group must take the full path."""
    if plan.params is not params:
        return None
    grads: list = []
    addresses: list = []
    if not plan.native.check(params, grads, addresses, torch.get_num_threads()):
        return None
    return [(b, _addressed(grads[b.begin:b.end], addresses[b.begin:b.end]), None) for b in plan.buckets]
