"""Ours against torch's own optimizer database (``torch.testing._internal.common_optimizers.optim_db``,
from the installed torch wheel): for each class of ours that stands in for a torch optimizer, every
input of torch's entry (``optim_inputs_func``, with the global flags torch's generic tests add:
foreach, fused, differentiable, maximize) runs on ours and on torch's side by side, and every error
input (``optim_error_inputs_func``) must raise torch's exception type and message. A new torch
release's new inputs reach these tests without anyone writing them.

The differences we make deliberately are listed below (``REFUSED``, ``EXTRA_GROUP_KEYS``), each
with its reason; anything else that differs fails. docs/torch-compat.md is the user's version.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

import mps_fused_adam as mfa

from optim_db import OPTIM_DB

try:  # torch's test helpers import expecttest, which the [test] extra installs
    from torch.testing._internal import common_optimizers
except ImportError:
    if os.environ.get("MFA_REQUIRE_TOOLS"):  # CI: a missing database is a failure, not a skip
        raise
    pytest.skip("torch's optimizer database needs expecttest (pip install expecttest==0.3.0, the [test] extra)",
                allow_module_level=True)
OptimizerErrorEnum = common_optimizers.OptimizerErrorEnum

# Ours -> the torch class whose database entry drives it.
PAIRS = [(mfa.Adam, torch.optim.Adam), (mfa.AdamW, torch.optim.AdamW), (mfa.Adagrad, torch.optim.Adagrad)]

# Options of torch's that change the algorithm and that we do not implement: refused with a
# ValueError naming the option (never stepped without it). amsgrad: another update rule (a third
# state, max_exp_avg_sq) that the kernels do not have; capturable: CUDA-graph capture of the step
# count on the device (our counts live on the host, and Apple has no CUDA graphs); differentiable:
# autograd through the step, which a fused kernel cannot give.
REFUSED = {torch_cls.__name__: OPTIM_DB[ours.__name__].refused for ours, torch_cls in PAIRS}  # tests/optim_db.py

# Group keys of ours that torch's groups lack: none. (bf16_stochastic_round=True, an option of ours
# that no database input sets, adds its key; torch ignores it when it loads our state dicts.)
EXTRA_GROUP_KEYS = {"Adam": set(), "AdamW": set(), "Adagrad": set()}


def _info(torch_cls):
    return next(i for i in common_optimizers.optim_db if i.optim_cls is torch_cls)


def _inputs(torch_cls):
    """torch's inputs for ``torch_cls`` on CPU fp32, each also with the global flags torch's
    generic tests try (the implementation switches, differentiable, maximize flipped)."""
    out = []
    for oi in _info(torch_cls).optim_inputs_func(device="cpu", dtype=torch.float32):
        kw = dict(oi.kwargs)
        out.append((oi.desc, kw))
        for flag in ("foreach", "fused", "differentiable"):
            out.append((f"{oi.desc}, {flag}", {**kw, flag: True}))
        out.append((f"{oi.desc}, maximize flipped", {**kw, "maximize": not kw.get("maximize", False)}))
    return out


def _cases():
    return [pytest.param(ours, theirs, kw, id=f"{ours.__name__}-{desc}")
            for ours, theirs in PAIRS for desc, kw in _inputs(theirs)]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(10, 5, generator=g)), torch.nn.Parameter(torch.randn(10, generator=g))]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _run(opt, params, steps, start=0):
    for s in range(start, start + steps):
        for p, g in zip(params, _grads(s, params)):
            p.grad = g
        opt.step()


def _bound(ref: torch.Tensor) -> float:
    """The contract's agreement bound for implementations that order the math differently."""
    return 8 * torch.finfo(ref.dtype).eps * max(ref.abs().max().item(), 1.0)


def _assert_close(ours, theirs, what):
    torch.testing.assert_close(ours, theirs, rtol=0, atol=_bound(theirs), msg=lambda m: f"{what}: {m}")


