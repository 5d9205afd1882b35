"""Op builders that hand DeepSpeed our kernels, and the redirection of DeepSpeed's builder lookups.

DeepSpeed finds an op in two ways, and both are redirected (with ``block_jit=True``, DeepSpeed's
``OpBuilder.jit_load`` also refuses, for a builder class reached any other way: ``guard_jit_builds``):

1. ``get_accelerator().get_op_builder(name)`` / ``create_op_builder(name)``: wrapped on the
   accelerator instance (and on any accelerator set later with ``set_accelerator``).
2. Names bound at import time: ``deepspeed.ops.op_builder`` binds ``FusedAdamBuilder`` etc. to the
   active accelerator's classes when first imported, and modules such as
   ``deepspeed.ops.adam.fused_adam`` import those names. Every such binding in a loaded
   ``deepspeed`` module is rebound (again at each ``install()``, so a later policy applies); modules
   imported later that bind through ``deepspeed.ops.op_builder`` get the redirected classes.

The builder classes are subclasses of the accelerator's own builder for that op, so everything
DeepSpeed reads from a builder (``NAME``, ``BUILD_VAR``, ``absolute_name()``...) is unchanged;
only ``load``, ``jit_load`` and ``is_compatible`` differ. Ops we ship no kernel for are, with
``block_jit=True``, replaced by subclasses that report themselves incompatible and refuse to
build, so DeepSpeed takes its fallback paths (for example plain torch.distributed instead of the
``deepspeed_shm_comm`` op) instead of invoking a compiler. Ops that the DeepSpeed installation
prebuilt (``DS_BUILD_OPS=1``) are left alone: loading them compiles nothing.

This module imports DeepSpeed; it is imported only by ``install()``.
"""
from __future__ import annotations

import sys
import threading
from typing import Callable, Dict, Optional

from .ops import CPU_ADAM_OP, FUSED_ADAM_OP
from .rule_ops import CPU_ADAGRAD_OP, CPU_LION_OP, FUSED_LION_OP

# builder class name -> (the op object its load() returns, DeepSpeed's op NAME, the package
# DeepSpeed's absolute_name() places it in)
_OPS = {
    "FusedAdamBuilder": (FUSED_ADAM_OP, "fused_adam", "adam"),
    "CPUAdamBuilder": (CPU_ADAM_OP, "cpu_adam", "adam"),
    "FusedLionBuilder": (FUSED_LION_OP, "fused_lion", "lion"),
    "CPULionBuilder": (CPU_LION_OP, "cpu_lion", "lion"),
    "CPUAdagradBuilder": (CPU_ADAGRAD_OP, "cpu_adagrad", "adagrad"),
}
OUR_OPS = {name: op for name, (op, _, _) in _OPS.items()}

# Ops a DeepSpeed config can ask for that this package deliberately does not provide, and why.
OUT_OF_SCOPE = {
    "FusedLambBuilder": "Lamb (FusedLamb) is out of scope for mps_fused_adam: DeepSpeed's kernel is "
                        "CUDA-only and this package ships no Lamb kernel",
}

_lock = threading.RLock()
# Generated classes, keyed by (original class, kind), so repeated lookups and repeated install()
# calls hand DeepSpeed the very same class objects (identity checks and caches keep working).
_generated: Dict[tuple, type] = {}


def _is_generated(cls) -> bool:
    return isinstance(cls, type) and getattr(cls, "_mps_fused_adam_kind", None) is not None


def _prebuilt_ops() -> set:
    try:
        from deepspeed.git_version_info import installed_ops
    except Exception:  # a source checkout without the generated file: nothing is prebuilt
        return set()
    return {name for name, built in installed_ops.items() if built}


def _our_builder(orig: Optional[type], class_name: str, op) -> type:
    key = (orig, class_name, "ours")
    with _lock:
        cls = _generated.get(key)
        if cls is not None:
            return cls
        op_name, package = _OPS[class_name][1:]
        if orig is None or getattr(orig, "NAME", op_name) != op_name:
            # The accelerator has no builder of its own for this op (DeepSpeed's CPU and MPS
            # accelerators return NotImplementedBuilder for FusedLionBuilder, the MPS one also for
            # the CPU Lion and Adagrad builders): build on the generic base instead.
            from deepspeed.ops.op_builder.builder import OpBuilder
            orig = OpBuilder

        def __init__(self, *args, **kwargs):
            try:
                orig.__init__(self, *args, **kwargs)
            except TypeError:  # the generic OpBuilder base needs the name
                orig.__init__(self, name=op_name)

        def load(self, verbose=True):
            return op

        def is_compatible(self, verbose=False):
            return True

        attrs = dict(
            __init__=__init__, load=load, jit_load=load, is_compatible=is_compatible,
            NAME=getattr(orig, "NAME", op_name),
            absolute_name=lambda self: f"deepspeed.ops.{package}.{op_name}_op",
            sources=lambda self: [],
            _mps_fused_adam_kind="ours", __module__=__name__,
            __doc__=f"DeepSpeed's {class_name}, loading mps_fused_adam's prebuilt kernels (never JIT-builds).",
        )
        cls = _generated[key] = type(class_name, (orig,), attrs)
        return cls


def _blocked_message(class_name: str, op_name: str) -> str:
    why = OUT_OF_SCOPE.get(class_name)
    return ((why + ". " if why else "") +
            f"DeepSpeed op '{op_name}' ({class_name}) would be JIT-compiled, which "
            f"mps_fused_adam.deepspeed.install(block_jit=True) prevents: this package ships kernels for "
            f"{', '.join(sorted(OUR_OPS))} only. Call install(block_jit=False) to let DeepSpeed build it.")


