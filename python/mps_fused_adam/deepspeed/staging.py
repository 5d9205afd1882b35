"""CPU staging of MPS tensors for DeepSpeed's gloo collectives, copying back outputs only.

gloo, the only torch.distributed backend on macOS, cannot read or write MPS memory, so every
MPS tensor argument of a collective is replaced by a CPU copy, and the collective's *outputs* are
copied back to the device once the collective has completed (at once, or on ``wait()`` of the
returned work when it is asynchronous).

Outputs only, and by name: ZeRO passes arguments that alias each other. ZeRO-3's gradient
reduce-scatter passes an output that is a slice of its input, and its parameter all-gather an
input that is a slice of its output. Copying every argument back in argument order (what
DeepSpeed 0.19.8's own ``stage_on_cpu`` and this package's earlier wrapper did) writes the
input's pre-collective copy over the reduced result: each rank silently keeps its own unreduced
gradients. Inputs are never written back here, so aliasing is harmless: the device tensors
receive exactly what the collective wrote, as they would from a backend that reads device memory.

The wrapper goes around every release's ``TorchBackend`` methods, DeepSpeed 0.19.8's own staged
ones included: their arguments then arrive on the CPU and DeepSpeed's staging does nothing. The
argument names come from :data:`SIGNATURES` (DeepSpeed 0.14 to 0.19 share them; 0.19's staged
methods expose only ``*args, **kwargs``).

This module imports DeepSpeed only in :func:`install_cpu_staging`.
"""
from __future__ import annotations

import copy
import functools
from typing import Callable, Dict, List, Tuple

import torch

__all__ = ["SIGNATURES", "OUTPUTS", "install_cpu_staging", "staged", "needs_staging", "to_host"]