def _assert_same_structure(ours_sd, theirs_sd, name):
    """torch's group keys and per-param state keys, with the same values where they are torch's
    keys; step counts equal and in torch's form (a 0-dim tensor)."""
    assert len(ours_sd["param_groups"]) == len(theirs_sd["param_groups"])
    for go, gt in zip(ours_sd["param_groups"], theirs_sd["param_groups"]):
        assert set(go) - set(gt) == EXTRA_GROUP_KEYS[name] and set(gt) <= set(go)
        for key in gt:
            if key not in ("lr", "betas"):  # compared below: a Tensor lr is compared by value
                assert go[key] == gt[key], key
        assert float(go["lr"]) == float(gt["lr"])
        if "betas" in gt:
            assert [float(b) for b in go["betas"]] == [float(b) for b in gt["betas"]]
    assert ours_sd["state"].keys() == theirs_sd["state"].keys()
    for k, st in theirs_sd["state"].items():
        mine = ours_sd["state"][k]
        assert mine.keys() == st.keys()
        assert isinstance(mine["step"], torch.Tensor) and mine["step"].dim() == 0
        assert mine["step"].dtype == st["step"].dtype and float(mine["step"]) == float(st["step"])


def _construct(cls, kw, params):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on fused/foreach defaults are not the subject
        return cls(params, **copy.deepcopy(kw))


@pytest.mark.parametrize("ours_cls, torch_cls, kwargs", _cases())
def test_database_inputs_side_by_side(ours_cls, torch_cls, kwargs):
    """Each database input: the same error when torch refuses it; our ValueError for the options we
    refuse (REFUSED); otherwise the same results within the contract's bound, state dicts of torch's
    structure, and state dicts that load both ways and keep stepping alike."""
    name = torch_cls.__name__
    pt, po = _params(), _params()
    try:
        theirs = _construct(torch_cls, kwargs, pt)
    except Exception as e:
        with pytest.raises(type(e)) as got:
            _construct(ours_cls, kwargs, po)
        assert str(got.value) == str(e)
        return
    refused = [o for o in REFUSED[name] if kwargs.get(o)]
    if refused:
        with pytest.raises(ValueError, match=f"does not support {refused[0]}=True"):
            _construct(ours_cls, kwargs, po)
        return
    ours = _construct(ours_cls, kwargs, po)
    _run(theirs, pt, 3)
    _run(ours, po, 3)
    for i, (a, b) in enumerate(zip(po, pt)):
        _assert_close(a.detach(), b.detach(), f"param {i}")
        for key, t in theirs.state[b].items():
            if key != "step":
                _assert_close(ours.state[a][key], t, f"param {i} state {key!r}")
    _assert_same_structure(ours.state_dict(), theirs.state_dict(), name)

    # Across: torch resumes from our state dict and we from torch's; both continue alike.
    pt2, po2 = [p.detach().clone().requires_grad_() for p in po], [p.detach().clone().requires_grad_() for p in pt]
    theirs2, ours2 = _construct(torch_cls, kwargs, pt2), _construct(ours_cls, kwargs, po2)
    theirs2.load_state_dict(copy.deepcopy(ours.state_dict()))
    ours2.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for opt, ps in ((theirs2, pt2), (ours2, po2), (theirs, pt), (ours, po)):
        _run(opt, ps, 2, start=3)
    for a, b, c, d in zip(po, pt, pt2, po2):
        for x in (a, c, d):
            _assert_close(x.detach(), b.detach(), "after resuming across")


def _error_cases():
    out = []
    for ours, theirs in PAIRS:
        for i, ei in enumerate(_info(theirs).optim_error_inputs_func(device="cpu", dtype=torch.float32)):
            out.append(pytest.param(ours, theirs, i, id=f"{ours.__name__}-{ei.optimizer_error_input.desc}"))
    return out


