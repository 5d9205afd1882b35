"""examples/deepspeed_zero.py runs as a single process without a launcher and without a compiler."""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "deepspeed_support"))
import dsenv  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "deepspeed_zero.py"


import pytest  # noqa: E402


@pytest.mark.parametrize("optimizer,cls,op", [
    ("adamw", "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam", "adam_update"),
    ("lion", "deepspeed.ops.lion.cpu_lion.DeepSpeedCPULion", "lion_update"),
    ("adagrad", "deepspeed.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad", "adagrad_update"),
])
def test_example_zero2_offload(tmp_path, optimizer, cls, op):
    dsenv.require_deepspeed()
    env = dsenv.no_compiler_env(tmp_path)
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)  # the example must set them up itself
    out = dsenv.run_python([str(EXAMPLE), "--optimizer", optimizer, "--stage", "2", "--offload-optimizer",
                            "--steps", "5", "--hidden", "64"], env, timeout=300).stdout
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)$", out, re.M)]
    assert len(losses) == 5, out
    assert all(b < a for a, b in zip(losses, losses[1:])), f"the loss did not fall at every step: {losses}"
    assert f"DeepSpeed optimizer: {cls}" in out, out
    ran = out.split("kernels that ran")[1].splitlines()[0]
    calls = re.findall(r"(\w+):(\w+) -> (\d+)", ran)
    assert [(name, int(n)) for name, _, n in calls] == [(op, 5)], ran
    assert dsenv.extensions_built(tmp_path) == []
