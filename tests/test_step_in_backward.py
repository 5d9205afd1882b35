"""``step_in_backward=True``: each param stepped from its post-accumulate-grad hook, its grad freed.

The reference is the same class stepping after backward (itself checked against the contract's
references and torch's optimizers elsewhere): every result must agree bit for bit, 8-bit states
and stochastic rounding included, through state dicts, schedulers, added groups and hand-set grads.
"""
from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import mps_fused_adam as mfa
from conftest import cannot_run, public_optimizer_names
from mps_fused_adam import backends
from mps_fused_adam.optimizers import in_backward

REPO = Path(__file__).resolve().parent.parent

# Every public class with torch-style params, and the options that change its path.
CASES = [
    (mfa.Adam, dict(weight_decay=0.1)),
    (mfa.AdamW, dict()),
    (mfa.AdamW, dict(bf16_stochastic_round=True)),
    (mfa.FusedAdam, dict(bf16_stochastic_round=True, weight_decay=0.01)),
    (mfa.CPUAdam, dict()),
    (mfa.CPUAdam, dict(fp32_optimizer_states=False)),
    (mfa.Lion, dict()),
    (mfa.FusedLion, dict()),
    (mfa.Adagrad, dict(lr_decay=0.01)),
    (mfa.Adam8bit, dict(min_8bit_size=256)),
    (mfa.AdamW8bit, dict(min_8bit_size=256)),
    (mfa.AdamW8bit, dict(min_8bit_size=256, bf16_stochastic_round=True)),
    (mfa.Adam4bit, dict(min_4bit_size=256)),
    (mfa.AdamW4bit, dict(min_4bit_size=256, bf16_stochastic_round=True)),
]


def case_id(case) -> str:
    cls, kw = case
    return cls.__name__ + "".join(f"-{k}" for k in kw)


def test_every_public_class_takes_the_option():
    covered = {cls.__name__ for cls, _ in CASES}
    assert covered == set(public_optimizer_names())


def make_model(dtype=torch.bfloat16, seed=0):
    """Mixed: bf16 (or ``dtype``) linears, an fp32 LayerNorm, a tensor under min_8bit_size."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 40, bias=False),
                                torch.nn.LayerNorm(40), torch.nn.Linear(40, 8))
    model[0].to(dtype)
    model[2].to(dtype)
    model[4].to(dtype)
    return model


def forward(model, x):
    h = model[1](model[0](x))
    h = model[3](model[2](h).float()).to(x.dtype)
    return model[4](h).float().pow(2).mean()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8) if t.dtype is not torch.float32 else t.detach()


def same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer, pa, pb) -> None:
    for p, q in zip(pa, pb):
        assert torch.equal(bits(p), bits(q)), p.shape
        sa, sb = a.state[p], b.state[q]
        assert sorted(sa) == sorted(sb)
        for k, v in sa.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(bits(v), bits(sb[k])), k
            else:
                assert v == sb[k], k


def train(opt, model, steps, gen, hand=None):
    for i in range(steps):
        x = torch.randn(16, 24, generator=gen).to(model[0].weight.dtype)
        forward(model, x).backward()
        if hand is not None:
            hand(i)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bit_identical_to_stepping_after_backward(case):
    cls, kw = case
    runs = []
    for on in (False, True):
        model = make_model()
        torch.manual_seed(7)
        opt = cls(model.parameters(), lr=1e-2, step_in_backward=on, **kw)
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            forward(model, torch.randn(16, 24, generator=gen).bfloat16()).backward()
            if on:  # every grad was stepped and freed during backward
                assert all(p.grad is None for p in model.parameters())
                counts = {int(opt.state[p]["step"]) for p in model.parameters()}
                before = [bits(p).clone() for p in model.parameters()]
            opt.step()
            if on:  # step() found nothing left to do
                assert all(torch.equal(bits(p), b) for p, b in zip(model.parameters(), before))
                assert {int(opt.state[p]["step"]) for p in model.parameters()} == counts
            opt.zero_grad()
        runs.append((opt, list(model.parameters())))
    (a, pa), (b, pb) = runs
    same_state(a, b, pa, pb)
    if kw.get("bf16_stochastic_round"):
        assert all("sr_seed" in b.state[p] for p in pb if p.dtype is torch.bfloat16)


def test_adamw_in_backward_tracks_torch_adamw():
    """An independent check of the whole path: fp32 AdamW stepped in backward against torch's."""
    ours, theirs = make_model(torch.float32), make_model(torch.float32)
    a = mfa.AdamW(ours.parameters(), lr=1e-2, step_in_backward=True)
    b = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        x = torch.randn(16, 24, generator=gen)
        forward(ours, x).backward()
        forward(theirs, x).backward()
        a.step()
        b.step()
        a.zero_grad()
        b.zero_grad()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


