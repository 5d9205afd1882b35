"""DeepSpeed glue: make DeepSpeed's own Adam optimizers run this package's prebuilt kernels.

    import mps_fused_adam.deepspeed
    mps_fused_adam.deepspeed.install()      # before or after `import deepspeed`, before deepspeed.initialize
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config)

``install()`` redirects DeepSpeed's ``FusedAdamBuilder`` and ``CPUAdamBuilder`` on the active
accelerator (MPS, CPU, CUDA...) to the facades in :mod:`.ops`, and ``FusedLionBuilder``,
``CPULionBuilder`` and ``CPUAdagradBuilder`` to those in :mod:`.rule_ops`, so
``deepspeed.ops.adam.FusedAdam``, ``DeepSpeedCPUAdam``, ``deepspeed.ops.lion.FusedLion``,
``DeepSpeedCPULion`` and ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`` (also when
``deepspeed.initialize`` builds them from a config's ``"optimizer"`` section: types Adam, AdamW,
Lion, and Adagrad with CPU offload; under ZeRO stages 0 to 3 with or without offload) run our
kernels, and no op is JIT-compiled. Lamb (``FusedLamb``, CUDA-only in DeepSpeed) is out of scope:
loading its builder raises an error that says so. With MPS present it selects DeepSpeed's MPS
accelerator, extended by :mod:`.accelerator`, and applies :mod:`.runtime_fixes`. DeepSpeed's
optimizer classes are untouched, so ZeRO's type checks pass. In a process started without a
launcher it sets the single-process rendezvous variables (:data:`SINGLE_PROCESS_DEFAULTS`), so that
``deepspeed.initialize`` does not fall into DeepSpeed's MPI discovery.

Importing this package does not import DeepSpeed; ``install()`` does.
"""
from __future__ import annotations

import os
import re
import socket
import threading
from typing import Any, Dict

from .ops import kernel_calls, reset_kernel_calls

__all__ = ["install", "installed", "kernel_calls", "reset_kernel_calls", "MIN_DEEPSPEED", "TESTED_DEEPSPEED",
           "PSEUDO_MPS_TESTED", "SINGLE_PROCESS_DEFAULTS"]

#: Oldest DeepSpeed supported: the oldest release that CI runs (0.14.0 to 0.14.3 do not import
#: with torch 2.13: their elastic agent imports names torch has removed).
MIN_DEEPSPEED = "0.14.4"
#: The release the whole test suite runs against in CI.
TESTED_DEEPSPEED = "0.19.8"
#: Releases the pseudo-MPS ZeRO tests (tests/test_deepspeed_pseudo_mps.py) pass with, one per minor
#: release from MIN_DEEPSPEED on; not run on Apple hardware. CI runs 0.19.8 in the main suite and
#: 0.14.4, 0.16.9, 0.18.9 by ci/test_deepspeed_releases.sh; 0.15.4 and 0.17.6 were run by the same
#: script on the development machine.
PSEUDO_MPS_TESTED = ("0.14.4", "0.15.4", "0.16.9", "0.17.6", "0.18.9", "0.19.8")

#: Set by install() when none of them is set (a single process started without a launcher).
#: MASTER_PORT is a free port chosen then.
SINGLE_PROCESS_DEFAULTS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": None}
# Signs of a launcher that DeepSpeed's own discovery handles (MPI, AzureML, SageMaker, DLTS).
_LAUNCHER_HINTS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE",
                   "AZUREML_EXPERIMENT_ID", "SM_TRAINING_ENV", "DLTS_JOB_ID")

_lock = threading.RLock()
_state: Dict[str, Any] = {}