#: Parameter names (after ``self``) of DeepSpeed's ``TorchBackend`` collectives, as in 0.14 to 0.19.
SIGNATURES: Dict[str, Tuple[str, ...]] = {
    "all_reduce": ("tensor", "op", "group", "async_op"),
    "inference_all_reduce": ("tensor", "op", "group"),
    "all_reduce_coalesced": ("tensors", "op", "group", "async_op"),
    "reduce": ("tensor", "dst", "op", "group", "async_op"),
    "broadcast": ("tensor", "src", "group", "async_op"),
    "all_gather": ("tensor_list", "tensor", "group", "async_op"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor", "group", "async_op"),
    "all_gather_base": ("output_tensor", "input_tensor", "group", "async_op"),
    "all_gather_coalesced": ("output_tensors", "input_tensors", "group", "async_op"),
    "reduce_scatter": ("output", "input_list", "op", "group", "async_op"),
    "reduce_scatter_tensor": ("output_tensor", "input_tensor", "op", "group", "async_op"),
    "all_to_all_single": ("output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"),
    "all_to_all": ("output_tensor_list", "input_tensor_list", "group", "async_op"),
    "send": ("tensor", "dst", "group", "tag"),
    "recv": ("tensor", "src", "group", "tag"),
    "isend": ("tensor", "dst", "group", "tag"),
    "irecv": ("tensor", "src", "group", "tag"),
    "gather": ("tensor", "gather_list", "dst", "group", "async_op"),
    "scatter": ("tensor", "scatter_list", "src", "group", "async_op"),
}

#: The arguments each collective writes (copied back); every other tensor argument is read only.
OUTPUTS: Dict[str, Tuple[str, ...]] = {
    "all_reduce": ("tensor",), "inference_all_reduce": ("tensor",), "all_reduce_coalesced": ("tensors",),
    "reduce": ("tensor",), "broadcast": ("tensor",),
    "all_gather": ("tensor_list",), "all_gather_into_tensor": ("output_tensor",),
    "all_gather_base": ("output_tensor",), "all_gather_coalesced": ("output_tensors",),
    "reduce_scatter": ("output",), "reduce_scatter_tensor": ("output_tensor",),
    "all_to_all_single": ("output",), "all_to_all": ("output_tensor_list",),
    "send": (), "isend": (), "recv": ("tensor",), "irecv": ("tensor",),
    "gather": ("gather_list",), "scatter": ("tensor",),
}

# Asynchronous by contract, without an async_op argument.
_ALWAYS_ASYNC = ("isend", "irecv")

#: The torch device type whose tensors gloo cannot touch. The pseudo-MPS test mode
#: (tests/support/deepspeed_support/pseudo_mps.py) sets it to "cpu", so that staging really happens there.
DEVICE_TYPE = "mps"


def needs_staging(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE


def to_host(t: torch.Tensor) -> torch.Tensor:
    # detach: collectives are outside autograd (a backend writes the memory directly); a copy that
    # required grad makes torch's gloo all_gather_into_tensor fail on its split views (seen with
    # DeepSpeed 0.18.9's ZeRO-2 step). copy=True: a real copy also when the "device" is the CPU
    # (pseudo-MPS mode), as on a Mac.
    return t.detach().to("cpu", copy=True)


def _copy_back(device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> None:
    # Into the same memory, outside autograd, as a backend writing device memory would.
    device_tensor.detach().copy_(host_tensor)


class _StagedWork:
    """A collective's work handle whose ``wait()`` also copies the outputs back (once)."""

    def __init__(self, work, copy_back: Callable[[], None]):
        self._work, self._copy_back = work, copy_back

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs) if self._work is not None else None
        self._copy_back()
        return result

    def is_completed(self):
        return self._work is None or self._work.is_completed()

    def __getattr__(self, name):  # anything else a caller asks of the real handle
        return getattr(self._work, name)


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    done = []

    def run():
        if not done:
            done.append(True)
            fn()
    return run


def staged(name: str, func: Callable) -> Callable:
    """Wrap the ``TorchBackend`` collective ``name``: MPS tensors (also in lists) go through CPU
    copies, and only the outputs named in :data:`OUTPUTS` are copied back after completion."""
    params = SIGNATURES[name]
    outputs = set(OUTPUTS[name])

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        if len(args) > len(params):
            raise TypeError(f"{name}() takes at most {len(params)} arguments after self, got {len(args)}")
        bound = dict(zip(params, args))
        bound.update(kwargs)
        pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (device output, its CPU stand-in)

        def stage(value, is_output):
            if needs_staging(value):
                host = to_host(value)
                if is_output:
                    pairs.append((value, host))
                return host
            if isinstance(value, (list, tuple)) and any(needs_staging(t) for t in value):
                return type(value)(stage(t, is_output) for t in value)
            return value

        staged_args = {key: stage(value, key in outputs) for key, value in bound.items()}
        if not any(staged_args[k] is not bound[k] for k in bound):
            return func(self, *args, **kwargs)
        work = func(self, **staged_args)

        def copy_back():
            for device_tensor, host_tensor in pairs:
                _copy_back(device_tensor, host_tensor)

        if name in _ALWAYS_ASYNC or staged_args.get("async_op", False):
            # torch.distributed returns None for ranks outside the group: nothing to copy then.
            return _StagedWork(work, _once(copy_back)) if work is not None else None
        copy_back()
        return work

    wrapper._mps_fused_adam_staged = True
    return wrapper


def staged_batch_isend_irecv(func: Callable) -> Callable:
    """``batch_isend_irecv(p2p_op_list)``: each op's tensor staged. Where the backend returns one
    work handle per op (gloo, the backend on macOS), waiting on a receive's own handle copies its
    tensor back, as waiting on it delivers the data without staging; where it returns fewer
    (coalesced, one handle for the batch), the received tensors are copied back once every
    returned handle has been waited on."""

    @functools.wraps(func)
    def wrapper(self, p2p_op_list):
        ops, pairs = [], {}  # pairs: op index -> (device tensor, its CPU stand-in), receives only
        for index, op in enumerate(p2p_op_list):
            tensor = getattr(op, "tensor", None)
            if not needs_staging(tensor):
                ops.append(op)
                continue
            host = to_host(tensor)
            kind = getattr(op, "op", None)
            kind = kind if isinstance(kind, str) else getattr(kind, "__name__", "")
            if kind in ("irecv", "recv"):
                pairs[index] = (tensor, host)
            clone = copy.copy(op)
            clone.tensor = host
            ops.append(clone)
        works = func(self, ops)
        if not pairs:
            return works
        handles = list(works) if works is not None else []
        if len(handles) == len(ops):
            def copy_back_own(index):
                if index in pairs:
                    _copy_back(*pairs[index])
            return [_StagedWork(w, _once(functools.partial(copy_back_own, i))) for i, w in enumerate(handles)]
        waited: set = set()

        def copy_back_when_all_waited(index):
            waited.add(index)
            if len(waited) == len(handles):
                for device_tensor, host_tensor in pairs.values():
                    _copy_back(device_tensor, host_tensor)

        return [_StagedWork(w, _once(functools.partial(copy_back_when_all_waited, i))) for i, w in enumerate(handles)]

    wrapper._mps_fused_adam_staged = True
    return wrapper


def install_cpu_staging(backend_cls=None) -> List[str]:
    """Wrap the collectives of DeepSpeed's ``TorchBackend`` (or ``backend_cls``) with CPU
    staging, once per method; returns the names wrapped now.

    Also DeepSpeed 0.19's already staged methods are wrapped: ours runs first, so theirs sees
    CPU tensors only and copies nothing back (see the module docstring for why that matters).
    """
    if backend_cls is None:
        from deepspeed.comm.torch import TorchBackend as backend_cls

    wrapped = []
    for name in SIGNATURES:
        fn = backend_cls.__dict__.get(name) or getattr(backend_cls, name, None)
        if fn is None or getattr(fn, "_mps_fused_adam_staged", False):
            continue
        setattr(backend_cls, name, staged(name, fn))
        wrapped.append(name)
    fn = getattr(backend_cls, "batch_isend_irecv", None)
    if fn is not None and not getattr(fn, "_mps_fused_adam_staged", False):
        backend_cls.batch_isend_irecv = staged_batch_isend_irecv(fn)
        wrapped.append("batch_isend_irecv")
    return wrapped