def test_stochastic_rounding_seed_does_not_depend_on_stepping_order():
    """Params stepped first in another step, or alone: each gets the seed of its place."""
    def seeds(order):
        torch.manual_seed(5)
        ps = [torch.nn.Parameter(torch.randn(300).bfloat16()) for _ in range(4)]
        opt = mfa.AdamW8bit(ps, bf16_stochastic_round=True, min_8bit_size=256)
        for chunk in order:
            for i in chunk:
                ps[i].grad = torch.ones(300, dtype=torch.bfloat16)
            opt.step()
            opt.zero_grad()
        return [opt.state[p]["sr_seed"] for p in ps]
    together = seeds([[0, 1, 2, 3]])
    assert seeds([[3], [1, 2], [0]]) == together
    assert len(set(together)) == 4


def test_lr_scheduler_and_added_group():
    def run(on):
        model = make_model()
        extra = torch.nn.Parameter(torch.randn(24, 5).bfloat16())
        opt = mfa.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=256, bf16_stochastic_round=True,
                            step_in_backward=on)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        gen = torch.Generator().manual_seed(3)
        for i in range(4):
            if i == 2:
                opt.add_param_group({"params": [extra], "lr": 3e-2})
            x = torch.randn(16, 24, generator=gen).bfloat16()
            loss = forward(model, x) + (x @ extra).float().pow(2).mean()
            loss.backward()
            if on and i >= 2:  # hooked once added (before, its grads accumulated, unstepped)
                assert extra.grad is None
            opt.step()
            sched.step()
            opt.zero_grad()
        return opt, [*model.parameters(), extra]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no scheduler warning about the order of step() calls
        (a, pa), (b, pb) = run(False), run(True)
    same_state(a, b, pa, pb)
    assert b.param_groups[0]["lr"] == a.param_groups[0]["lr"] == 1e-2 * 0.5 ** 4
    assert int(b.state[pb[-1]]["step"]) == 2


@pytest.mark.parametrize("cls,kw", [(mfa.AdamW, dict(bf16_stochastic_round=True)),
                                    (mfa.AdamW8bit, dict(min_8bit_size=256, bf16_stochastic_round=True))],
                         ids=["AdamW", "AdamW8bit"])
def test_state_dict_moves_both_ways_and_resumes_bit_for_bit(cls, kw):
    """Two steps in backward, the state dict into the plain class, two more steps: as four plain
    steps. And back: the plain class's state dict into one stepping in backward."""
    def run(first_on, second_on):
        model = make_model()
        torch.manual_seed(7)
        opt = cls(model.parameters(), lr=1e-2, step_in_backward=first_on, **kw)
        gen = torch.Generator().manual_seed(3)
        train(opt, model, 2, gen)
        saved = copy.deepcopy(opt.state_dict())
        resumed = cls(model.parameters(), lr=5.0, step_in_backward=second_on, **kw)
        resumed.load_state_dict(saved)
        del opt
        gc.collect()  # the first optimizer's hooks go with it
        train(resumed, model, 2, gen)
        return resumed, list(model.parameters())
    ref = run(False, False)
    for first_on, second_on in ((True, False), (False, True), (True, True)):
        got = run(first_on, second_on)
        same_state(got[0], ref[0], got[1], ref[1])


def test_state_dict_interchange_with_torch_adamw():
    """torch.optim.AdamW's state dict into AdamW(step_in_backward=True) and the plain AdamW: both
    continue alike; and ours back into torch's, whose states are then ours."""
    model = make_model(torch.float32)
    gen = torch.Generator().manual_seed(3)
    t = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(t, model, 2, gen)
    saved = copy.deepcopy(t.state_dict())
    start = [p.detach().clone() for p in model.parameters()]
    results = []
    for on in (False, True):
        with torch.no_grad():
            for p, s in zip(model.parameters(), start):
                p.copy_(s)
        opt = mfa.AdamW(model.parameters(), lr=1e-2, step_in_backward=on)
        opt.load_state_dict(copy.deepcopy(saved))
        train(opt, model, 2, torch.Generator().manual_seed(4))
        results.append(([p.detach().clone() for p in model.parameters()],
                        [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
                         for p in model.parameters()], opt))
        del opt
        gc.collect()
    (p0, s0, _), (p1, s1, ours) = results
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    for x, y in zip(s0, s1):
        assert torch.equal(x["exp_avg"], y["exp_avg"]) and torch.equal(x["exp_avg_sq"], y["exp_avg_sq"])
        assert x["step"] == y["step"]
    back = torch.optim.AdamW(model.parameters(), lr=1e-2)
    back.load_state_dict(ours.state_dict())
    for p in model.parameters():
        assert torch.equal(back.state[p]["exp_avg"], ours.state[p]["exp_avg"])
        assert float(back.state[p]["step"]) == 4


