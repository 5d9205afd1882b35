"""``mps_fused_adam.deepspeed.install()``: redirection of DeepSpeed's op lookups, idempotence,
order independence, clear errors for a missing or old DeepSpeed.

Anything that calls ``install()`` on the real DeepSpeed runs in a fresh subprocess (install()
changes process-wide DeepSpeed state), without a compiler or ninja on PATH.
"""
from __future__ import annotations

import os
import sys
import textwrap
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support" / "deepspeed_support"))
import dsenv  # noqa: E402


def _run(tmp_path, code: str, **env_extra) -> str:
    dsenv.require_deepspeed()
    env = dsenv.no_compiler_env(tmp_path, **env_extra)
    proc = dsenv.run_python(["-c", textwrap.dedent(code)], env, timeout=300)
    assert dsenv.extensions_built(tmp_path) == [], "something was JIT-built"
    return proc.stdout


COMMON = """
    import sys, importlib
    import mps_fused_adam.deepspeed as mfd
    from mps_fused_adam.deepspeed.ops import FUSED_ADAM_OP, CPU_ADAM_OP
"""


def test_install_after_deepspeed_was_used(tmp_path):
    """DeepSpeed imported, its builder names bound and its compatibility table computed before
    install(): all are corrected."""
    out = _run(tmp_path, COMMON + """
    import deepspeed, deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    table = deepspeed.ops.__compatible_ops__
    report = mfd.install()
    assert table is deepspeed.ops.__compatible_ops__
    assert table["cpu_adam"] is True and table["fused_adam"] is True, table
    assert table["deepspeed_shm_comm"] is False, table
    from deepspeed.ops.op_builder import FusedAdamBuilder, CPUAdamBuilder, ShareMemCommBuilder
    import deepspeed.ops.adam.fused_adam as fa, deepspeed.ops.adam.cpu_adam as ca
    assert fa.FusedAdamBuilder is FusedAdamBuilder and ca.CPUAdamBuilder is CPUAdamBuilder
    assert FusedAdamBuilder().load() is FUSED_ADAM_OP
    assert CPUAdamBuilder().load() is CPU_ADAM_OP
    acc = get_accelerator()
    assert acc.create_op_builder("FusedAdamBuilder").load() is FUSED_ADAM_OP
    assert acc.create_op_builder("CPUAdamBuilder").load() is CPU_ADAM_OP
    assert acc.get_op_builder("FusedAdamBuilder") is FusedAdamBuilder
    # Our builders are DeepSpeed's own builder classes for this accelerator, extended.
    from deepspeed.ops.op_builder.cpu import FusedAdamBuilder as Original
    assert issubclass(FusedAdamBuilder, Original) and FusedAdamBuilder.NAME == Original.NAME
    # An op we ship no kernel for: unavailable, and loading it says why instead of compiling.
    shm = acc.create_op_builder("ShareMemCommBuilder")
    assert shm.is_compatible() is False
    try:
        shm.load()
    except RuntimeError as e:
        assert "block_jit=False" in str(e) and "deepspeed_shm_comm" in str(e), e
    else:
        raise AssertionError("blocked op loaded")
    from deepspeed.comm.torch import build_shm_op
    assert build_shm_op() is None
    print("OK", report["accelerator"])
    """)
    assert "OK cpu" in out


def test_install_is_idempotent_and_survives_reimport_and_set_accelerator(tmp_path):
    out = _run(tmp_path, COMMON + """
    r1 = mfd.install()
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    cls1 = acc.get_op_builder("FusedAdamBuilder")
    r2 = mfd.install()
    assert r1 == r2, (r1, r2)
    assert get_accelerator() is acc and acc.get_op_builder("FusedAdamBuilder") is cls1
    assert acc.create_op_builder("FusedAdamBuilder").load() is FUSED_ADAM_OP
    # deepspeed.ops.op_builder imported (again) after install(): binds the redirected classes.
    import deepspeed.ops.op_builder as ob
    ob = importlib.reload(ob)
    assert ob.FusedAdamBuilder is cls1 and ob.CPUAdamBuilder().load() is CPU_ADAM_OP
    # An accelerator set after install() is redirected too.
    from deepspeed.accelerator import set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    fresh = CPU_Accelerator()
    set_accelerator(fresh)
    assert get_accelerator() is fresh
    assert fresh.create_op_builder("CPUAdamBuilder").load() is CPU_ADAM_OP
    assert fresh.create_op_builder("ShareMemCommBuilder").is_compatible() is False
    # DeepSpeed's optimizers built now use our kernels, and count calls.
    import torch
    from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam
    m = torch.nn.Linear(3, 2)
    for cls in (FusedAdam, DeepSpeedCPUAdam):
        opt = cls(m.parameters(), lr=0.1)
        m(torch.ones(1, 3)).sum().backward()
        opt.step()
    print("CALLS", sorted(mfd.kernel_calls()))
    """)
    assert "CALLS ['adam_update:" in out and "'multi_tensor_adam:" in out


