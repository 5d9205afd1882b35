"""Optimizer-process bodies for tests/test_deepspeed_zenflow.py (spawned: they must be importable
by module name, so they live here rather than in the test module)."""
from __future__ import annotations


def optimizer_process(groups, ctrl, ready, affinity, adamw_mode, destroy_first=False):
    """What DeepSpeed's zenflow_utils.zenflow_optimizer_process does with the op, on our facade:
    groups are (param, grad0, grad1, exp_avg0, exp_avg1, exp_avg_sq0, exp_avg_sq1, stale)."""
    from mps_fused_adam.deepspeed.ops import CPUAdamOp

    op = CPUAdamOp()
    op.create_adam(0, 1e-3, 0.9, 0.999, 1e-8, 0.0, adamw_mode, False)
    handle = op.zenflow_adam_create(0, list(affinity))
    for group in groups:
        op.zenflow_adam_register_group(handle, *group)
    if destroy_first:  # the next step fails in this process, as an OOM or a bad tensor would
        op.destroy_adam(0)
    ready.set()
    op.zenflow_adam_run_worker(handle, ctrl.data_ptr())
    op.zenflow_adam_destroy(handle)
    op.destroy_adam(0)