def test_hand_set_grads_are_stepped_by_step():
    """A param that does not require grad has no hook: its hand-set grad is stepped by step(), as
    is a hand-set grad of a hooked param that no backward reached."""
    def run(on):
        model = make_model()
        frozen = torch.nn.Parameter(torch.randn(30).bfloat16(), requires_grad=False)
        idle = torch.nn.Parameter(torch.randn(20).bfloat16())
        opt = mfa.AdamW8bit([*model.parameters(), frozen, idle], lr=1e-2, min_8bit_size=256,
                            bf16_stochastic_round=True, step_in_backward=on)
        gen = torch.Generator().manual_seed(3)

        def hand(i):
            frozen.grad = torch.full((30,), 0.5 + i, dtype=torch.bfloat16)
            idle.grad = torch.full((20,), -1.0 - i, dtype=torch.bfloat16)
        train(opt, model, 3, gen, hand=hand)
        return opt, [*model.parameters(), frozen, idle]
    (a, pa), (b, pb) = run(False), run(True)
    same_state(a, b, pa, pb)
    assert int(b.state[pb[-1]]["step"]) == 3 and int(b.state[pb[-2]]["step"]) == 3


def test_closure_is_refused_with_why():
    model = make_model()
    for opt in (mfa.AdamW(model.parameters(), step_in_backward=True),
                mfa.AdamW8bit(model.parameters(), step_in_backward=True)):
        with pytest.raises(RuntimeError, match=r"step_in_backward=True\)\.step\(closure\): refused\. With "
                                               r"step_in_backward every backward is the step"):
            opt.step(lambda: forward(model, torch.randn(2, 24).bfloat16()))
        assert not opt.state  # nothing was run


@pytest.mark.parametrize("cls", [mfa.AdamW, mfa.AdamW8bit, mfa.Lion])
def test_what_cannot_be_hooked_is_refused_at_construction_and_add_param_group(cls, monkeypatch):
    from mps_fused_adam.optimizers import dtensor
    p = torch.nn.Parameter(torch.randn(4, 4))
    zero3 = torch.nn.Parameter(torch.randn(4))
    zero3.ds_id = 0
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] .*DeepSpeed ZeRO-3 param; "
                                         r"DeepSpeed owns the step"):
        cls([p, zero3], step_in_backward=True)
    assert not p._post_accumulate_grad_hooks  # a refused group registers no hook
    sparse = torch.nn.Parameter(torch.randn(4, 4).to_sparse())
    opt = cls([p], step_in_backward=True)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] .*layout torch.sparse_coo"):
        opt.add_param_group({"params": [sparse]})
    assert len(opt.param_groups) == 1
    # DTensor params (FSDP2): refused, unverified. A stand-in class marks them here.
    monkeypatch.setattr(dtensor, "dtensor_type", lambda: torch.nn.Parameter)
    with pytest.raises(ValueError, match=r"does not step DTensor params \(FSDP2, tensor parallel\)"):
        cls([torch.nn.Parameter(torch.randn(3))], step_in_backward=True)
    with pytest.raises(ValueError, match=r"dtype torch.float64 is not supported"):
        cls([torch.nn.Parameter(torch.randn(3).double())], step_in_backward=True)


def test_cpuadam_refuses_a_non_cpu_param_at_construction():
    p = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match=r"expected a cpu tensor, found one on meta"):
        mfa.CPUAdam([p], step_in_backward=True)


