"""Tier 1 and PyTorch's MPS streams, in the emulator (tests/support/emulated_mps.py).

What torch::mps's hooks do per release is read from the macOS wheels by tests/test_apple_artifacts.py
(HOOKS_CURRENT_STREAM_MIN_TORCH): up to 2.14 they take the default stream; from 2.15 the calling
thread's current stream, and getCommandBuffer aborts off that stream's queue. The stand-in hooks
(FakeTorchMps) do the same, and the stand-in ``_metal`` reaches them the way metal_adam.mm does, so
these tests show where a step under a non-default current stream is encoded, with real numbers.
Untested on Apple hardware.
"""
from __future__ import annotations

import pytest
import torch

from emulated_mps import DispatchAssertQueueFailed, FakeMetalExt, FakeTorchMps, make_backend
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.backends.mps import HOOKS_CURRENT_STREAM_MIN_TORCH
from mps_fused_adam.numerics.reference import reference_adam_

SIZES = (5, 4097, 64)


def group(seed: int = 0) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {"p": [torch.randn(n, generator=gen) for n in SIZES],
            "g": [torch.randn(n, generator=gen) * 0.1 for n in SIZES],
            "m": [torch.randn(n, generator=gen) * 0.01 for n in SIZES],
            "v": [torch.rand(n, generator=gen) * 1e-3 for n in SIZES]}


def clone(t):
    return {k: [x.clone() for x in v] for k, v in t.items()}


HP = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 3)


def step(backend, t) -> None:
    backend.update("adam", t["p"], t["g"], [t["m"], t["v"]], HP)


def reference(t):
    want = clone(t)
    for p, g, m, v in zip(want["p"], want["g"], want["m"], want["v"]):
        reference_adam_(p, g, m, v, HP)
    return want


def assert_bits(got, want) -> None:
    for k in want:
        for a, b in zip(got[k], want[k]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), k


def tier1(emu, pkg, mps: FakeTorchMps):
    ext = FakeMetalExt(emu, torch_mps=mps)
    backend = make_backend(1, pkg, emu, ext=ext)
    for s in mps._all:  # the first-use probe ran on the default stream: count only the steps
        s.encoders.clear()
    return backend


def test_gate_is_2_15():
    assert HOOKS_CURRENT_STREAM_MIN_TORCH == (2, 15)
    assert FakeTorchMps((2, 15)).follows_current and not FakeTorchMps((2, 14)).follows_current


def test_torch_2_15_step_is_encoded_on_the_callers_current_stream(emu, pkg):
    mps = FakeTorchMps((2, 15))
    backend = tier1(emu, pkg, mps)
    side = mps.new_stream("side")
    t = group()
    want = reference(t)
    with mps.stream(side):
        step(backend, t)
    # One encoder, on the side stream's command buffer, one dispatch per tensor; nothing on the
    # default stream; nothing committed (PyTorch commits its own command buffer).
    assert mps.encoded() == [("side", len(SIZES))]
    assert side.commits == mps.default.commits == 0
    assert_bits(t, want)
    # Back on the default stream, the next step is encoded there.
    step(backend, t)
    assert mps.encoded() == [("default", len(SIZES)), ("side", len(SIZES))]


def test_torch_2_14_step_is_encoded_on_the_default_stream_whatever_is_current(emu, pkg):
    """2.14 has a stream pool behind private names only, and its hooks take the default stream: a
    step there goes to the default stream even when a pool stream was made current."""
    mps = FakeTorchMps((2, 14))
    backend = tier1(emu, pkg, mps)
    side = mps.new_stream("side")
    t = group(1)
    want = reference(t)
    with mps.stream(side):
        step(backend, t)
    assert mps.encoded() == [("default", len(SIZES))]
    assert_bits(t, want)


def test_steps_on_two_threads_each_go_to_their_threads_stream(emu, pkg):
    import threading
    mps = FakeTorchMps((2, 15))
    backend = tier1(emu, pkg, mps)
    streams = [mps.new_stream(f"s{i}") for i in range(2)]
    groups = [group(10 + i) for i in range(2)]
    wants = [reference(g) for g in groups]
    errors: list[BaseException] = []

    def worker(i):
        try:
            mps.set_stream(streams[i])
            step(backend, groups[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert sorted(mps.encoded()) == [("s0", len(SIZES)), ("s1", len(SIZES))]
    for g, w in zip(groups, wants):
        assert_bits(g, w)


def test_block_on_another_thread_encodes_nothing_and_says_so(emu, pkg):
    """Were GCD to run the block on another thread, that thread's current stream would be the
    default one: the queue check inside the block refuses before the command buffer is touched
    (2.15's getCommandBuffer would abort there), and the step raises with nothing updated."""
    mps = FakeTorchMps((2, 15))
    backend = tier1(emu, pkg, mps)
    mps.blocks_elsewhere = True
    side = mps.new_stream("side")
    t = group(2)
    before = clone(t)
    with mps.stream(side), pytest.raises(RuntimeError, match="another MPS stream; nothing was encoded"):
        step(backend, t)
    assert mps.encoded() == []
    assert_bits(t, before)
    # On the default stream the other thread sees the same stream, so the step runs.
    step(backend, t)
    assert mps.encoded() == [("default", len(SIZES))]
    assert_bits(t, reference(before))


def test_hooks_abort_off_their_queue_from_2_15():
    """The stand-in hooks keep 2.15's dispatch_assert_queue: calling get_command_buffer() or
    commit() outside dispatch_sync on the stream's queue fails, as it aborts in torch; in 2.14
    they do not check."""
    new, old = FakeTorchMps((2, 15)), FakeTorchMps((2, 14))
    with pytest.raises(DispatchAssertQueueFailed):
        new.get_command_buffer()
    with pytest.raises(DispatchAssertQueueFailed):
        new.commit()
    side = new.new_stream("side")
    with new.stream(side):
        got = []
        new.dispatch_sync(new.get_dispatch_queue(), lambda: got.append(new.get_command_buffer()))
        assert got == [side]
        with pytest.raises(DispatchAssertQueueFailed):  # the default stream's queue is not side's
            new.dispatch_sync(new.default.queue, new.get_command_buffer)
    assert old.get_command_buffer() is old.default