def test_block_jit_false_leaves_other_ops_to_deepspeed(tmp_path):
    out = _run(tmp_path, COMMON + """
    mfd.install(block_jit=False)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as Original
    acc = get_accelerator()
    assert acc.get_op_builder("ShareMemCommBuilder") is Original
    assert acc.create_op_builder("FusedAdamBuilder").load() is FUSED_ADAM_OP
    mfd.install()  # back to blocking
    assert acc.get_op_builder("ShareMemCommBuilder") is not Original
    assert acc.create_op_builder("ShareMemCommBuilder").is_compatible() is False
    print("OK")
    """)
    assert "OK" in out


def test_block_jit_false_after_install_unblocks_bound_names(tmp_path):
    """install() blocks the builders bound by name in DeepSpeed's modules; a later
    install(block_jit=False) must give those names back to DeepSpeed, and install() block again."""
    out = _run(tmp_path, COMMON + """
    import deepspeed.ops.op_builder as ob
    mfd.install()
    assert ob.AsyncIOBuilder._mps_fused_adam_kind == "blocked"
    mfd.install(block_jit=False)
    assert getattr(ob.AsyncIOBuilder, "_mps_fused_adam_kind", None) is None, ob.AsyncIOBuilder
    assert ob.AsyncIOBuilder.__module__.startswith("deepspeed.ops.op_builder")
    assert ob.FusedAdamBuilder().load() is FUSED_ADAM_OP
    mfd.install()
    assert ob.AsyncIOBuilder._mps_fused_adam_kind == "blocked"
    print("OK")
    """)
    assert "OK" in out


def test_block_jit_reaches_builders_imported_from_their_own_module(tmp_path):
    """deepspeed.ops.pin_memory imports its builder from the defining submodule, after install()
    in a usual program, so no name rebinding reaches it: DeepSpeed's OpBuilder.jit_load refuses
    instead (no compiler is reachable here, so a JIT build would fail with a compiler error)."""
    out = _run(tmp_path, COMMON + """
    mfd.install()
    from deepspeed.ops.pin_memory import PinMemoryBuilder
    try:
        PinMemoryBuilder().load()
    except RuntimeError as exc:
        assert "would be JIT-compiled, which mps_fused_adam.deepspeed.install(block_jit=True) prevents" in str(exc), exc
    else:
        raise AssertionError("loaded")
    print("OK")
    """)
    assert "OK" in out
    assert dsenv.extensions_built(tmp_path) == []


def test_use_mps_without_mps_is_a_clear_error(monkeypatch):
    import torch
    import mps_fused_adam.deepspeed as mfd
    dsenv.require_deepspeed()
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match=r"install\(use_mps=True\): this torch has no usable MPS device"):
        mfd.install(use_mps=True)
    assert dict(os.environ) == before  # nothing set (the single-process variables come later)


def test_missing_deepspeed_is_a_clear_import_error(monkeypatch):
    import mps_fused_adam.deepspeed as mfd
    before = os.environ.get("MASTER_PORT")
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError, match=r"needs DeepSpeed.*pip install --no-build-isolation"):
        mfd.install()
    assert "MASTER_PORT" not in os.environ or os.environ.get("MASTER_PORT") == before  # nothing set


def test_old_deepspeed_is_a_clear_runtime_error(monkeypatch):
    import mps_fused_adam.deepspeed as mfd
    fake = types.ModuleType("deepspeed")
    fake.__version__ = "0.9.5"
    fake.__file__ = "/somewhere/deepspeed/__init__.py"
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    with pytest.raises(RuntimeError, match=r"DeepSpeed >= 0\.14\.4 \(tested with 0\.19\.8\); found 0\.9\.5"):
        mfd.install()


def test_version_parsing():
    from mps_fused_adam.deepspeed import _version_tuple
    assert _version_tuple("0.19.8") == (0, 19, 8)
    assert _version_tuple("0.14.0+cu121") == (0, 14, 0)
    assert _version_tuple("0.15.0rc1") == (0, 15, 0)
    assert _version_tuple("1.0") == (1, 0, 0)
    assert _version_tuple("0.13.9") < _version_tuple("0.14.0") <= _version_tuple("0.14.0")


RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def _run_bare(tmp_path, code: str, **env_extra) -> str:
    """Like _run, in an environment without any launcher variable (plus env_extra)."""
    dsenv.require_deepspeed()
    env = dsenv.no_compiler_env(tmp_path)
    for var in RENDEZVOUS + ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        env.pop(var, None)
    env.update(env_extra)
    proc = dsenv.run_python(["-c", textwrap.dedent(code)], env, timeout=300)
    assert dsenv.extensions_built(tmp_path) == [], "something was JIT-built"
    return proc.stdout