def test_bad_grad_raises_from_the_hook_naming_the_param_and_what_was_stepped():
    """Backward runs last layer first: the layers after the bad one were stepped (grads freed),
    the bad one keeps its grad and no state, the layers before it were not reached."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8, bias=False) for _ in range(3)]
    opt = mfa.AdamW([{"params": [layers[0].weight]}, {"params": [layers[1].weight, layers[2].weight]}],
                    step_in_backward=True)
    bad = layers[1].weight
    bad.grad_dtype = None  # lets autograd accumulate into a grad of another dtype (torch 2.13)
    bad.grad = torch.zeros(8, 8, dtype=torch.float16)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] \(shape \(8, 8\), float32, cpu\): "
                                         r"grad dtype torch.float16 does not match; expected torch.float32"):
        layers[2](layers[1](layers[0](x))).sum().backward()
    assert layers[2].weight.grad is None and int(opt.state[layers[2].weight]["step"]) == 1
    assert bad.grad is not None and not opt.state.get(bad)
    assert layers[0].weight.grad is None and not opt.state.get(layers[0].weight)


def test_bad_hyperparameter_raises_from_the_hook():
    model = make_model()
    opt = mfa.AdamW(model.parameters(), step_in_backward=True)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"Invalid learning rate: -1.0 \(in param_groups\[0\]\)"):
        forward(model, torch.randn(2, 24).bfloat16()).backward()
    assert not any(opt.state.get(p) for p in model.parameters())


def test_each_backward_is_a_step():
    """Gradient accumulation over several backwards cannot work: each backward steps."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = mfa.AdamW([p], step_in_backward=True)
    for _ in range(2):
        (p * 2).sum().backward()
    assert opt.state[p]["step"] == 2 and p.grad is None


@pytest.mark.parametrize("cls", [mfa.AdamW, mfa.AdamW8bit, mfa.CPUAdam, mfa.Lion, mfa.FusedLion, mfa.Adagrad])
def test_deepcopy_hooks_its_own_params_and_a_dropped_optimizer_steps_nothing(cls):
    p = torch.nn.Parameter(torch.ones(4))
    opt = cls([p], step_in_backward=True)
    (p * 2).sum().backward()
    twin = copy.deepcopy(opt)
    q = twin.param_groups[0]["params"][0]
    (q * 2).sum().backward()
    assert q.grad is None and twin.state[q]["step"] == 2 and opt.state[p]["step"] == 1
    assert in_backward.enabled(twin)
    del opt
    gc.collect()
    (p * 2).sum().backward()
    assert p.grad is not None and not p._post_accumulate_grad_hooks  # its hooks left with it


def test_remove_hooks_makes_a_plain_optimizer():
    p = torch.nn.Parameter(torch.ones(4))
    opt = mfa.AdamW8bit([p], step_in_backward=True)
    in_backward.remove_hooks(opt)
    (p * 2).sum().backward()
    assert p.grad is not None
    opt.step()
    assert opt.state[p]["step"] == 1


