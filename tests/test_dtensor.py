"""DTensor params (FSDP2's fully_shard on the CPU, over gloo): every optimizer class that supports
them steps each rank's shards bit for bit as it steps the unsharded model, its states are DTensors
laid out as their params and survive a torch.distributed.checkpoint round trip, and a grad or
state laid out otherwise is refused naming the param, before anything changes
(tests/support/dtensor_worker.py runs the ranks)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mps_fused_adam as mfa

from optim_db import OPTIM_DB

WORKER = Path(__file__).resolve().parent / "support" / "dtensor_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def found(request, tmp_path_factory):
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("this torch has no gloo backend")
    out = tmp_path_factory.mktemp("dtensor") / "found.json"
    proc = subprocess.run([sys.executable, str(WORKER), str(request.param), str(_free_port()), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "exception" not in result, result["exception"]
    return result


OPTIMIZERS = [label for info in OPTIM_DB.values() for label in info.dtensor]  # what the worker steps


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_step_is_the_unsharded_step(found, name, dtype):
    assert found[f"{name} {dtype}"] == "same"
    assert found[f"{name} {dtype} after a checkpoint"] == "same"


def test_worker_covers_every_optimizer(found):
    assert sorted(k for k in found if k.endswith("torch.float32")) == sorted(f"{n} torch.float32" for n in OPTIMIZERS)


def test_misplaced_grads_are_refused_naming_the_param(found):
    assert "its grad must be laid out as the param" in found["replicated grad"]
    assert "grad.redistribute(p.device_mesh, p.placements) gives it that layout" in found["replicated grad"]
    assert "Replicate()" in found["replicated grad"] and "Shard(dim=0)" in found["replicated grad"]
    assert "so its grad must be one laid out alike; got a Tensor" in found["plain grad"]
    assert "but its grad is a DTensor" in found["DTensor grad of a plain param"]
    assert all(found[k].startswith("param_groups[0]['params'][0]: ")
               for k in ("replicated grad", "plain grad", "DTensor grad of a plain param", "8-bit"))
    assert found["unchanged after the errors"] is True


def test_8bit_refuses_dtensor_params(found):
    assert "AdamW8bit does not step DTensor params" in found["8-bit"]


def test_8bit_refuses_dtensor_grads_and_states_of_plain_params(found):
    """Only DTensor params were refused: a DTensor grad of a plain param crashed the 8-bit kernel
    (SIGSEGV, the param's global size read from a local shard), and a DTensor state failed in the
    kernel call ('tensor 0 has address 0') after the step had been counted."""
    assert "but its grad is a DTensor" in found["8-bit DTensor grad of a plain param"]
    assert "but its state 'exp_avg' is a DTensor" in found["8-bit DTensor state of a plain param"]
    assert found["8-bit unchanged after the errors"] is True


def test_stochastic_rounding_refuses_bf16_dtensor_params(found):
    """Its random bits follow the local shard's element index and a seed from each rank's RNG:
    replicas of a Replicate param drifted apart, so bf16 DTensor params are refused, unchanged."""
    assert "bf16_stochastic_round=True does not step bf16 DTensor params" in found["stochastic rounding"]
    assert found["stochastic rounding"].startswith("param_groups[0]['params'][0]: ")
    assert found["stochastic rounding unchanged"] is True


def test_plain_params_pay_no_dtensor_isinstance(monkeypatch):
    """torch.distributed.tensor is loaded with torch._dynamo, so the full step path runs beside a
    DTensor class almost always: plain params are told apart by their exact type, without an
    isinstance against DTensor per tensor (which made the path about 40% slower)."""
    from mps_fused_adam.optimizers import dtensor

    class Meta(type):
        calls = 0

        def __instancecheck__(cls, obj):
            Meta.calls += 1
            return False

    class FakeDTensor(metaclass=Meta):
        pass

    monkeypatch.setattr(dtensor, "dtensor_type", lambda: FakeDTensor)
    ps = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    # bf16_stochastic_round groups take the full path every step (fp32 params: plain Adam).
    opt = mfa.AdamW(ps, lr=1e-2, bf16_stochastic_round=True)
    for step in range(3):
        for p in ps:
            p.grad = torch.randn(5)
        if step == 1:
            Meta.calls = 0  # the first step's new states may look; the steps after may not
        opt.step()
    assert Meta.calls == 0
    assert all(opt.state[p]["step"] == 3 for p in ps)


def test_grads_from_a_backward_through_fsdp2(found):
    # The same input on every rank: the averaged grads are the unsharded model's, so the steps are.
    assert found["backward through FSDP2"] == 0.0
