"""Train with a ZenFlow ZeRO configuration (ZeRO-Offload, ``"overlap_step": true``: the CPU Adam step
runs in ZenFlow's optimizer process) on DeepSpeed's CPU accelerator over gloo; print JSON.

Used by tests/test_deepspeed_zenflow_zero.py in subprocesses with no compiler and no ninja:

    PYTHONPATH=python python tests/support/deepspeed_support/zenflow_runner.py ours s2:fp32 s3:bf16

The first argument picks the kernel behind ``CPUAdamBuilder`` in both processes: ``ours``
(``install()``), or ``deepspeed`` (DeepSpeed's own ``cpu_adam`` op, JIT-built beforehand and named
by MFA_DS_CPU_ADAM_SO; ``install()`` still blocks every other JIT build), the reference. Each
further argument is ``<s1|s2|s3>:<fp32|bf16>``, optionally ``:half-lr`` (the negative control).
World size and rank come from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (1 process when unset).
The last line of stdout is one JSON object.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time

import torch

import zero_runner  # noqa: E402  (this folder is sys.path[0] when run as a script)

STEPS = 8
MICRO_BATCH = zero_runner.MICRO_BATCH
LR, WD = 1e-2, 0.01


def _load_deepspeed_op():
    import importlib.util
    spec = importlib.util.spec_from_file_location("cpu_adam", os.environ["MFA_DS_CPU_ADAM_SO"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use_deepspeeds_op() -> None:
    """This process's CPUAdamBuilder loads DeepSpeed's own compiled op (install() already ran)."""
    from deepspeed.accelerator import get_accelerator
    op = _load_deepspeed_op()
    get_accelerator().get_op_builder("CPUAdamBuilder").load = lambda self, verbose=True: op


def _reference_child(*args, **kwargs):
    """ZenFlow's optimizer process in the reference run: install(), then DeepSpeed's own op."""
    import mps_fused_adam.deepspeed as mfd
    from mps_fused_adam.deepspeed import spawned
    mfd.install(use_mps=False)
    use_deepspeeds_op()
    return spawned.original("zenflow_optimizer_process")(*args, **kwargs)


def make_data(world_size: int):
    return zero_runner.make_data(world_size, STEPS)


def ds_config(stage: int, dtype: str, lr: float) -> dict:
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True,
            "zenflow": {"topk_ratio": 0.2, "select_strategy": "step", "select_interval": 2, "update_interval": 2,
                        "overlap_step": True, "full_warm_up_rounds": 1}}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0, stage3_prefetch_bucket_size=0)
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": WD}},
            "zero_optimization": zero, "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": dtype == "bf16"}, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


def run_one(stage: int, dtype: str, lr: float, rank: int, world_size: int) -> dict:
    import deepspeed
    from mps_fused_adam.deepspeed import zenflow
    from mps_fused_adam.deepspeed.ops import CPU_ADAM_OP

    model = zero_runner.make_model()
    xs, ys = make_data(world_size)
    sl = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(stage, dtype, lr))
    losses = []
    for step in range(STEPS):
        x = xs[step][sl]
        if dtype == "bf16":
            x = x.to(torch.bfloat16)
        loss = ((engine(x).float() - ys[step][sl]) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    zo = engine.optimizer
    ctrl = getattr(zo, "zf_ctrl", None)
    proc = getattr(zo, "process", None)
    ours = getattr(zo, "zf_op", None) is CPU_ADAM_OP
    result = {"stage": stage, "dtype": dtype, "lr": lr, "losses": losses, "seconds": seconds,
              "optimizer_class": f"{type(zo).__module__}.{type(zo).__qualname__}", "zf_op_is_ours": ours,
              # What our optimizer process recorded (DeepSpeed's own op keeps no such record).
              "control": zenflow.control_info(ctrl.data_ptr()) if ctrl is not None and ours else None,
              "process_alive": bool(proc is not None and proc.is_alive())}
    if ctrl is not None and ours:
        zo.zf_op.zenflow_adam_ctrl_exit(ctrl.data_ptr())  # DeepSpeed leaves its daemon process running
        proc.join(timeout=30)
        result["process_exitcode"] = proc.exitcode
    engine.destroy()
    return result


def main(argv: list) -> int:
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29512"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kernel, runs = argv[0], argv[1:]

    import mps_fused_adam.deepspeed as mfd
    report = mfd.install()
    if kernel == "deepspeed":
        use_deepspeeds_op()
        import deepspeed.runtime.zenflow.zenflow_utils as zu
        zu.zenflow_optimizer_process = functools.partial(_reference_child)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for arg in runs:
        parts = arg.split(":")
        lr = LR / 2 if parts[2:] == ["half-lr"] else LR
        results.append(run_one(int(parts[0][1:]), parts[1], lr, rank, world_size))
    print("\nMFA-RESULT " + json.dumps({"kernel": kernel, "install": report, "results": results}), flush=True)
    # The result is out: leave without interpreter finalization, where gloo's threads can abort
    # the process ("terminate called without an active exception", pytorch/pytorch#190489; seen
    # once in CI). A barrier and destroy_process_group() here hung under pseudo-MPS.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
