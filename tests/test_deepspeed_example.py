"""examples/deepspeed_zero.py runs as a single process without a launcher, and as two processes
under torchrun, without a compiler."""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "support" / "deepspeed_support"))
import dsenv  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "deepspeed_zero.py"


import pytest  # noqa: E402


# AdamW runs as ZeRO-3 with optimizer offload (ZeRO-3's collectives are what torch warns about);
# Lion and Adagrad as ZeRO-2 with optimizer offload (DeepSpeedCPUAdagrad needs offload).
@pytest.mark.parametrize("optimizer,stage,cls,op", [
    ("adamw", "3", "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam", "adam_update"),
    ("lion", "2", "deepspeed.ops.lion.cpu_lion.DeepSpeedCPULion", "lion_update"),
    ("adagrad", "2", "deepspeed.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad", "adagrad_update"),
])
def test_example_offload_single_process(tmp_path, optimizer, stage, cls, op):
    dsenv.require_deepspeed()
    env = dsenv.no_compiler_env(tmp_path)
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)  # the example must set them up itself
    run = dsenv.run_python([str(EXAMPLE), "--optimizer", optimizer, "--stage", stage, "--offload-optimizer",
                            "--steps", "5", "--hidden", "64"], env, timeout=300)
    out = run.stdout
    # ZeRO's collectives make torch 2.13 warn at every step; the example filters exactly those.
    assert "FutureWarning" not in run.stderr, run.stderr
    assert re.search(r"^no launcher: install\(\) set LOCAL_RANK=0, MASTER_ADDR=127.0.0.1, MASTER_PORT=\d+, "
                     r"RANK=0, WORLD_SIZE=1$", out, re.M), out
    assert "rank 0 of 1, accelerator: cpu" in out, out
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)$", out, re.M)]
    assert len(losses) == 5, out
    assert all(b < a for a, b in zip(losses, losses[1:])), f"the loss did not fall at every step: {losses}"
    assert f"DeepSpeed optimizer: {cls}" in out, out
    ran = out.split("kernels that ran")[1].splitlines()[0]
    calls = re.findall(r"(\w+):(\w+) -> (\d+)", ran)
    assert [(name, int(n)) for name, _, n in calls] == [(op, 5)], ran
    assert dsenv.extensions_built(tmp_path) == []


def test_example_under_torchrun_two_processes(tmp_path):
    """The launcher case: torchrun sets the rendezvous variables, install() sets none."""
    dsenv.require_deepspeed()
    env = dsenv.no_compiler_env(tmp_path, OMP_NUM_THREADS="1")
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)
    out = dsenv.run_python(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            str(dsenv.free_port()), str(EXAMPLE), "--stage", "3", "--steps", "3", "--hidden", "32"],
                           env, timeout=300).stdout
    assert "rank 0 of 2, accelerator: cpu" in out and "rank 1 of 2, accelerator: cpu" in out, out
    assert "no launcher" not in out
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)$", out, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0], out
    assert re.search(r"multi_tensor_adam:(\w+) -> 3", out), out
    assert dsenv.extensions_built(tmp_path) == []