def _outcome(cls, ei, step):
    """What constructing (and, for step errors, stepping) ``cls`` on the error input gives: the
    exception or the warnings raised, as (type, message) pairs."""
    oi = ei.optimizer_error_input
    params = oi.params if oi.params is not None else [torch.nn.Parameter(torch.randn(2, 2))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt = cls(params, **oi.kwargs)
            if step:
                opt.step()
        except Exception as e:
            return [(type(e), str(e))]
    return [(w.category, str(w.message)) for w in caught if issubclass(w.category, ei.error_type)]


@pytest.mark.parametrize("ours_cls, torch_cls, index", _error_cases())
def test_database_error_inputs_same_error(ours_cls, torch_cls, index):
    """Every error input of torch's entry: torch's exception (or warning) type and message, word for
    word, from ours (no error input of the database is among our deliberate differences)."""
    ei = _info(torch_cls).optim_error_inputs_func(device="cpu", dtype=torch.float32)[index]
    step = ei.error_on == OptimizerErrorEnum.STEP_ERROR
    expected = _outcome(torch_cls, ei, step)
    assert expected and expected[0][0] is ei.error_type  # the database's own claim, checked on torch
    assert _outcome(ours_cls, ei, step) == expected


@pytest.mark.parametrize("cls", [mfa.Adam, mfa.AdamW, mfa.CPUAdam, mfa.FusedAdam, mfa.Lion, mfa.FusedLion, mfa.Adagrad])
@pytest.mark.parametrize("named", [False, True])
def test_state_dict_identical_after_round_trip_and_deepcopy(cls, named):
    """torch's test_state_dict_deterministic, for every class: after load_state_dict and in
    copy.deepcopy(opt), the state dict equals the source's (no group gains a key, such as the
    'differentiable' torch's __setstate__ adds to the defaults), named parameters too."""
    def build(ps):
        return cls([(f"p{i}", p) for i, p in enumerate(ps)] if named else ps)
    pa, pb = _params(), _params(1)
    a = build(pa)
    _run(a, pa, 2)
    b = build(pb)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for other in (b, copy.deepcopy(a), copy.deepcopy(b)):
        sa, so = a.state_dict(), other.state_dict()
        assert sa["param_groups"] == so["param_groups"]
        assert sa["state"].keys() == so["state"].keys()
        for k in sa["state"]:
            assert sa["state"][k].keys() == so["state"][k].keys()
            for name, t in sa["state"][k].items():
                assert torch.equal(t, so["state"][k][name]) if isinstance(t, torch.Tensor) else t == so["state"][k][name]


def test_string_lr_raises_torchs_type_error_at_construction_and_step():
    p = torch.nn.Parameter(torch.randn(3))
    for cls in (mfa.Adam, mfa.AdamW, mfa.Adagrad, mfa.Lion):
        with pytest.raises(TypeError, match="'<=' not supported between instances of 'float' and 'str'"):
            cls([p], lr="1e-3")
    opt = mfa.AdamW([p])
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "lr": "1e-3"})
    opt.param_groups[1]["params"][0].grad = torch.ones(2)
    with pytest.raises(TypeError, match=r"^Invalid learning rate: '1e-3' is a str, not a number \(in param_groups\[1\]\)$"):
        opt.step()  # a group added with a string lr: refused at the step naming the group, nothing written
    assert not opt.state


def test_lion_tensor_lr_of_two_elements_gets_torchs_message():
    with pytest.raises(ValueError, match="^Tensor lr must be 1-element$"):
        mfa.Lion([torch.nn.Parameter(torch.randn(3))], lr=torch.tensor([1e-3, 1e-3]))


@pytest.mark.parametrize("option", ["amsgrad", "capturable", "differentiable"])
def test_group_that_turns_on_a_refused_option_is_refused_at_the_step(option):
    """An added group with amsgrad/capturable/differentiable is refused, not stepped without it."""
    opt = mfa.AdamW([torch.nn.Parameter(torch.randn(3))])
    q = torch.nn.Parameter(torch.randn(3))
    opt.add_param_group({"params": [q], option: True})
    q.grad = torch.ones(3)
    with pytest.raises(ValueError, match=f"AdamW does not support {option}=True"):
        opt.step()
    assert not opt.state


