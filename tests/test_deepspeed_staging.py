"""CPU staging of MPS tensors for gloo (mps_fused_adam/deepspeed/staging.py), issue 13 items 3 and 4.

"MPS tensors" here are CPU tensors of a marker subclass whose ``.to("cpu")`` returns a plain
copy, as a real MPS tensor's does; both this package's and DeepSpeed 0.19's staging are told to
treat the subclass as MPS. The fake collectives emulate two ranks: they combine the staged
argument with fixed values of "the other rank".
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "support" / "deepspeed_support"))
import dsenv  # noqa: E402


class OnMPS(torch.Tensor):
    """Marker for a device tensor: ``.to("cpu")`` gives a plain CPU copy (a real MPS tensor's does)."""

    def to(self, *args, **kwargs):
        return torch.Tensor.clone(self).as_subclass(torch.Tensor)


def mps(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).as_subclass(OnMPS)


def is_mps(t) -> bool:
    return isinstance(t, OnMPS)


@pytest.fixture
def staging(monkeypatch):
    from mps_fused_adam.deepspeed import staging
    monkeypatch.setattr(staging, "needs_staging", is_mps)
    return staging


OTHER = torch.tensor([10.0, 11.0, 12.0, 13.0])  # "rank 1"'s input


class FakeWork:
    def __init__(self, on_wait=None):
        self.on_wait, self.waited = on_wait, False

    def wait(self):
        if self.on_wait:
            self.on_wait()
        self.waited = True
        return True

    def is_completed(self):
        return self.waited


class Backend:
    """Collectives of two ranks, this one and OTHER; they refuse device tensors, as gloo does."""

    seen: list = []

    @staticmethod
    def _host(*tensors):
        for t in tensors:
            assert not is_mps(t), "a device tensor reached the collective"
            Backend.seen.append(t)

    def reduce_scatter_tensor(self, output_tensor, input_tensor, op=None, group=None, async_op=False):
        self._host(output_tensor, input_tensor)
        n = output_tensor.numel()
        output_tensor.copy_(input_tensor[:n] + OTHER[:n])  # rank 0's chunk of the sum
        return FakeWork() if async_op else None

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        self._host(output_tensor, input_tensor)
        n = input_tensor.numel()
        output_tensor[:n].copy_(input_tensor)
        output_tensor[n:].copy_(OTHER[:n])
        return FakeWork() if async_op else None

    def all_gather_coalesced(self, output_tensors, input_tensors, group=None, async_op=False):
        self._host(*output_tensors, *input_tensors)
        for out, inp in zip(output_tensors, input_tensors):
            n = inp.numel()
            out[:n].copy_(inp)
            out[n:].copy_(OTHER[:n])
        return FakeWork() if async_op else None

    def all_to_all(self, output_tensor_list, input_tensor_list, group=None, async_op=False):
        self._host(*output_tensor_list, *input_tensor_list)
        output_tensor_list[0].copy_(input_tensor_list[0])
        output_tensor_list[1].copy_(OTHER[:output_tensor_list[1].numel()])
        return FakeWork() if async_op else None

    # The rest of TorchBackend's collectives (DeepSpeed 0.19.8's signatures). Asynchronous ones
    # deliver on wait(), as a real handle may; every read-only argument is scribbled over after it
    # was read (-1), so a wrapper that copied an input back would show it.
    @staticmethod
    def _done(async_op, deliver, inputs=()):
        def run():
            deliver()
            for t in inputs:
                t.fill_(-1.0)
        if async_op:
            return FakeWork(on_wait=run)
        run()
        return None

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self._host(tensor)
        return self._done(async_op, lambda: tensor.add_(OTHER[:tensor.numel()]))

    def reduce(self, tensor, dst, op=None, group=None, async_op=False):
        self._host(tensor)
        assert dst == 0  # this rank receives the sum
        return self._done(async_op, lambda: tensor.add_(OTHER[:tensor.numel()]))

    def broadcast(self, tensor, src, group=None, async_op=False):
        self._host(tensor)
        assert src == 1  # from the other rank
        return self._done(async_op, lambda: tensor.copy_(OTHER[:tensor.numel()]))

    def reduce_scatter(self, output, input_list, op=None, group=None, async_op=False):
        self._host(output, *input_list)
        n = output.numel()  # rank 0's chunk: its input_list[0] plus the other rank's
        return self._done(async_op, lambda: output.copy_(input_list[0] + OTHER[:n]), input_list)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        self._host(output, input)
        h = input.numel() // 2  # even splits: our first half stays, the other rank's first half arrives

        def deliver():
            output[:h].copy_(input[:h])
            output[h:].copy_(OTHER[:h])
        return self._done(async_op, deliver, [input])

    def gather(self, tensor, gather_list=None, dst=0, group=None, async_op=False):
        self._host(tensor, *gather_list)
        assert dst == 0

        def deliver():
            gather_list[0].copy_(tensor)
            gather_list[1].copy_(OTHER[:tensor.numel()])
        return self._done(async_op, deliver, [tensor])

    def scatter(self, tensor, scatter_list=None, src=0, group=None, async_op=False):
        self._host(tensor, *scatter_list)
        assert src == 0
        return self._done(async_op, lambda: tensor.copy_(scatter_list[0]), scatter_list)

    def send(self, tensor, dst, group=None, tag=0):
        self._host(tensor)
        tensor.fill_(-1.0)

    def recv(self, tensor, src=None, group=None, tag=0):
        self._host(tensor)
        tensor.copy_(OTHER[:tensor.numel()])
        return 1  # the sender's rank, as torch.distributed.recv returns

    def isend(self, tensor, dst, group=None, tag=0):
        self._host(tensor)
        return FakeWork(on_wait=lambda: tensor.fill_(-1.0))

    def irecv(self, tensor, src=None, group=None, tag=0):
        self._host(tensor)
        return FakeWork(on_wait=lambda: tensor.copy_(OTHER[:tensor.numel()]))

    def batch_isend_irecv(self, p2p_op_list):
        works = []
        for op in p2p_op_list:
            self._host(op.tensor)
            if op.op == "irecv":
                works.append(FakeWork(on_wait=lambda t=op.tensor: t.copy_(OTHER[:t.numel()])))
            else:
                works.append(FakeWork())
        return works


class P2POp:  # DeepSpeed's form: the op as a name
    def __init__(self, op, tensor, peer):
        self.op, self.tensor, self.peer = op, tensor, peer


def wrapped_backend(staging):
    cls = type("B", (Backend,), {})
    wrapped = staging.install_cpu_staging(cls)
    assert {"reduce_scatter_tensor", "all_gather_into_tensor", "all_gather_coalesced", "all_to_all",
            "batch_isend_irecv"} <= set(wrapped)
    assert staging.install_cpu_staging(cls) == []  # once
    return cls()


@pytest.mark.parametrize("async_op", [False, True])
def test_reduce_scatter_output_aliasing_its_input(staging, async_op):
    """ZeRO-3's gradient reduce-scatter: the output is a slice of the input. The reduced values
    must survive; copying the input back after the output (issue 13, item 3) restores [0, 1]."""
    b = wrapped_backend(staging)
    flat = mps([0.0, 1.0, 2.0, 3.0])
    out = flat[:2]
    assert is_mps(out)
    work = b.reduce_scatter_tensor(out, flat, None, None, async_op)
    if async_op:
        assert torch.equal(flat, torch.tensor([0.0, 1.0, 2.0, 3.0]))  # nothing before wait()
        work.wait()
        work.wait()  # a second wait copies nothing again
    assert torch.equal(out, torch.tensor([10.0, 12.0]))
    assert torch.equal(flat, torch.tensor([10.0, 12.0, 2.0, 3.0]))


def test_all_gather_input_aliasing_its_output(staging):
    """ZeRO-3's parameter all-gather: the input is a slice of the output."""
    b = wrapped_backend(staging)
    flat = mps([5.0, 6.0, 0.0, 0.0])
    b.all_gather_into_tensor(flat, flat[:2])
    assert torch.equal(flat, torch.tensor([5.0, 6.0, 10.0, 11.0]))


def test_stub_releases_gain_coalesced_all_to_all_and_batch_p2p(staging):
    """Issue 13, item 4: all_gather_coalesced, list-form all_to_all and batch_isend_irecv."""
    b = wrapped_backend(staging)
    outs, ins = [mps([0.0, 0.0]), mps([0.0, 0.0, 0.0, 0.0])], [mps([1.0]), mps([2.0, 3.0])]
    b.all_gather_coalesced(outs, ins)
    assert torch.equal(outs[0], torch.tensor([1.0, 10.0])) and torch.equal(outs[1], torch.tensor([2.0, 3.0, 10.0, 11.0]))
    assert torch.equal(ins[1], torch.tensor([2.0, 3.0]))

    outs, ins = [mps([0.0]), mps([0.0, 0.0])], [mps([7.0]), mps([8.0, 9.0])]
    work = b.all_to_all(outs, ins, None, True)
    assert torch.equal(outs[0], torch.tensor([0.0]))
    work.wait()
    assert torch.equal(outs[0], torch.tensor([7.0])) and torch.equal(outs[1], torch.tensor([10.0, 11.0]))

    # One handle per op (gloo): a receive's own wait() delivers it, as without staging.
    send, recv, recv2 = mps([4.0]), mps([0.0, 0.0]), mps([0.0])
    ops = [P2POp("isend", send, 1), P2POp("irecv", recv, 1), P2POp("irecv", recv2, 1)]
    works = b.batch_isend_irecv(ops)
    assert ops[1].tensor is recv  # the caller's ops are not modified
    assert torch.equal(recv, torch.tensor([0.0, 0.0]))  # nothing before wait()
    works[1].wait()
    assert torch.equal(recv, torch.tensor([10.0, 11.0])) and torch.equal(recv2, torch.tensor([0.0]))
    recv.fill_(5.0)
    works[1].wait()  # a second wait copies nothing again
    assert torch.equal(recv, torch.tensor([5.0, 5.0]))
    works[2].wait()
    works[0].wait()
    assert torch.equal(recv2, torch.tensor([10.0])) and torch.equal(send, torch.tensor([4.0]))


def test_coalesced_batch_p2p_copies_back_after_its_handle(staging):
    """A backend that coalesces the batch into one handle (NCCL's form): the receives are
    copied back when that handle has been waited on."""
    class Coalesced(Backend):
        def batch_isend_irecv(self, p2p_op_list):
            works = super().batch_isend_irecv(p2p_op_list)
            return [FakeWork(on_wait=lambda: [w.wait() for w in works])]
    cls = type("C", (Coalesced,), {})
    staging.install_cpu_staging(cls)
    send, recv = mps([4.0]), mps([0.0, 0.0])
    works = cls().batch_isend_irecv([P2POp("isend", send, 1), P2POp("irecv", recv, 1)])
    assert len(works) == 1 and torch.equal(recv, torch.tensor([0.0, 0.0]))
    works[0].wait()
    assert torch.equal(recv, torch.tensor([10.0, 11.0])) and torch.equal(send, torch.tensor([4.0]))


def test_host_tensors_are_not_staged(staging):
    b = wrapped_backend(staging)
    Backend.seen.clear()
    flat = torch.tensor([0.0, 1.0, 2.0, 3.0])
    b.reduce_scatter_tensor(flat[:2], flat)
    assert Backend.seen[1] is flat and torch.equal(flat, torch.tensor([10.0, 12.0, 2.0, 3.0]))


def test_deepspeed_019_staging_is_bypassed(staging, monkeypatch):
    """DeepSpeed 0.19's own stage_on_cpu copies every argument back in argument order; with ours
    around it, its staging sees CPU tensors only and ZeRO-3's reduce-scatter keeps its result."""
    dsenv.require_deepspeed()
    import importlib
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # `import a.b.torch as x` finds torch itself
    if not hasattr(ds_torch, "stage_on_cpu"):
        pytest.skip(f"DeepSpeed {__import__('deepspeed').__version__} has no staging of its own")
    monkeypatch.setattr(ds_torch, "_needs_cpu_staging", is_mps)

    def fake_reduce_scatter_tensor(output_tensor, input_tensor, op=None, group=None, async_op=False):
        Backend._host(output_tensor, input_tensor)
        output_tensor.copy_(input_tensor[:output_tensor.numel()] + OTHER[:output_tensor.numel()])

    theirs_cls = type("Theirs", (ds_torch.TorchBackend,), {})
    theirs = theirs_cls.__new__(theirs_cls)  # no process group: the collective is faked
    theirs.reduce_scatter_function = fake_reduce_scatter_tensor
    flat = mps([0.0, 1.0, 2.0, 3.0])
    theirs.reduce_scatter_tensor(flat[:2], flat, torch.distributed.ReduceOp.SUM, None, False)
    assert torch.equal(flat[:2], torch.tensor([0.0, 1.0])), "DeepSpeed's staging alone is expected to lose the result"

    ours_cls = type("Ours", (ds_torch.TorchBackend,), {})
    assert "reduce_scatter_tensor" in staging.install_cpu_staging(ours_cls)
    ours = ours_cls.__new__(ours_cls)
    ours.reduce_scatter_function = fake_reduce_scatter_tensor
    flat = mps([0.0, 1.0, 2.0, 3.0])
    ours.reduce_scatter_tensor(flat[:2], flat, torch.distributed.ReduceOp.SUM, None, False)
    assert torch.equal(flat, torch.tensor([10.0, 12.0, 2.0, 3.0]))


def test_tensors_that_require_grad(staging):
    """Collectives are outside autograd: staging a parameter-like leaf that requires grad (grad
    mode on) neither records autograd ops nor trips autograd's in-place checks (DeepSpeed 0.18.9's
    ZeRO-2 step all-gathers into such a buffer)."""
    b = wrapped_backend(staging)
    flat = mps([0.0, 1.0, 2.0, 3.0]).requires_grad_()
    with torch.enable_grad():
        b.all_gather_into_tensor(flat, flat[2:].detach())
    assert torch.equal(flat.detach(), torch.tensor([2.0, 3.0, 10.0, 11.0]))
    assert flat.grad_fn is None and flat.is_leaf


def _collective_case(name):
    """(positional arguments before async_op, [(device output, its value after)], [device inputs])
    of one collective between this rank and OTHER."""
    if name == "all_reduce":
        t = mps([1.0, 2.0])
        return (t, None, None), [(t, [11.0, 13.0])], []
    if name == "reduce":
        t = mps([1.0, 2.0])
        return (t, 0, None, None), [(t, [11.0, 13.0])], []
    if name == "broadcast":
        t = mps([1.0, 2.0])
        return (t, 1, None), [(t, [10.0, 11.0])], []
    if name == "reduce_scatter":
        out, ins = mps([0.0, 0.0]), [mps([1.0, 2.0]), mps([3.0, 4.0])]
        return (out, ins, None, None), [(out, [11.0, 13.0])], ins
    if name == "all_to_all_single":
        out, inp = mps([0.0, 0.0, 0.0, 0.0]), mps([1.0, 2.0, 3.0, 4.0])
        return (out, inp, None, None, None), [(out, [1.0, 2.0, 10.0, 11.0])], [inp]
    if name == "gather":
        t, gl = mps([1.0, 2.0]), [mps([0.0, 0.0]), mps([0.0, 0.0])]
        return (t, gl, 0, None), [(gl[0], [1.0, 2.0]), (gl[1], [10.0, 11.0])], [t]
    if name == "scatter":
        t, sl = mps([0.0, 0.0]), [mps([5.0, 6.0]), mps([7.0, 8.0])]
        return (t, sl, 0, None), [(t, [5.0, 6.0])], sl
    if name in ("recv", "irecv"):
        t = mps([0.0, 0.0])
        return (t, 1, None, 0), [(t, [10.0, 11.0])], []
    if name in ("send", "isend"):
        t = mps([1.0, 2.0])
        return (t, 1, None, 0), [], [t]
    raise AssertionError(name)


_ASYNC_OP = ["all_reduce", "reduce", "broadcast", "reduce_scatter", "all_to_all_single", "gather", "scatter"]
_COLLECTIVE_CASES = ([(n, False) for n in _ASYNC_OP + ["send", "recv"]] + [(n, True) for n in _ASYNC_OP]
                     + [("isend", True), ("irecv", True)])


@pytest.mark.parametrize("name,is_async", _COLLECTIVE_CASES,
                         ids=[f"{n}-{'async' if a else 'sync'}" for n, a in _COLLECTIVE_CASES])
def test_each_collective_copies_back_its_outputs_only(staging, name, is_async):
    """Every staged collective: the device outputs hold what the collective wrote (after wait() when
    asynchronous, untouched before it), and the device inputs keep their values although the
    collective scribbled over its copies of them."""
    import inspect
    # The fake takes the arguments under the names staging binds them to (DeepSpeed's).
    assert tuple(inspect.signature(getattr(Backend, name)).parameters)[1:] == staging.SIGNATURES[name]
    b = wrapped_backend(staging)
    assert name in type(b).__dict__  # wrapped on the class
    args, outputs, inputs = _collective_case(name)
    outputs_before = [t.clone() for t, _ in outputs]
    inputs_before = [t.clone() for t in inputs]
    Backend.seen.clear()
    if name in ("send", "recv", "isend", "irecv"):
        result = getattr(b, name)(*args)
    else:
        result = getattr(b, name)(*args, is_async)
    assert Backend.seen  # the collective ran, on host copies
    if is_async:
        for (t, _), before in zip(outputs, outputs_before):
            assert torch.equal(t, before), f"{name}: a device output changed before wait()"
        result.wait()
    else:
        assert result == (1 if name == "recv" else None)
    for (t, want), before in zip(outputs, outputs_before):
        assert torch.equal(t, torch.tensor(want)), f"{name}: device output {t.tolist()}, want {want}"
    for t, before in zip(inputs, inputs_before):
        assert torch.equal(t, before), f"{name}: device input written back: {t.tolist()}"
    if is_async:
        for t, _ in outputs:
            t.fill_(7.0)
        result.wait()  # a second wait copies nothing again
        assert all(torch.equal(t, torch.full_like(t, 7.0)) for t, _ in outputs)