def test_params_taken_out_of_the_groups_raise_from_the_hook():
    """What DeepSpeed's ZeRO does to a client optimizer: its groups' params replaced."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = mfa.AdamW([p], step_in_backward=True)
    opt.param_groups[0]["params"] = [torch.nn.Parameter(torch.zeros(16))]
    with pytest.raises(RuntimeError, match=r"no longer in its param_groups.*DeepSpeed owns the step"):
        (p * 2).sum().backward()


# ---- memory, measured in a subprocess ---------------------------------------------------------

def _measure(config: str) -> dict:
    if not os.path.exists("/proc/self/clear_refs"):
        cannot_run("the memory check reads Linux's /proc/self/status and clear_refs")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory.py"), "--child", config,
                          "--layers", "8", "--width", "1024", "--steps", "3"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_memory_saved_is_the_gradients():
    """8 x Linear(1024, 1024) in bf16: stepping in backward frees the gradients (2 bytes per
    param) but for one layer's (0.25) and the matmul's work space, measured in fresh processes."""
    plain = _measure("ours-adamw8bit-sr")
    hooked = _measure("ours-adamw8bit-sr-inbwd")
    recipe = _measure("hooks-adamw8bit-sr")
    saved = plain["bytes_per_param"] - hooked["bytes_per_param"]
    # What backward itself holds at the in-backward peak besides one layer's grad: on a CPU without
    # bf16 matmul units torch computes a bf16 weight grad through an fp32 buffer (0.5 bytes per
    # param of one 1024 x 1024 layer over the model's 8), so about 1.25 is saved there and up to
    # 1.75 elsewhere; the post-warm-up baseline moves by a few MB between processes (about 0.1).
    assert 1.0 < saved < 2.1, (plain, hooked)
    # Never below what must live: bf16 params (2) and 8-bit moments with their scales (2.03).
    assert hooked["bytes_per_param"] > 4.0, hooked
    # No more than PyTorch's own recipe (one optimizer per param stepped from hand-written hooks),
    # compared by peak, which does not depend on the warm-up's baseline.
    assert hooked["peak_bytes"] <= recipe["peak_bytes"] + 0.1 * hooked["params"], (hooked, recipe)


# ---- the MPS path: a single-param step through the emulated Metal tiers --------------------------

@pytest.fixture(params=[1, 2, 3], ids=["tier1-_metal", "tier2-load_metallib", "tier3-compile_shader"])
def metal_backend(request, monkeypatch, emu, pkg):
    from emulated_mps import FakeMetalExt, make_backend
    ext = FakeMetalExt(emu)
    backend = make_backend(request.param, pkg, emu, ext=ext)
    monkeypatch.setitem(backends._chosen, "cpu", backend)
    return backend, ext


@pytest.mark.parametrize("cls,kw", [(mfa.AdamW, dict()), (mfa.AdamW, dict(bf16_stochastic_round=True)),
                                    (mfa.AdamW8bit, dict(min_8bit_size=256, bf16_stochastic_round=True))],
                         ids=["AdamW", "AdamW-sr", "AdamW8bit-sr"])
def test_single_param_steps_through_metal_tiers(metal_backend, emu, cls, kw):
    """Each hook is one Metal dispatch of its one tensor (tier 1: one _metal call per param and
    step), bit for bit the plain grouped step through the same tier."""
    backend, ext = metal_backend
    runs = []
    for on in (False, True):
        model = make_model()
        torch.manual_seed(7)
        opt = cls(model.parameters(), lr=1e-2, step_in_backward=on, **kw)
        ext.calls.clear()
        emu.dispatches.clear()
        train(opt, model, 2, torch.Generator().manual_seed(3))
        runs.append((opt, list(model.parameters()), len(ext.calls), len(emu.dispatches)))
    (a, pa, _, _), (b, pb, calls, dispatches) = runs
    same_state(a, b, pa, pb)
    n = len(pb)
    if backend.name == "metal":
        assert calls == 2 * n  # one _metal call per param per step, each of one tensor
    else:
        assert dispatches == 2 * n  # tiers 2-3: one dispatch per tensor (all under 2^32 elements)


def test_docs_memory_tables_are_the_checked_in_measurements():
    """docs/memory.md's tables are what benchmarks/memory.py --tables makes of the measured report."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import memory
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    # Two runs on the same machine, one report: the first configurations, then a later run that
    # added the 4-bit ones (and re-measured some others beside them: the first figure is kept).
    rows = []
    for config, bpp in memory.read_results(str(REPO / "benchmarks" / "results" / "memory_epyc_2core.txt")):
        if config not in {c for c, _ in rows}:
            rows.append((config, bpp))
    assert {c for c, _ in rows} == set(memory.CONFIGS)  # every configuration ran and was measured
    doc = (REPO / "docs" / "memory.md").read_text()
    for table in memory.fits_tables(rows).split("\n\n"):
        assert table.strip() in doc
    for config, bpp in rows:  # and the first table's figures
        assert f"| {bpp:.2f} |" in doc, config
    # The Xeon's 4-bit run: its figures in docs/memory.md's text and the README's Xeon column.
    xeon_rows = memory.read_results(str(REPO / "benchmarks" / "results" / "memory_xeon16.txt"))
    xeon = dict(xeon_rows)  # the later run's figure where both runs measured a configuration
    assert {"ours-adamw4bit", "ours-adamw4bit-sr", "ours-adamw4bit-sr-inbwd"} <= set(xeon)
    for config, bpp in xeon_rows:  # both runs' figures are quoted
        assert f"{bpp:.2f}" in doc, config
    readme = (REPO / "README.md").read_text()
    assert f"| 3.84 | **{xeon['ours-adamw4bit-sr-inbwd']:.2f}** |" in readme
    assert f"| 5.09 | {xeon['ours-adamw4bit-sr']:.2f} |" in readme


# --- Reads and gradients the hooks cannot step bit for bit: refused, or raised by autograd -------------

def _torch_recipe(params):
    """torch's documented per-parameter recipe: a torch.optim.AdamW per param, stepped from its hook."""
    opts = {p: torch.optim.AdamW([p], lr=1e-2) for p in params}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad()
    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    return opts