@pytest.mark.parametrize("cls, torch_cls", [(mfa.AdamW, torch.optim.AdamW), (mfa.Adagrad, torch.optim.Adagrad)])
def test_meta_params_fused_refused_as_torch_does(cls, torch_cls):
    """fused=True with meta params: torch's fused implementation's RuntimeError, word for word, at
    the first step, before any state is made; without fused both step meta params (meta states)."""
    outcomes = []
    for c in (torch_cls, cls):
        p = torch.nn.Parameter(torch.randn(3, device="meta"))
        p.grad = torch.randn(3, device="meta")
        opt = c([p], fused=True)
        with pytest.raises(RuntimeError, match="`fused=True` requires all the params") as e:
            opt.step()
        outcomes.append(str(e.value))
        if c is cls:
            assert not opt.state or all(k == "step" or k == "sum" for k in opt.state[p])
        p2 = torch.nn.Parameter(torch.randn(3, device="meta"))
        p2.grad = torch.randn(3, device="meta")
        opt2 = c([p2])
        opt2.step()
        assert all(t.is_meta for t in opt2.state[p2].values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    assert outcomes[0] == outcomes[1]


# Adagrad is left out: its states are made by the constructor, so with meta params they stay meta
# after to_empty, and torch's Adagrad then steps nothing, as ours does (docs/torch-compat.md).
@pytest.mark.parametrize("cls, torch_cls", [(mfa.Adam, torch.optim.Adam), (mfa.AdamW, torch.optim.AdamW)])
def test_meta_params_fused_then_materialised_steps_like_torch(cls, torch_cls):
    """torch's test_fused_error_on_params_on_meta, second half: after the refused meta step, the
    same optimizer steps once the model is materialised (``to_empty``), and ours lands where
    torch's does (within the contract's bound) from the same materialised values."""
    results = []
    for c in (torch_cls, cls):
        with torch.device("meta"):
            model = torch.nn.Linear(3, 2)
        opt = c(model.parameters(), fused=True)
        with torch.device("meta"):
            for p in model.parameters():
                p.grad = torch.rand_like(p)
        with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point Tensors"):
            opt.step()
        opt.zero_grad(set_to_none=True)
        model.to_empty(device="cpu")
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
                p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        assert all(not t.is_meta for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
        results.append([p.detach().clone() for p in model.parameters()])
    for t, o in zip(*results):
        bound = 8 * torch.finfo(torch.float32).eps * float(t.abs().max())
        assert float((t - o).abs().max()) <= bound


@pytest.mark.parametrize("cls", [mfa.Adam, mfa.AdamW, mfa.CPUAdam, mfa.Lion, mfa.Adagrad])
@pytest.mark.parametrize("named", [False, True])
def test_state_dict_survives_weights_only_load_and_deepcopy_keeps_public_attrs(cls, named, tmp_path):
    """torch's test_save_load_equality_with_weights_only and test_deepcopy_copies_all_public_attrs:
    our state dict loads back equal under ``torch.load(weights_only=True)`` (only tensors, numbers,
    strings and containers in it), and a deep copy has the same public attributes."""
    ps = _params()
    opt = cls([(f"p{i}", p) for i, p in enumerate(ps)] if named else ps)
    _run(opt, ps, 3)
    sd = opt.state_dict()
    torch.save(sd, tmp_path / "sd.pt")
    back = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert back["param_groups"] == sd["param_groups"]
    for k, st in sd["state"].items():
        assert back["state"][k].keys() == st.keys()
        for name, t in st.items():
            got = back["state"][k][name]
            assert torch.equal(got, t) if isinstance(t, torch.Tensor) else got == t
    public = {k for k in opt.__dict__ if not k.startswith("_")}
    assert public == {k for k in copy.deepcopy(opt).__dict__ if not k.startswith("_")}


def test_step_saved_as_tensor_loaded_from_int_and_live_count_is_int():
    """state['step'] (step_counts.py): an int while stepping, torch's 0-dim tensor in state_dict()
    (a copy: the live state keeps its int), and a state dict of an earlier version of ours (int
    steps) or of torch (tensor steps) loads and continues exactly as the optimizer that saved it."""
    pa = _params()
    a = mfa.AdamW(pa, lr=1e-2)
    _run(a, pa, 3)
    sd = a.state_dict()
    assert all(type(st["step"]) is int and st["step"] == 3 for st in a.state.values())
    assert all(isinstance(st["step"], torch.Tensor) and st["step"].dtype == torch.float32 and st["step"].dim() == 0
               and float(st["step"]) == 3 for st in sd["state"].values())
    old = copy.deepcopy(sd)
    for st in old["state"].values():
        st["step"] = int(st["step"])  # as earlier versions saved it
    for saved in (sd, old):
        pb = [p.detach().clone().requires_grad_() for p in pa]
        b = mfa.AdamW(pb, lr=1e-2)
        b.load_state_dict(copy.deepcopy(saved))
        assert all(type(st["step"]) is int and st["step"] == 3 for st in b.state.values())
        pc = [p.detach().clone().requires_grad_() for p in pa]
        c = mfa.AdamW(pc, lr=1e-2)
        c.load_state_dict(copy.deepcopy(saved))
        _run(b, pb, 2, start=3)
        _run(c, pc, 2, start=3)
        assert all(torch.equal(x, y) for x, y in zip(pb, pc))


def test_state_dict_post_hook_sees_tensor_steps():
    seen = []
    opt = mfa.AdamW(_params())
    _run(opt, opt.param_groups[0]["params"], 1)
    opt.register_state_dict_post_hook(lambda o, sd: seen.append(type(sd["state"][0]["step"])))
    opt.state_dict()
    assert seen == [torch.Tensor]


def test_distributed_checkpoint_round_trip_both_ways(tmp_path):
    """torch.distributed.checkpoint (single process, no process group): ours saved, loaded into
    torch's AdamW and into ours, and torch's saved, loaded into ours, through
    get_/set_optimizer_state_dict; each continues as the saver would."""
    import torch.distributed.checkpoint as dcp
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process: the point here
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def model_and(cls, seed=0):
        torch.manual_seed(seed)
        m = torch.nn.Linear(5, 3)
        return m, cls(m.parameters(), lr=1e-2)

    def train(m, opt, steps, start=0):
        for s in range(start, start + steps):
            torch.manual_seed(1000 + s)
            opt.zero_grad()
            m(torch.randn(4, 5)).pow(2).sum().backward()
            opt.step()

    for saver_cls, loader_cls in ((mfa.AdamW, torch.optim.AdamW), (mfa.AdamW, mfa.AdamW), (torch.optim.AdamW, mfa.AdamW)):
        m, opt = model_and(saver_cls)
        train(m, opt, 3)
        path = tmp_path / f"{saver_cls.__module__}-{loader_cls.__module__}".replace(".", "_")
        dcp.save({"optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=str(path))
        m2, opt2 = model_and(loader_cls, seed=1)
        m2.load_state_dict(m.state_dict())
        target = {"optim": get_optimizer_state_dict(m2, opt2)}
        dcp.load(target, checkpoint_id=str(path))
        set_optimizer_state_dict(m2, opt2, target["optim"])
        train(m, opt, 2, start=3)
        train(m2, opt2, 2, start=3)
        for a, b in zip(m.parameters(), m2.parameters()):
            _assert_close(b.detach(), a.detach(), f"{saver_cls.__module__} -> {loader_cls.__module__}")


def test_grad_scaler_with_fused_true_matches_torch():
    """torch.amp.GradScaler with fused=True: torch's class takes the scale into its kernel, ours
    lets the scaler unscale the grads first; the same results, and a step with an inf grad is
    skipped by both (the count stays behind)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    t = copy.deepcopy(m)
    opts = (mfa.AdamW(m.parameters(), lr=1e-2, fused=True), torch.optim.AdamW(t.parameters(), lr=1e-2, fused=True))
    for mod, opt in zip((m, t), opts):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for i in range(4):
            opt.zero_grad()
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
            if i == 2:
                x[0, 0] = float("inf")
            scaler.scale(mod(x).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
        assert scaler.get_scale() == 512.0
        assert [int(st["step"]) for st in opt.state.values()] == [3, 3]
    for a, b in zip(m.parameters(), t.parameters()):
        _assert_close(a.detach(), b.detach(), "GradScaler")


ZERO_SCRIPT = r"""
import os, sys, json, socket, torch, torch.distributed as dist
import mps_fused_adam as mfa
from torch.distributed.optim import ZeroRedundancyOptimizer
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
out = {}
for name in ("AdamW", "AdamW8bit", "AdamW4bit"):
    cls, kw = getattr(mfa, name), ({} if name == "AdamW" else {"min_%dbit_size" % (8 if "8" in name else 4): 256})
    def grads(ps, k):
        gen = torch.Generator().manual_seed(k)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
    def run(resume):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(64, 130)), torch.nn.Parameter(torch.randn(300))]
        opt = ZeroRedundancyOptimizer(ps, optimizer_class=cls, lr=1e-2, **kw)
        for k in range(4):
            if resume and k == 2:
                opt.consolidate_state_dict(0)
                saved = opt.state_dict()
                opt = ZeroRedundancyOptimizer(ps, optimizer_class=cls, lr=1e-2, **kw)
                opt.load_state_dict(saved)
            grads(ps, k)
            opt.step()
        return ps, opt
    (a, _), (b, ob) = run(False), run(True)
    out[name] = {"same": all(torch.equal(x, y) for x, y in zip(a, b)),
                 "step": [type(ob.optim.state[p]["step"]).__name__ for p in b]}
dist.destroy_process_group()
print("MFA-RESULT", json.dumps(out))
"""


def test_zero_redundancy_optimizer_resume_continues_bit_for_bit():
    """torch's ZeroRedundancyOptimizer (one gloo rank, in a child process) around our classes: its
    load_state_dict copies the saved states into ours as they are, steps as torch's 0-dim tensors;
    the next step takes them as counts and the resumed run equals the uninterrupted one."""
    import json
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", ZERO_SCRIPT], capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("MFA-RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-2000:] + run.stderr[-4000:]
    result = json.loads(lines[0].split(" ", 1)[1])
    assert result == {name: {"same": True, "step": ["int", "int"]} for name in ("AdamW", "AdamW8bit", "AdamW4bit")}