def test_single_process_without_launcher_initializes(tmp_path):
    """Issue 13, item 7: without RANK/MASTER_ADDR DeepSpeed's init_distributed tries MPI discovery
    (mpi4py); install() sets the single-process defaults instead, and says so in its report."""
    out = _run_bare(tmp_path, """
    import os
    import mps_fused_adam.deepspeed as mfd
    report = mfd.install()
    env = report["env_set"]
    assert sorted(env) == ["LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"], env
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["MASTER_ADDR"] == "127.0.0.1"
    assert int(env["MASTER_PORT"]) > 0 and all(os.environ[k] == v for k, v in env.items())
    assert mfd.install()["env_set"] == env  # idempotent
    import deepspeed, torch.distributed as dist
    deepspeed.init_distributed(dist_backend="gloo")
    assert dist.get_world_size() == 1 and dist.get_rank() == 0
    print("OK")
    """)
    assert "OK" in out


@pytest.mark.parametrize("present", [{"RANK": "0"}, {"OMPI_COMM_WORLD_SIZE": "1"}])
def test_launcher_variables_are_left_alone(tmp_path, present):
    """Any rendezvous variable or an MPI launcher present: install() sets nothing."""
    out = _run_bare(tmp_path, """
    import os
    import mps_fused_adam.deepspeed as mfd
    assert mfd.install()["env_set"] == {}
    print("UNSET", sorted(k for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ))
    """, **present)
    assert "UNSET []" in out


def test_accelerator_methods_bound_at_import_are_rebound(tmp_path):
    """Issue 13, item 1: `import deepspeed` binds get_accelerator().memory_reserved in
    deepspeed.runtime.utils on the accelerator it auto-detects (on a Mac with DeepSpeed 0.14 to
    0.18: the stub, whose method returns None). After install() they are the active accelerator's."""
    out = _run_bare(tmp_path, """
    import pseudo_mps
    pseudo_mps.activate()
    import deepspeed
    import deepspeed.runtime.utils as u
    from deepspeed.accelerator import get_accelerator
    detected = u.torch_memory_reserved.__self__
    print("DETECTED", type(detected).__name__)
    import mps_fused_adam.deepspeed as mfd
    report = mfd.install()
    acc = get_accelerator()
    assert acc is not detected and type(acc).__name__ == "MPSFusedAdamAccelerator"
    assert u.torch_memory_reserved.__self__ is acc and u.torch_max_memory_reserved.__self__ is acc
    assert u.torch_memory_reserved() == 3 << 30 and u.torch_max_memory_reserved() == 3 << 30
    assert "deepspeed.runtime.utils.torch_memory_reserved" in report["rebound"], report["rebound"]
    u.see_memory_usage("after install", force=True)  # a TypeError with a stub's None
    print("OK")
    """)
    assert "DETECTED MPS_Accelerator" in out and "OK" in out