def _shared_layer_model(kind, reentrant, seed=0):
    """A layer shared by three checkpointed blocks (ALBERT), or used inside and outside one block."""
    import torch.utils.checkpoint as cp
    torch.manual_seed(seed)
    lin, head = torch.nn.Linear(6, 6), torch.nn.Linear(6, 1)

    def loss_of(x):
        def block(h):
            return torch.tanh(lin(h))
        if kind == "shared":
            h = x
            for _ in range(3):
                h = cp.checkpoint(block, h, use_reentrant=reentrant)
        else:
            h = cp.checkpoint(block, x, use_reentrant=reentrant) + lin(x)
        return head(h).pow(2).sum()
    return [*lin.parameters(), *head.parameters()], loss_of


@pytest.mark.parametrize("kind", ["shared", "inside_and_outside"])
def test_reentrant_checkpointing_is_refused(kind):
    """torch's recipe steps the shared layer once per gradient part (3 steps in one backward, or 2);
    the plain step takes 1. Ours refuses, naming the case and the way out."""
    x = torch.randn(4, 6, requires_grad=True)
    params, loss_of = _shared_layer_model(kind, reentrant=True)
    opts = _torch_recipe(params)
    loss_of(x).backward()
    assert int(opts[params[0]].state[params[0]]["step"]) == (3 if kind == "shared" else 2)

    params, loss_of = _shared_layer_model(kind, reentrant=True)
    opt = mfa.AdamW(params, lr=1e-2, step_in_backward=True)
    with pytest.raises(RuntimeError, match=r"cannot step from a backward run inside another backward \(reentrant "
                                           r"checkpointing.*use_reentrant=False"):
        loss_of(x).backward()
    # The shared layer was refused before its first part was stepped, or (used outside the block
    # too) stepped once, by its outer part, which the error says.
    assert int((opt.state.get(params[0]) or {}).get("step", 0)) == (0 if kind == "shared" else 1)


def _plain_and_in_backward(make, x):
    """``(optimizer, params)`` after three AdamW steps of ``make()``'s model on ``x``, stepped after
    backward and in backward."""
    runs = []
    for on in (False, True):
        params, loss_of = make()
        opt = mfa.AdamW(params, lr=1e-2, step_in_backward=on)
        for _ in range(3):
            loss_of(x).backward()
            opt.step()
            opt.zero_grad()
        runs.append((opt, params))
    return runs


@pytest.mark.parametrize("kind", ["shared", "inside_and_outside"])
def test_non_reentrant_checkpointing_is_bit_identical(kind):
    x = torch.randn(4, 6, requires_grad=True)
    (a, pa), (b, pb) = _plain_and_in_backward(lambda: _shared_layer_model(kind, reentrant=False), x)
    same_state(a, b, pa, pb)
    assert int(b.state[pb[0]]["step"]) == 3


def _detached_read_model(saved, seed=0):
    """``w`` read with a gradient and through ``.detach()`` (VQ-VAE codebooks, BYOL targets): by a
    matmul, which saves ``w.detach()`` for the gradient of ``h``, or by an add, which saves nothing."""
    torch.manual_seed(seed)
    w, u = torch.nn.Parameter(torch.randn(6, 6)), torch.nn.Parameter(torch.randn(6, 6))

    def loss_of(x):
        h = torch.tanh(x @ u)
        read = (h @ w.detach()) if saved else (h + w.detach()[0])
        return read.pow(2).sum() + (x @ w).pow(2).sum()
    return [w, u], loss_of


def test_a_detached_read_autograd_saved_raises_as_torchs_recipe_does():
    """The step bumps w's version counter, which w.detach() shares: autograd raises when it unpacks
    the saved view after w's hook stepped w, as it does for torch's recipe. Without the bump, u's
    gradient was computed from the stepped w and the run drifted from the plain step's."""
    x = torch.randn(4, 6)
    params, loss_of = _detached_read_model(saved=True)
    _torch_recipe(params)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_of(x).backward()
    params, loss_of = _detached_read_model(saved=True)
    opt = mfa.AdamW(params, lr=1e-2, step_in_backward=True)  # noqa: F841  (hooks hold it weakly)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_of(x).backward()


def test_a_detached_read_autograd_does_not_save_is_bit_identical():
    """What backward never reads again cannot see the stepped value."""
    x = torch.randn(4, 6)
    (a, pa), (b, pb) = _plain_and_in_backward(lambda: _detached_read_model(saved=False), x)
    same_state(a, b, pa, pb)
