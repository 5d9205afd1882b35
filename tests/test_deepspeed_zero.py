"""DeepSpeed ZeRO stages 0-3, with and without CPU offload, fp32 and bf16, on our kernels: AdamW
(every stage), Lion (stages 1-3, with and without CPU offload: FusedLion and DeepSpeedCPULion) and
Adagrad (stages 1-3 with CPU offload: DeepSpeedCPUAdagrad; without offload DeepSpeed runs
torch.optim.Adagrad, which needs no kernel of ours).

Every configuration runs ``deepspeed.initialize`` and 5 training steps on DeepSpeed's CPU
accelerator with gloo, in subprocesses that have no compiler and no ninja (tests/support/deepspeed_support/
dsenv.py), and checks:

* the loss trajectory against the same model trained with the reference optimizer
  (``torch.optim.AdamW``; for Lion the package's reference, ``reference.reference_lion_``; for
  Adagrad ``torch.optim.Adagrad``) (tolerances below);
* that DeepSpeed built its own optimizer class (``FusedAdam``/``FusedLion`` without offload,
  ``DeepSpeedCPUAdam``/``DeepSpeedCPULion``/``DeepSpeedCPUAdagrad`` with offload; exact types, no
  subclass) and that its kernel object is our facade, which counted one backend call per step;
* that nothing was JIT-built (the extensions directory stays empty, the shm comm op is reported
  unavailable).

Importing DeepSpeed costs seconds, so all single-process configurations share one subprocess, and
the world-size-2 configurations share one pair of processes.

Tolerances (relative, on each of the 5 losses):

* fp32: 1e-5, about 80 fp32 ulps (2**-23 = 1.2e-7). Our kernel and torch's AdamW evaluate the same
  formula in a different operation order (bias corrections in double, division order), so the
  parameters differ by a few ulps per step; 5 steps at lr 1e-2 keep the losses within a few ulps
  (measured: at most 1.2e-7, one ulp, in every configuration). World size 2 adds gloo's
  reduction order. A different order costs ulps, so this bound leaves room for other CPUs' SIMD
  paths while staying 2500 times below the control below.
* bf16: 2e-3, half a bf16 ulp (2**-8 = 3.9e-3). The reference mirrors DeepSpeed's mixed precision
  (fp32 master weights that start from the bf16-rounded model, bf16 forward and backward, fp32
  AdamW step; stage 0's initial zero-gradient step, see zero_runner.reference_losses), so one
  process matches exactly (measured: 0.0); with 2 ranks DeepSpeed averages bf16 gradients across
  ranks where the reference computes one full-batch gradient, which moves a loss by a fraction of a
  bf16 ulp (measured: 5.8e-4).

Lion and Adagrad use the same tolerances, for the same reasons. Lion's reference is the package's
own contract, so in one process the losses match exactly (measured: 0.0 in fp32 and bf16; a
sign-based update would amplify any gradient difference into a full 2 * lr step, so exact
agreement here also shows that DeepSpeed hands our kernel the gradients the reference sees).
Adagrad's reference, torch's, divides in another order (contract.py): measured at most 1.1e-7 in
fp32 and 1.9e-4 in bf16.

Each tolerance must also reject the reference trained with half the learning rate (the "control":
2.5e-2 away for AdamW, 2.7e-2 to 3.0e-2 for Lion, 1.4e-2 for Adagrad), so a wrong optimizer cannot
pass.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support" / "deepspeed_support"))
import dsenv  # noqa: E402

RUNNER = str(dsenv.SUPPORT / "zero_runner.py")
SINGLE = [f"{cfg}:{dtype}" for dtype in ("fp32", "bf16")
          for cfg in ("s0", "s1", "s1-off", "s2", "s2-off", "s3", "s3-off", "s3-off-param")]
SINGLE += [f"{cfg}:{dtype}:lion" for dtype in ("fp32", "bf16")
           for cfg in ("s1", "s1-off", "s2", "s2-off", "s3", "s3-off")]
SINGLE += [f"{cfg}:{dtype}:adagrad" for dtype in ("fp32", "bf16") for cfg in ("s1-off", "s2-off", "s3-off")]
# (DeepSpeed class without offload, with offload, our op without offload, with offload)
EXPECTED = {
    "adamw": ("deepspeed.ops.adam.fused_adam.FusedAdam", "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam",
              "multi_tensor_adam", "adam_update"),
    "lion": ("deepspeed.ops.lion.fused_lion.FusedLion", "deepspeed.ops.lion.cpu_lion.DeepSpeedCPULion",
             "multi_tensor_lion", "lion_update"),
    "adagrad": (None, "deepspeed.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad", None, "adagrad_update"),
}
# A configuration must finish deepspeed.initialize and its 5 steps within this many seconds.
MAX_SECONDS = 30
PAIR = ["s2-off:fp32", "s3-off:fp32", "s2-off:bf16", "s3-off:bf16"]
RTOL = {"fp32": 1e-5, "bf16": 2e-3}
TIMINGS: dict = {}


def _max_rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def single_results(tmp_path_factory):
    dsenv.require_deepspeed()
    tmp = tmp_path_factory.mktemp("zero1")
    env = dsenv.no_compiler_env(tmp, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dsenv.free_port()),
                                RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    proc = dsenv.run_python([RUNNER, *SINGLE], env)
    out = dsenv.parse_result(proc.stdout)
    out["built"] = dsenv.extensions_built(tmp)
    out["stdout"] = proc.stdout
    return out


@pytest.fixture(scope="module")
def pair_results(tmp_path_factory):
    dsenv.require_deepspeed()
    tmp = tmp_path_factory.mktemp("zero2")
    outs = dsenv.run_ranks(tmp, [RUNNER, *PAIR], 2)
    return {"ranks": outs, "built": dsenv.extensions_built(tmp)}


def _check(result: dict) -> None:
    dtype = result["dtype"]
    rtol = RTOL[dtype]
    err = _max_rel(result["losses"], result["reference"])
    control = _max_rel(result["control"], result["reference"])
    assert control > 2 * rtol, f"tolerance {rtol} would not catch a halved learning rate ({control:.2e})"
    optimizer = result.get("optimizer", "adamw")
    assert err <= rtol, (f"{result['config']} {dtype} {optimizer} rank {result['rank']}: losses {result['losses']} vs "
                         f"the reference {result['reference']} (max rel {err:.2e} > {rtol})")
    offload = "-off" in result["config"]
    fused_cls, cpu_cls, fused_op, cpu_op = EXPECTED[optimizer]
    assert result["optimizer_class"] == (cpu_cls if offload else fused_cls)
    assert result["optimizer_exact_type"], "DeepSpeed's optimizer must be its own class, not a subclass"
    assert result["kernel_is_ours"], "the optimizer's kernel object is not mps_fused_adam's facade"
    # One backend call per step: a single (device, dtype) group per step on these models; and
    # no other op of ours ran.
    calls = result["kernel_calls"]
    op = cpu_op if offload else fused_op
    ours = sum(n for key, n in calls.items() if key.startswith(op + ":"))
    assert ours >= 5, f"expected our {op} to run on each of the 5 steps, counted {calls}"
    assert all(k.startswith(op + ":") for k in calls), calls
    assert result["seconds"] < MAX_SECONDS, f"{result['config']} took {result['seconds']:.1f} s"
    TIMINGS[(result["config"], dtype, optimizer, result["world_size"], result["rank"])] = result["seconds"]


@pytest.mark.parametrize("spec", SINGLE)
def test_zero_single_process(single_results, spec):
    cfg, dtype, *rest = spec.split(":")
    optimizer = rest[0] if rest else "adamw"
    (result,) = [r for r in single_results["results"]
                 if r["config"] == cfg and r["dtype"] == dtype and r["optimizer"] == optimizer]
    _check(result)


def test_nothing_jit_built_single(single_results):
    assert single_results["built"] == [], f"a JIT build left {single_results['built']}"
    assert single_results["compatible_ops"]["deepspeed_shm_comm"] is False
    assert single_results["compatible_ops"]["cpu_adam"] is True
    assert single_results["compatible_ops"]["fused_adam"] is True
    assert single_results["compatible_ops"]["cpu_lion"] is True
    assert single_results["compatible_ops"]["cpu_adagrad"] is True
    assert "built successfully" not in single_results["stdout"]


@pytest.mark.parametrize("spec", PAIR)
def test_zero_world_size_2(pair_results, spec):
    cfg, dtype = spec.split(":")
    for out in pair_results["ranks"]:
        (result,) = [r for r in out["results"] if r["config"] == cfg and r["dtype"] == dtype]
        assert result["world_size"] == 2
        _check(result)
    # The ranks trained on different slices of each batch, so their losses differ, while the
    # shared parameters mean each matches its own slice of the reference.
    r0, r1 = ([r for r in out["results"] if r["config"] == cfg and r["dtype"] == dtype][0]
              for out in pair_results["ranks"])
    assert r0["losses"] != r1["losses"]


def test_nothing_jit_built_pair(pair_results):
    assert pair_results["built"] == [], f"a JIT build left {pair_results['built']}"


def test_report_timings(single_results, pair_results):
    """Not a check: prints seconds from deepspeed.initialize to the 5th step, per configuration."""
    results = single_results["results"] + [r for out in pair_results["ranks"] for r in out["results"]]
    rows = [(r["config"], r["dtype"], r["optimizer"], r["world_size"], r["rank"], r["seconds"],
             _max_rel(r["losses"], r["reference"])) for r in results]
    report = "\n".join(f"{c:>13} {d} {o:>7} ws={w} rank={k}: {s:6.2f} s, max rel loss diff vs the reference {e:.1e}"
                       for c, d, o, w, k, s, e in rows)
    print("\nDeepSpeed initialize -> 5th step:\n" + report)
    path = os.environ.get("MFA_DEEPSPEED_TIMINGS")
    if path:
        Path(path).write_text(report + "\n")
    assert len(rows) == len(SINGLE) + 2 * len(PAIR)
