"""DeepSpeed's spawned optimizer processes run ``install()`` before DeepSpeed's own process body.

Two DeepSpeed features run the CPU optimizer step in a process of its own, started with the
"spawn" method, which imports everything afresh and so never ran ``install()``: ZenFlow with
``"overlap_step": true`` (``zenflow_utils.zenflow_optimizer_process``) and SuperOffload
(``superoffload_utils.superoffload_optimizer_worker``, which also calls ``adam_rollback``). There
``CPUAdamBuilder().load()`` would JIT-build DeepSpeed's ``cpu_adam``, or fail without a compiler.

Each of those process targets is looked up by name in its module when the process is created, so
rebinding that name is enough: the replacement is a ``functools.partial`` of :func:`_entry`, a
function of this module, which pickles by reference into the child, where it runs ``install()``
and then the original target. A DeepSpeed release without one of the features is left alone.
"""
from __future__ import annotations

import functools
import importlib
import threading
from typing import Any, Callable, Dict, List

__all__ = ["TARGETS", "patch_spawned_processes", "original"]

# (module, process target): every optimizer process DeepSpeed 0.19.8 spawns.
TARGETS = (
    ("deepspeed.runtime.zenflow.zenflow_utils", "zenflow_optimizer_process"),
    ("deepspeed.runtime.superoffload.superoffload_utils", "superoffload_optimizer_worker"),
)

_original: Dict[str, Any] = {}
_lock = threading.Lock()


def original(name: str) -> Any:
    """DeepSpeed's own process target ``name`` (one of :data:`TARGETS`), as it was before patching."""
    return _original[name]


def _entry(name: str, install: Callable[..., Any], install_kwargs: dict, *args, **kwargs):
    """A spawned optimizer process's target: ``install()`` here, then DeepSpeed's own body.
    ``install`` arrives as an argument (it pickles by reference, as a module-level function), so
    this module does not import the package that imports it."""
    install(**install_kwargs)
    return _original[name](*args, **kwargs)


def patch_spawned_processes(install: Callable[..., Any], block_jit: bool) -> List[str]:
    """Make every spawned optimizer process of :data:`TARGETS` that this DeepSpeed has run
    ``install(block_jit=block_jit, use_mps=False)`` (``install`` is the package's) first (the processes work on CPU tensors).
    Returns the targets patched, as ``module.name``."""
    patched = []
    for module_name, name in TARGETS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a DeepSpeed without the feature (or without what it imports)
            continue
        with _lock:
            current = getattr(module, name, None)
            if current is None:
                continue
            if isinstance(current, functools.partial) and current.func is _entry:
                current = _original[name]
            _original[name] = current
            setattr(module, name, functools.partial(_entry, name, install, {"block_jit": bool(block_jit), "use_mps": False}))
        patched.append(f"{module_name}.{name}")
    return patched