def test_lion_adagrad_builders_and_lamb_out_of_scope(tmp_path):
    """Lion and Adagrad builders load our facades on the CPU accelerator and on DeepSpeed's MPS
    accelerator (which has no builder of its own for them); Lamb is refused with a clear reason,
    also when a config asks for it."""
    out = _run(tmp_path, COMMON + """
    from mps_fused_adam.deepspeed.rule_ops import FUSED_LION_OP, CPU_LION_OP, CPU_ADAGRAD_OP
    report = mfd.install()
    assert {"FusedLionBuilder", "CPULionBuilder", "CPUAdagradBuilder"} <= set(report["ours"]), report
    assert "FusedLambBuilder" in report["out_of_scope"]
    import deepspeed, deepspeed.ops, torch
    from deepspeed.ops.op_builder import FusedLionBuilder, CPULionBuilder, CPUAdagradBuilder
    assert FusedLionBuilder().load() is FUSED_LION_OP
    assert CPULionBuilder().load() is CPU_LION_OP and CPUAdagradBuilder().load() is CPU_ADAGRAD_OP
    assert FusedLionBuilder.NAME == "fused_lion" and FusedLionBuilder().absolute_name() == "deepspeed.ops.lion.fused_lion_op"
    assert CPUAdagradBuilder().absolute_name() == "deepspeed.ops.adagrad.cpu_adagrad_op"
    table = deepspeed.ops.__compatible_ops__
    assert table["cpu_lion"] is True and table["cpu_adagrad"] is True, table
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.mps_accelerator import MPS_Accelerator
    cpu_acc = get_accelerator()
    mps = MPS_Accelerator()
    set_accelerator(mps)
    for name, op in (("FusedLionBuilder", FUSED_LION_OP), ("CPULionBuilder", CPU_LION_OP),
                     ("CPUAdagradBuilder", CPU_ADAGRAD_OP)):
        assert mps.create_op_builder(name).load() is op, name
        assert mps.create_op_builder(name).NAME == name.replace("Builder", "").replace("CPU", "cpu_").replace(
            "Fused", "fused_").lower(), mps.create_op_builder(name).NAME
    set_accelerator(cpu_acc)
    try:
        get_accelerator().create_op_builder("FusedLambBuilder").load()
    except RuntimeError as e:
        assert "Lamb (FusedLamb) is out of scope" in str(e), e
    else:
        raise AssertionError("FusedLamb loaded")
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except RuntimeError as e:
        text = repr(e) + repr(e.__cause__)
        assert "out of scope" in text, text
    else:
        raise AssertionError("a Lamb config initialized")
    from deepspeed.ops.lion import FusedLion, DeepSpeedCPULion
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    m = torch.nn.Linear(3, 2)
    mfd.reset_kernel_calls()
    for cls in (FusedLion, DeepSpeedCPULion, DeepSpeedCPUAdagrad):
        opt = cls(m.parameters(), lr=0.1)
        m(torch.ones(1, 3)).sum().backward()
        opt.step()
    print("CALLS", sorted(mfd.kernel_calls()))
    # DeepSpeed's own optimizer classes on a non-contiguous (transposed) parameter: updated, and
    # exactly as the reference says (DeepSpeed's C++ ops would update a contiguous copy and lose it).
    from mps_fused_adam.numerics.contract import AdagradHyper, LionHyper
    from mps_fused_adam.numerics.reference import reference_adagrad_, reference_lion_
    for cls, ref_fn, hp, key in ((DeepSpeedCPULion, reference_lion_, LionHyper(1e-2, 0.9, 0.99, 0.0), "exp_avg"),
                                 (DeepSpeedCPUAdagrad, reference_adagrad_, AdagradHyper(1e-2, 1e-10, 0.0, 1), "exp_avg_sq")):
        start = torch.randn(6, 5).t()
        param = torch.nn.Parameter(start.clone(memory_format=torch.preserve_format))
        assert not param.is_contiguous()
        kw = dict(lr=1e-2, betas=(0.9, 0.99)) if cls is DeepSpeedCPULion else dict(lr=1e-2, eps=1e-10)
        opt = cls([param], **kw)
        ref_p, ref_s = start.clone(), torch.zeros(5, 6)
        for _ in range(3):
            g = torch.randn(5, 6)
            param.grad = g.clone()
            opt.step()
            ref_fn(ref_p, g, ref_s, hp)
        assert torch.equal(param.detach(), ref_p) and torch.equal(opt.state[param][key], ref_s), cls
    print("NONCONTIGUOUS OK")
    """, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dsenv.free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    assert "CALLS ['adagrad_update:cpu', 'lion_update:cpu', 'multi_tensor_lion:cpu']" in out, out[-3000:]
    assert "NONCONTIGUOUS OK" in out


def test_use_mps_false_leaves_mps_for_the_cpu_accelerator(tmp_path):
    """On a Mac (pseudo-MPS: DeepSpeed auto-detects MPS at import), ``install(use_mps=False)``
    does not leave the process on DeepSpeed's own MPS accelerator, without this package's
    staging and device mapping: it takes DeepSpeed's CPU accelerator, whatever ran before."""
    out = _run(tmp_path, """
    import os, sys
    sys.path.insert(0, os.environ["MFA_TESTS_SUPPORT"])
    import pseudo_mps
    pseudo_mps.activate()
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    import mps_fused_adam.deepspeed as mfd
    assert get_accelerator()._name == "mps" and not hasattr(get_accelerator(), "mps_fused_adam_complete_base")
    report = mfd.install(use_mps=False)
    accel = get_accelerator()
    print("first", report["accelerator"], type(accel).__name__, accel.device_name(1))
    report = mfd.install()  # ours
    print("ours", report["accelerator"], hasattr(get_accelerator(), "mps_fused_adam_complete_base"))
    report = mfd.install(use_mps=False)
    print("again", report["accelerator"], type(get_accelerator()).__name__)
    """, MFA_TESTS_SUPPORT=str(Path(__file__).resolve().parent / "support" / "deepspeed_support"))
    lines = [line.split() for line in out.splitlines() if line.split()[:1] in (["first"], ["ours"], ["again"])]
    assert lines == [["first", "cpu", "CPU_Accelerator", "cpu"], ["ours", "mps", "True"],
                     ["again", "cpu", "CPU_Accelerator"]], out