def _blocked_builder(orig: type, class_name: str) -> type:
    key = (orig, class_name, "blocked")
    with _lock:
        cls = _generated.get(key)
        if cls is not None:
            return cls
        op_name = getattr(orig, "NAME", class_name)

        def is_compatible(self, verbose=False):
            return False

        def load(self, verbose=True):
            raise RuntimeError(_blocked_message(class_name, op_name))

        attrs = dict(is_compatible=is_compatible, load=load, jit_load=load, builder=load,
                     _mps_fused_adam_kind="blocked", __module__=__name__,
                     __doc__=f"DeepSpeed's {class_name}, reported unavailable so nothing is JIT-built.")
        cls = _generated[key] = type(class_name, (orig,), attrs)
        return cls


class Redirect:
    """The lookup policy: which class DeepSpeed gets for a builder name."""

    def __init__(self, block_jit: bool) -> None:
        self.block_jit = block_jit
        self.prebuilt = _prebuilt_ops()

    def resolve(self, class_name: str, orig_get: Callable[[str], Optional[type]]) -> Optional[type]:
        orig = orig_get(class_name)
        if _is_generated(orig):  # already redirected (an accelerator wrapped twice)
            return orig
        if class_name in OUR_OPS:
            return _our_builder(orig, class_name, OUR_OPS[class_name])
        if orig is None or not self.block_jit:
            return orig
        if getattr(orig, "NAME", None) in self.prebuilt:
            return orig
        return _blocked_builder(orig, class_name)


def patch_accelerator(accel, redirect: Redirect) -> None:
    """Route ``accel``'s builder lookups through ``redirect`` (idempotent; policy can be updated)."""
    if getattr(accel, "_mps_fused_adam_redirect", None) is None:
        orig_get = accel.get_op_builder  # bound method of the accelerator's class

        def get_op_builder(class_name):
            return accel._mps_fused_adam_redirect.resolve(class_name, orig_get)

        def create_op_builder(class_name):
            cls = get_op_builder(class_name)
            return cls() if cls is not None else None

        accel.get_op_builder = get_op_builder
        accel.create_op_builder = create_op_builder
    accel._mps_fused_adam_redirect = redirect


def rebind_names(accel) -> list:
    """Rebind builder classes bound by name in loaded DeepSpeed modules; returns ``module.name`` rebound."""
    rebound = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == "deepspeed" or mod_name.startswith("deepspeed.")):
            continue
        # The accelerators' own builder packages define the originals that get_op_builder imports.
        if mod_name.startswith("deepspeed.ops.op_builder.") or mod_name == __name__:
            continue
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            if not (attr.endswith("Builder") and isinstance(value, type)):
                continue
            # DeepSpeed's own classes, and ours from an earlier install() (rebound again, so a
            # later install(block_jit=False) unblocks names an earlier one blocked).
            if not (_is_generated(value)
                    or getattr(value, "__module__", "").startswith(("deepspeed.ops.op_builder", "op_builder"))):
                continue
            if attr in ("OpBuilder", "CUDAOpBuilder", "CPUOpBuilder", "MPSOpBuilder", "MetalOpBuilder",
                        "TorchCPUOpBuilder", "SYCLOpBuilder", "NPUOpBuilder"):
                continue  # base classes, not ops
            new = accel.get_op_builder(attr)
            if new is not None and new is not value:
                namespace[attr] = new
                rebound.append(f"{mod_name}.{attr}")
    return rebound


_jit_guard: Dict[str, object] = {}


def guard_jit_builds(redirect: Redirect) -> None:
    """Make DeepSpeed's ``OpBuilder.jit_load``, the one place every JIT build goes through, follow
    ``redirect``'s ``block_jit``: the name rebinding misses a builder class imported from its
    defining submodule after ``install()`` (``deepspeed.ops.pin_memory`` does so), and this does
    not. Ours never reach it (their ``load`` returns our op), nor do prebuilt ops (``load`` imports
    them). Idempotent; the policy follows the latest ``install()``."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    with _lock:
        _jit_guard["redirect"] = redirect
        if "original" in _jit_guard:
            return
        original = _jit_guard["original"] = OpBuilder.__dict__["jit_load"]

        def jit_load(self, verbose=True):
            if _jit_guard["redirect"].block_jit:
                raise RuntimeError(_blocked_message(type(self).__name__, getattr(self, "name", type(self).__name__)))
            return original(self, verbose)

        jit_load.__doc__ = original.__doc__
        OpBuilder.jit_load = jit_load


def refresh_compatibility(accel) -> None:
    """Make DeepSpeed's cached op tables agree with the redirected builders.

    ``deepspeed.ops.__compatible_ops__`` is computed once, on first access, from
    ``all_ops.ALL_OPS``; either may already exist if DeepSpeed was used before ``install()``.
    """
    all_ops = sys.modules.get("deepspeed.ops.op_builder.all_ops")
    if all_ops is not None:
        for op_name, builder in list(all_ops.ALL_OPS.items()):
            replacement = accel.create_op_builder(type(builder).__name__)
            if replacement is not None:
                all_ops.ALL_OPS[op_name] = replacement
    ops_pkg = sys.modules.get("deepspeed.ops")
    table = ops_pkg.__dict__.get("__compatible_ops__") if ops_pkg is not None else None
    if table is not None and all_ops is not None:  # the probe imports all_ops, so both exist
        for op_name, builder in all_ops.ALL_OPS.items():
            table[op_name] = bool(builder.is_compatible())