def _version_tuple(version: str) -> tuple:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        match = re.match(r"\d+", piece)  # "0rc1" -> 0: a pre-release counts as its release
        parts.append(int(match.group()) if match else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(
            "mps_fused_adam.deepspeed.install() needs DeepSpeed, which is not importable "
            f"({exc}). Install it without JIT-building anything, keeping your torch: "
            f"DS_BUILD_OPS=0 pip install --no-build-isolation \"deepspeed=={TESTED_DEEPSPEED}\"") from exc
    found = getattr(deepspeed, "__version__", "unknown")
    if _version_tuple(found) < _version_tuple(MIN_DEEPSPEED):
        raise RuntimeError(f"mps_fused_adam.deepspeed.install() needs DeepSpeed >= {MIN_DEEPSPEED} "
                           f"(tested with {TESTED_DEEPSPEED}); found {found} at {deepspeed.__file__}")
    return deepspeed


def _mps_available() -> bool:
    import torch
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def _single_process_defaults() -> Dict[str, str]:
    """Set SINGLE_PROCESS_DEFAULTS when no rendezvous variable and no launcher is present."""
    if any(k in os.environ for k in SINGLE_PROCESS_DEFAULTS) or any(k in os.environ for k in _LAUNCHER_HINTS):
        return {}
    values = dict(SINGLE_PROCESS_DEFAULTS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        values["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.update(values)
    return values


def _apply_runtime_fixes(accel) -> list:
    """Rebind accelerator methods DeepSpeed bound at import; on our MPS accelerator, also the
    output-only CPU staging and the explicit ordering of host copies (see .runtime_fixes)."""
    from .runtime_fixes import one_device_engine, order_host_copies, rebind_accelerator_methods
    rebound = rebind_accelerator_methods(accel)
    if getattr(accel, "mps_fused_adam_complete_base", None) is not None:
        from .staging import install_cpu_staging
        install_cpu_staging()
        order_host_copies()
        one_device_engine()
    return rebound


def _wrap_set_accelerator(redirect) -> None:
    """Accelerators set after install() (by the user or a launcher) get the same redirection."""
    import deepspeed.accelerator as ds_accel
    import deepspeed.accelerator.real_accelerator as real
    from .builders import patch_accelerator, rebind_names, refresh_compatibility

    original = real.set_accelerator
    if getattr(original, "_mps_fused_adam", False):
        return

    def set_accelerator(accel_obj):
        original(accel_obj)
        if accel_obj is not None:
            patch_accelerator(accel_obj, _state["redirect"])
            rebind_names(accel_obj)
            refresh_compatibility(accel_obj)
            _state.setdefault("fixed", []).extend(_apply_runtime_fixes(accel_obj))

    set_accelerator._mps_fused_adam = True
    set_accelerator.__wrapped__ = original
    set_accelerator.__doc__ = original.__doc__
    real.set_accelerator = set_accelerator
    ds_accel.set_accelerator = set_accelerator


def install(block_jit: bool = True, use_mps: bool | None = None,
            single_process_defaults: bool = True) -> Dict[str, Any]:
    """Make DeepSpeed run this package's Adam kernels. Idempotent; safe before or after ``import deepspeed``.

    Args:
        block_jit: report every DeepSpeed op this package ships no kernel for (and that the
            DeepSpeed installation did not prebuild) as unavailable, so DeepSpeed takes its
            fallback paths instead of JIT-compiling (for example its CPU communication backend's
            ``deepspeed_shm_comm`` op, built during ``deepspeed.initialize``). ``False`` leaves
            those ops to DeepSpeed (a compiler and ninja are then needed if they are used).
        use_mps: ``True``: this package's MPS accelerator. ``False``: not MPS; where DeepSpeed had
            picked MPS (its own accelerator, or ours from an earlier call), its CPU accelerator
            instead, as ``DS_ACCELERATOR=cpu`` gives, rather than DeepSpeed's own MPS accelerator
            without this package's fixes; any other accelerator stays. ``None`` (default): ours
            when MPS is available, unless the ``DS_ACCELERATOR`` environment variable names
            another accelerator.
        single_process_defaults: when none of ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
            ``MASTER_ADDR``, ``MASTER_PORT`` is set and no MPI/AzureML/SageMaker launcher is
            detected, set them for one process (``0, 0, 1, 127.0.0.1``, a free port). Without
            them DeepSpeed's ``init_distributed`` tries MPI discovery and fails without mpi4py.
            Launchers (``deepspeed``, ``torchrun``) set them, and then nothing is changed.

    Returns:
        what is active: DeepSpeed's version, the accelerator's name, which builder names now load
        our kernels, the builders deliberately not provided and why (``out_of_scope``: Lamb), the
        bound names that were rebound, and the environment variables set.

    Raises:
        ImportError: DeepSpeed is not installed. RuntimeError: it is older than ``MIN_DEEPSPEED``, or
        ``use_mps=True`` where torch has no MPS device (raised before anything is changed).
    """
    deepspeed = _import_deepspeed()
    if use_mps and not _mps_available():  # before anything is changed
        raise RuntimeError("mps_fused_adam.deepspeed.install(use_mps=True): this torch has no usable MPS "
                           "device (torch.backends.mps.is_available() is False); DeepSpeed itself refuses "
                           "DS_ACCELERATOR=mps here. Leave use_mps unset to use the accelerator DeepSpeed "
                           "detects.")
    env_set = _single_process_defaults() if single_process_defaults else {}
    from deepspeed.accelerator import get_accelerator

    from .builders import (OUR_OPS, OUT_OF_SCOPE, Redirect, guard_jit_builds, patch_accelerator, rebind_names,
                           refresh_compatibility)

    with _lock:
        redirect = _state.get("redirect")
        if redirect is None or redirect.block_jit != block_jit:
            redirect = _state["redirect"] = Redirect(block_jit)
        _wrap_set_accelerator(redirect)

        refuse_mps = use_mps is False
        if use_mps is None:
            use_mps = _mps_available() and os.environ.get("DS_ACCELERATOR", "mps") == "mps"
        current = get_accelerator()
        import deepspeed.accelerator.real_accelerator as real
        if use_mps and getattr(current, "mps_fused_adam_complete_base", None) is None:
            from .accelerator import mps_accelerator
            real.set_accelerator(mps_accelerator())  # the wrapped one: patches it too
        elif refuse_mps and getattr(current, "_name", None) == "mps":
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
            real.set_accelerator(CPU_Accelerator())
        accel = get_accelerator()
        patch_accelerator(accel, redirect)
        guard_jit_builds(redirect)
        rebound = rebind_names(accel)
        refresh_compatibility(accel)
        rebound += _apply_runtime_fixes(accel) + _state.pop("fixed", [])  # after set_accelerator
        from .spawned import patch_spawned_processes
        patch_spawned_processes(install, block_jit)  # ZenFlow's and SuperOffload's optimizer processes run install() too
        previous = _state.get("report", {})
        _state["report"] = report = {
            "deepspeed": deepspeed.__version__,
            "accelerator": accel._name,
            "ours": sorted(OUR_OPS),
            "out_of_scope": dict(OUT_OF_SCOPE),
            "block_jit": block_jit,
            "rebound": sorted(set(previous.get("rebound", [])) | set(rebound)),
            "env_set": {**previous.get("env_set", {}), **env_set},
        }
        return dict(report)


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return "report" in _state
