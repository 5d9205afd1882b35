"""The CPU extension across fork(): a forked child (a DataLoader worker, multiprocessing's "fork"
start method) inherits the parent's memory but none of its threads. Each scenario runs in a fresh
interpreter; every child steps under an alarm, so a hang fails the test instead of stalling it.
The children's results are compared with the reference."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mps_fused_adam
from conftest import FORK_ON_DARWIN

if not hasattr(os, "fork"):
    pytest.skip("no fork() on this platform", allow_module_level=True)
if sys.platform == "darwin":
    pytest.skip(FORK_ON_DARWIN, allow_module_level=True)

PRELUDE = textwrap.dedent("""
    import os, signal, sys, threading, torch
    import numpy as np
    from mps_fused_adam import _cpu
    from mps_fused_adam.backends import CPUBackend
    from mps_fused_adam.numerics.contract import RULES, AdamHyper
    from mps_fused_adam.numerics.reference import reference_adam_
    HP = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
    N = 1 << 18  # enough elements for two threads

    # Inputs and the reference's result, made here in the parent: a forked child must not run
    # torch's own parallel operators either (torch's threads do not survive a fork: they hang),
    # so the child only calls the extension and compares with numpy.
    _g = torch.Generator().manual_seed(1)
    START = [torch.randn(N, generator=_g), torch.randn(N, generator=_g), torch.zeros(N), torch.zeros(N)]
    _ref = [t.clone() for t in START]
    reference_adam_(*_ref, HP)
    WANT = [t.numpy().copy() for t in _ref]
    WORK = [t.clone() for t in START]
    BLOB = RULES["adam"].pack(HP)

    def step_and_check(threads=2):
        p, g, m, v = (t.numpy() for t in WORK)
        for dst, src in zip((p, g, m, v), START):
            dst[:] = src.numpy()
        _cpu.step("adam", [WORK[0].data_ptr()], [WORK[1].data_ptr()], [[WORK[2].data_ptr()], [WORK[3].data_ptr()]],
                  [N], 0, 0, BLOB, threads)
        assert np.array_equal(p, WANT[0]) and np.array_equal(v, WANT[3])

    def in_child(body):
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)  # a hang ends the child with SIGALRM
            try:
                body()
            except BaseException as exc:
                print("CHILD FAILED", repr(exc), flush=True)
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        return status
""")

SCENARIOS = {
    # The parent used torch's OpenMP threads but never a multi-threaded step of ours: the child
    # must not call into the OpenMP runtime it inherited (its team threads are gone).
    "parent_never_stepped": """
        torch.set_num_threads(2)
        (torch.randn(1 << 23) * 2).sin().sum()
        def child():
            assert _cpu.thread_pool() == "own", _cpu.thread_pool()
            step_and_check()
        assert in_child(child) == 0
    """,
    # Our own pool ran in the parent; the child starts a thread of its own (which may reuse a dead
    # worker's descriptor) before it steps, several times.
    "own_pool_then_a_thread": """
        _cpu.use_torch_openmp(False)
        step_and_check()
        def child():
            t = threading.Thread(target=lambda: None)
            t.start(); t.join()
            for _ in range(3):
                step_and_check()
        assert in_child(child) == 0
    """,
    # Pinning in the child must pin the child's threads, not the dead workers' (whose thread ids
    # the thread library has reset, which would mean the calling thread).
    "pin_in_child": """
        _cpu.use_torch_openmp(False)
        step_and_check()
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        def child():
            if not cores:
                return  # no affinity API (macOS): pinning is a no-op there
            _cpu.pin_pool([cores[0], cores[-1]], True)
            assert sorted(os.sched_getaffinity(0)) == sorted({cores[0], cores[-1]}), os.sched_getaffinity(0)
            step_and_check()
        assert in_child(child) == 0
    """,
    # Another thread of the parent is inside a step (holding the pool's run lock) when the fork
    # happens: the child must not inherit the held lock.
    "fork_during_a_step": """
        _cpu.use_torch_openmp(False)
        stop = threading.Event()
        def loop():
            while not stop.is_set():
                step_and_check()
        t = threading.Thread(target=loop)
        t.start()
        try:
            statuses = [in_child(step_and_check) for _ in range(8)]
        finally:
            stop.set(); t.join()
        assert statuses == [0] * 8, statuses
    """,
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_fork_child_steps(scenario):
    code = PRELUDE + textwrap.dedent(SCENARIOS[scenario]) + "\nprint('OK')\n"
    env = dict(os.environ, PYTHONPATH=str(Path(mps_fused_adam.__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
