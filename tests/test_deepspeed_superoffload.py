"""SuperOffload's optimizer worker on our op: DeepSpeed 0.19.8 runs ``DeepSpeedCPUAdam`` (step and
``rollback_subgroup``, the only caller of ``adam_rollback``) in a process it spawns, which never
ran ``install()``; ``install()`` makes that process run it first (``deepspeed/spawned.py``).

SuperOffload's ZeRO stage asserts a CUDA accelerator, but its worker class does not: it is driven
here directly on CPU tensors, in a process with no compiler and no ninja, so a JIT build of
DeepSpeed's ``cpu_adam`` in the worker would kill it.
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import torch

from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference import reference_adam_

sys.path.insert(0, str(Path(__file__).parent / "support" / "deepspeed_support"))
import dsenv  # noqa: E402

SCRIPT = textwrap.dedent("""
    import json, time
    import torch

    def result(so, kind):
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            r = so.get_result(kind)
            if r is not None:
                return r["updated_param"].tolist()
            if not so.cpuadam_process.is_alive():
                raise SystemExit(f"the worker died (exit code {so.cpuadam_process.exitcode})")
            time.sleep(0.02)
        raise SystemExit("no result from the worker in 120 s")

    if __name__ == "__main__":
        import mps_fused_adam.deepspeed as mfd
        report = mfd.install(use_mps=False)
        from deepspeed.runtime.superoffload.superoffload_utils import SuperOffloadCPUOptimizer
        cfg = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False)
        so = SuperOffloadCPUOptimizer(cfg, cpuadam_cores_perc=1.0, max_grad_numel=4096, pin_memory=False)
        gen = torch.Generator().manual_seed(0)
        p = torch.randn(1000, generator=gen)
        grads = [torch.randn(1000, generator=gen) for _ in range(3)]
        out = {"p0": p.tolist(), "grads": [g.tolist() for g in grads], "after": []}
        for g in grads:
            so.async_step(0, 0, p.clone(), g.clone())
            p = torch.tensor(result(so, "adam_step"))
            out["after"].append(p.tolist())
        so.async_step(0, 0, p.clone(), grads[-1].clone(), rollback=True)
        out["rolled_back"] = result(so, "rollback")
        so.close()
        print("MFA-RESULT " + json.dumps(out))
""")


def test_superoffload_worker_runs_our_op_without_a_compiler(tmp_path):
    dsenv.require_deepspeed()
    try:
        import deepspeed.runtime.superoffload.superoffload_utils  # noqa: F401
    except ImportError:
        import pytest
        pytest.skip("this DeepSpeed has no SuperOffload")  # before 0.18
    script = tmp_path / "superoffload_run.py"  # a file: the spawned worker re-imports __main__ by path
    script.write_text(SCRIPT)
    env = dsenv.no_compiler_env(tmp_path)
    out = dsenv.parse_result(dsenv.run_python([str(script)], env, timeout=300).stdout)
    assert dsenv.extensions_built(tmp_path) == []
    # The worker's DeepSpeedCPUAdam (AdamW mode, bias correction) took our kernel: bit for bit the
    # contract's reference, step after step.
    p, m, v = torch.tensor(out["p0"]), torch.zeros(1000), torch.zeros(1000)
    history = []
    for step, (g, after) in enumerate(zip(out["grads"], out["after"]), start=1):
        reference_adam_(p, torch.tensor(g), m, v, AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.01, step))
        assert torch.equal(torch.tensor(after), p), f"step {step} differs from the reference"
        history.append(p.clone())
    # rollback_subgroup undid the third step through our adam_rollback: back at step 2's params
    # up to the fp32 rounding of the inverse.
    err = (torch.tensor(out["rolled_back"]) - history[1]).abs().max().item()
    assert 0 < (history[2] - history[1]).abs().max().item() and err <= 1e-6, err
