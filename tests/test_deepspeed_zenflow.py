"""ZenFlow's native cross-process API (DeepSpeed 0.19.8's cpu_adam op) on our facade, without DeepSpeed.

The optimizer process is spawned as DeepSpeed's ``zenflow_utils.start_optimizer_process`` does;
every step it runs must equal, bit for bit, ``adam_update`` of the same arguments on a mirror of
the tensors in this process (an independent path: no control block, no second process), and the
``stale`` buffer must hold the updated param. The control block's protocol is checked as DeepSpeed
relies on it: a wait with nothing pending times out and returns False, completions are counted (a
skipped wait is consumed by the next one), a dead optimizer process is noticed through the
time-out. ZeRO training with ZenFlow is in test_deepspeed_zenflow_zero.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from mps_fused_adam.deepspeed import ops, zenflow

sys.path.insert(0, str(Path(__file__).resolve().parent / "support" / "deepspeed_support"))
import zenflow_worker  # noqa: E402

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="ZenFlow's cross-process optimizer is Linux-only, as in DeepSpeed")


def _shared(n, dtype, fill=None, gen=None):
    t = torch.randn(n, generator=gen).to(dtype) if fill is None else torch.full((n,), fill, dtype=dtype)
    return t.share_memory_()


def _start(groups, ctrl, affinity, adamw_mode, destroy_first=False):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=zenflow_worker.optimizer_process,
                       args=(groups, ctrl, ready, affinity, adamw_mode, destroy_first), daemon=True)
    proc.start()
    assert ready.wait(timeout=120), "the optimizer process did not get ready"
    return proc


def _stop(proc, op, ctrl):
    if proc.is_alive():
        op.zenflow_adam_ctrl_exit(ctrl.data_ptr())
        proc.join(timeout=20)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)


@linux_only
@pytest.mark.parametrize("dtype,adamw_mode", [(torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32-adamw", "bf16-l2"])
def test_cross_process_steps_equal_adam_update(dtype, adamw_mode):
    op = ops.CPUAdamOp()
    gen = torch.Generator().manual_seed(0)
    sizes = [100_003, 4_099]  # not multiples of any SIMD width: the tails run too
    # Distinct hyperparameters per group, bias correction on in one only: a group reading
    # another's slot of the control block would not match.
    hps = [dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.01, bc=1),
           dict(lr=3e-2, beta1=0.8, beta2=0.99, eps=1e-6, wd=0.1, bc=0)]
    ctrl = torch.zeros(op.zenflow_adam_ctrl_size(), dtype=torch.uint8).share_memory_()
    op.zenflow_adam_ctrl_init(ctrl.data_ptr(), len(sizes))
    groups, mirrors = [], []
    for n in sizes:
        p = _shared(n, dtype, gen=gen)
        grads = [_shared(n, dtype, 0.0), _shared(n, dtype, 0.0)]
        ms = [_shared(n, torch.float32, 0.0), _shared(n, torch.float32, 0.0)]
        vs = [_shared(n, torch.float32, 0.0), _shared(n, torch.float32, 0.0)]
        stale = _shared(n, dtype, 0.0)
        groups.append((p, grads[0], grads[1], ms[0], ms[1], vs[0], vs[1], stale))
        mirrors.append(dict(p=p.clone(), m=[t.clone() for t in ms], v=[t.clone() for t in vs]))
    op.create_adam(1, 1e-3, 0.9, 0.999, 1e-8, 0.0, adamw_mode, False)
    affinity = sorted(os.sched_getaffinity(0))[:4]
    proc = _start(groups, ctrl, affinity, adamw_mode)
    try:
        t0 = time.perf_counter()
        assert op.zenflow_adam_wait(ctrl.data_ptr(), 0.05) is False, "a wait with nothing submitted must time out"
        assert time.perf_counter() - t0 >= 0.04
        for step in range(1, 6):
            now = step & 1
            fresh = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
            for (p, g0, g1, *_), grad in zip(groups, fresh):
                (g0, g1)[now].copy_(grad)
            op.zenflow_adam_submit(ctrl.data_ptr(), now, step, [h["lr"] for h in hps], [h["beta1"] for h in hps],
                                   [h["beta2"] for h in hps], [h["eps"] for h in hps], [h["wd"] for h in hps],
                                   [h["bc"] for h in hps])
            assert op.zenflow_adam_wait(ctrl.data_ptr(), 60.0), f"step {step} timed out"
            for gi, ((p, *_, stale), mir, grad, h) in enumerate(zip(groups, mirrors, fresh, hps)):
                op.adam_update(1, step, h["lr"], h["beta1"], h["beta2"], h["eps"], h["wd"], bool(h["bc"]), mir["p"],
                               grad.clone(), mir["m"][now], mir["v"][now])
                assert torch.equal(p, mir["p"]), f"group {gi} param differs at step {step}"
                assert torch.equal(groups[gi][3 + now], mir["m"][now]), f"group {gi} exp_avg differs at step {step}"
                assert torch.equal(groups[gi][5 + now], mir["v"][now]), f"group {gi} exp_avg_sq differs at step {step}"
                assert torch.equal(stale, p), f"group {gi} stale snapshot differs at step {step}"
            assert not torch.equal(groups[0][3 + now], groups[0][3 + 1 - now]), "both state buffers updated"
        assert zenflow.control_info(ctrl.data_ptr()) == {"steps_done": 5, "backend": "cpu"}

        # A skipped wait (DeepSpeed skips one after the warm-up rounds): the completion is counted
        # and consumed by the next wait, one per completed step, and no more.
        for step in (6, 7):
            op.zenflow_adam_submit(ctrl.data_ptr(), 0, step, *([h[k] for h in hps] for k in
                                                               ("lr", "beta1", "beta2", "eps", "wd", "bc")))
            deadline = time.time() + 60
            while zenflow.control_info(ctrl.data_ptr())["steps_done"] < step - 1 and time.time() < deadline:
                time.sleep(0.01)
        assert op.zenflow_adam_wait(ctrl.data_ptr(), 60.0) and op.zenflow_adam_wait(ctrl.data_ptr(), 60.0)
        assert op.zenflow_adam_wait(ctrl.data_ptr(), 0.05) is False
        op.zenflow_adam_ctrl_exit(ctrl.data_ptr())
        proc.join(timeout=20)
        assert proc.exitcode == 0, "run_worker must return on the exit command"
    finally:
        _stop(proc, op, ctrl)
        op.destroy_adam(1)


@linux_only
def test_dead_optimizer_process_is_noticed():
    """A step that fails in the optimizer process kills it without posting a completion, so the
    training side's bounded wait returns False and it can see the process is gone (DeepSpeed's
    _wait_for_optimizer_process)."""
    op = ops.CPUAdamOp()
    ctrl = torch.zeros(op.zenflow_adam_ctrl_size(), dtype=torch.uint8).share_memory_()
    op.zenflow_adam_ctrl_init(ctrl.data_ptr(), 1)
    n = 64
    group = tuple(_shared(n, torch.float32, 0.0) for _ in range(8))
    proc = _start([group], ctrl, [], True, destroy_first=True)
    try:
        op.zenflow_adam_submit(ctrl.data_ptr(), 0, 1, [1e-3], [0.9], [0.999], [1e-8], [0.0], [1])
        assert op.zenflow_adam_wait(ctrl.data_ptr(), 10.0) is False
        proc.join(timeout=20)
        assert not proc.is_alive() and proc.exitcode != 0
        assert zenflow.control_info(ctrl.data_ptr())["steps_done"] == 0
    finally:
        _stop(proc, op, ctrl)


@linux_only
def test_a_step_that_cannot_run_changes_no_group():
    """Every group's scalars are computed before any group is written: a submitted step whose
    second group cannot run (beta1 = 1 with bias correction: 1 - beta1**step is 0) leaves the first
    group's param, states and stale snapshot as they were; the optimizer process then stops with
    an error naming the group, and the training side's wait times out. A negative core in the
    affinity list leaves its thread unpinned, as in DeepSpeed."""
    op = ops.CPUAdamOp()
    ctrl = torch.zeros(op.zenflow_adam_ctrl_size(), dtype=torch.uint8).share_memory_()
    op.zenflow_adam_ctrl_init(ctrl.data_ptr(), 2)
    gen = torch.Generator().manual_seed(5)
    groups = []
    for _ in range(2):
        p, g = _shared(64, torch.float32, gen=gen), _shared(64, torch.float32, gen=gen)
        groups.append((p, g, _shared(64, torch.float32, 0.0), *(_shared(64, torch.float32, 0.0) for _ in range(4)),
                       _shared(64, torch.float32, 0.0)))
    before = [[t.clone() for t in grp] for grp in groups]
    proc = _start(groups, ctrl, [-1], True)
    try:
        op.zenflow_adam_submit(ctrl.data_ptr(), 0, 1, [1e-2, 1e-2], [0.9, 1.0], [0.999, 0.999], [1e-8, 1e-8],
                               [0.0, 0.0], [1, 1])
        assert op.zenflow_adam_wait(ctrl.data_ptr(), 10.0) is False
        proc.join(timeout=20)
        assert not proc.is_alive() and proc.exitcode != 0
        for grp, old in zip(groups, before):
            assert all(torch.equal(t, o) for t, o in zip(grp, old)), "a group was written"
    finally:
        _stop(proc, op, ctrl)


@linux_only
def test_negative_core_leaves_its_thread_unpinned_and_steps_run():
    op = ops.CPUAdamOp()
    ctrl = torch.zeros(op.zenflow_adam_ctrl_size(), dtype=torch.uint8).share_memory_()
    op.zenflow_adam_ctrl_init(ctrl.data_ptr(), 1)
    gen = torch.Generator().manual_seed(6)
    n = 200_000  # enough for two pool threads
    group = (_shared(n, torch.float32, gen=gen), _shared(n, torch.float32, gen=gen),
             *(_shared(n, torch.float32, 0.0) for _ in range(6)))
    mirror = [group[0].clone(), group[1].clone(), torch.zeros(n), torch.zeros(n)]
    op.create_adam(1, adamw_mode=True)
    proc = _start([group], ctrl, [-1, sorted(os.sched_getaffinity(0))[0]], True)
    try:
        op.zenflow_adam_submit(ctrl.data_ptr(), 0, 1, [1e-2], [0.9], [0.999], [1e-8], [0.01], [1])
        assert op.zenflow_adam_wait(ctrl.data_ptr(), 60.0)
        op.adam_update(1, 1, 1e-2, 0.9, 0.999, 1e-8, 0.01, True, *mirror)
        assert torch.equal(group[0], mirror[0]) and torch.equal(group[7], mirror[0])
    finally:
        _stop(proc, op, ctrl)
        op.destroy_adam(1)


@linux_only
def test_control_block_rejects_bad_use_and_changes_nothing():
    op = ops.CPUAdamOp()
    size = op.zenflow_adam_ctrl_size()
    ctrl = torch.zeros(size, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not initialised"):
        op.zenflow_adam_wait(ctrl.data_ptr(), 0.0)
    with pytest.raises(ValueError, match="not initialised"):
        op.zenflow_adam_submit(ctrl.data_ptr(), 0, 1, [1e-3], [0.9], [0.999], [1e-8], [0.0], [1])
    with pytest.raises(ValueError, match="at most 1024"):
        op.zenflow_adam_ctrl_init(ctrl.data_ptr(), 1025)
    op.zenflow_adam_ctrl_init(ctrl.data_ptr(), 2)
    before = ctrl.clone()
    with pytest.raises(ValueError, match="2 param groups|initialised for 2"):
        op.zenflow_adam_submit(ctrl.data_ptr(), 0, 1, [1e-3], [0.9], [0.999], [1e-8], [0.0], [1])
    with pytest.raises(ValueError, match="one entry per param group"):
        op.zenflow_adam_submit(ctrl.data_ptr(), 0, 1, [1e-3, 1e-3], [0.9], [0.999, 0.9], [1e-8] * 2, [0.0] * 2, [1] * 2)
    with pytest.raises(ValueError, match="now_state"):
        op.zenflow_adam_submit(ctrl.data_ptr(), 2, 1, [1e-3] * 2, [0.9] * 2, [0.999] * 2, [1e-8] * 2, [0.0] * 2, [1] * 2)
    assert torch.equal(ctrl, before), "a rejected submit must not touch the control block"
    assert op.zenflow_adam_wait(ctrl.data_ptr(), -1.0) is False  # a negative time-out polls once
    t0 = time.perf_counter()
    assert op.zenflow_adam_wait(ctrl.data_ptr(), 0.1) is False
    assert 0.09 <= time.perf_counter() - t0 < 5


def test_register_group_rejects_bad_tensors():
    op = ops.CPUAdamOp()
    op.create_adam(0)
    h = op.zenflow_adam_create(0, [0])
    n = 16
    good = [torch.zeros(n) for _ in range(8)]
    with pytest.raises(ValueError, match="contiguous"):
        op.zenflow_adam_register_group(h, torch.zeros(n, 2).t()[0], *good[1:])
    with pytest.raises(ValueError, match="grad1 has shape"):
        op.zenflow_adam_register_group(h, good[0], good[1], torch.zeros(n + 1), *good[3:])
    with pytest.raises(TypeError, match="exp_avg1"):
        op.zenflow_adam_register_group(h, *good[:4], torch.zeros(n, dtype=torch.float16), *good[5:])
    with pytest.raises(KeyError, match="handle"):
        op.zenflow_adam_register_group(h + 1, *good)
    op.zenflow_adam_register_group(h, *good[:7], None)  # no stale snapshot: allowed
    op.zenflow_adam_destroy(h)
    op.zenflow_adam_destroy(h)  # unknown handles are ignored, as in DeepSpeed
    with pytest.raises(KeyError):
        op.zenflow_adam_run_worker(h, 0)


def test_non_linux_says_linux_only(monkeypatch):
    class NoZenFlow:
        @staticmethod
        def zenflow_supported():
            return False

    monkeypatch.setattr(zenflow, "_cpu", lambda: NoZenFlow)
    op = ops.CPUAdamOp()
    for call in (lambda: op.zenflow_adam_ctrl_size(), lambda: op.zenflow_adam_ctrl_init(1, 1),
                 lambda: op.zenflow_adam_wait(1, 0.0), lambda: op.zenflow_adam_ctrl_exit(1),
                 lambda: op.zenflow_adam_submit(1, 0, 1, [1e-3], [0.9], [0.999], [1e-8], [0.0], [1])):
        with pytest.raises(RuntimeError, match="Linux-only"):
            call()
    assert not zenflow.supported()


def test_off_linux_the_op_lacks_the_linux_only_functions():
    """DeepSpeed defines six of ZenFlow's functions only on Linux, and its test of them asks
    hasattr(op, "zenflow_adam_ctrl_size"): the op built off Linux lacks them, saying why."""
    off_linux = ops.without_linux_only_zenflow(ops.CPUAdamOp)()
    for name in ops.ZENFLOW_LINUX_ONLY:
        assert hasattr(ops.CPUAdamOp(), name) == sys.platform.startswith("linux")
        assert not hasattr(off_linux, name)
        with pytest.raises(AttributeError, match="Linux-only"):
            getattr(off_linux, name)
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        off_linux.nonsense
    # The rest is all there: Adam, the rollback and ZenFlow's in-process functions.
    off_linux.create_adam(0)
    p, g, m, v = (torch.ones(8), torch.ones(8), torch.zeros(8), torch.zeros(8))
    assert off_linux.adam_update(0, 1, 1e-2, 0.9, 0.999, 1e-8, 0.0, True, p, g, m, v) == 0
    assert not torch.equal(p, torch.ones(8))
    assert callable(off_linux.zenflow_adam_create) and callable(off_linux.zenflow_adam_register_group)


PIN_SCRIPT = textwrap.dedent("""
    import json, os, threading, torch
    from mps_fused_adam import _cpu
    from mps_fused_adam.backends import get_backend
    from mps_fused_adam.numerics.contract import AdamHyper

    def allowed():
        out = {}
        for tid in sorted(os.listdir("/proc/self/task"), key=int):
            # A thread that ends between the listing and the read (the joined `later` thread is
            # still listed for a moment) is none of those checked: the pool threads and the main
            # thread stay alive, so each one missing from a snapshot still fails the test.
            try:
                with open(f"/proc/self/task/{tid}/status") as f:
                    lines = f.readlines()
            except (FileNotFoundError, ProcessLookupError):
                continue
            for line in lines:
                if line.startswith("Cpus_allowed_list:"):
                    out[int(tid)] = line.split(":")[1].strip()
        return out

    _cpu.use_torch_openmp(False)  # our own pool, as ZenFlow's worker uses it (run_worker)
    torch.set_num_threads(3)
    n = 3 * 65536  # enough elements for 3 pool threads
    ts = [torch.randn(n) for _ in range(4)]
    ts[3] = (ts[3] * ts[2]).abs()  # torch's own threads start here, before the snapshot
    before = allowed()
    get_backend("cpu").update("adam", [ts[0]], [ts[1]], [[ts[2]], [ts[3]]], AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1))
    cores = sorted(os.sched_getaffinity(0))
    pool_tids = sorted(set(allowed()) - set(before))
    ok = _cpu.pin_pool([cores[0], cores[-1]], True)
    pinned = allowed()
    later = []  # a thread the caller starts after pinning (torch starts its own threads so)
    t = threading.Thread(target=lambda: later.extend(sorted(os.sched_getaffinity(0))))
    t.start()
    t.join()
    main_cores = sorted(os.sched_getaffinity(0))
    _cpu.pin_pool(cores, False)
    restored = allowed()
    print("MFA-RESULT " + json.dumps(dict(ok=ok, cores=cores, main=os.getpid(), pool=pool_tids,
                                          pinned=pinned, restored=restored, size=_cpu.pool_size(),
                                          main_cores=main_cores, later=later)))
""")


@linux_only
def test_pool_threads_pinned_one_per_core(tmp_path):
    """pin_pool puts pool thread i on core i of the list (cycling), as DeepSpeed's pinned pool
    does, and leaves the calling thread (thread 0) on the whole list, so that the threads it starts
    later are not confined to one core; pinning to the whole list restores the placement."""
    import json
    import mps_fused_adam
    env = dict(os.environ, PYTHONPATH=str(Path(mps_fused_adam.__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", PIN_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("MFA-RESULT ")][-1][11:])
    assert r["ok"] and r["size"] == 3 and len(r["pool"]) == 2
    first, last = r["cores"][0], r["cores"][-1]
    assert r["main_cores"] == r["later"] == sorted({first, last})
    assert sorted(r["pinned"][str(t)] for t in r["pool"]) == sorted([str(last), str(first)])
    whole = r["restored"][str(r["main"])]
    assert all(r["restored"][str(t)] == whole for t in r["pool"]) and whole != str(first)
