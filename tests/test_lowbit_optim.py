"""bf16 stochastic rounding, the AdamW8bit/Adam8bit classes and bitsandbytes state-dict
conversion (against bitsandbytes itself where it is importable)."""
from __future__ import annotations

import copy

import pytest
import torch

import mps_fused_adam as mfa
from mps_fused_adam import bnb_compat
from mps_fused_adam.numerics import lowbit
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.optimizers.eight_bit import state_bytes_per_param
from mps_fused_adam.numerics.reference_lowbit import dequantize, reference_adam8bit_

from conftest import require_bitsandbytes


def bnb_optim():
    """bitsandbytes.optim, or a skip saying why (conftest.require_bitsandbytes)."""
    return require_bitsandbytes().optim


# ---- stochastic rounding ----------------------------------------------------------------------

def test_sr_bits_match_the_scalar_statement():
    key = lowbit.sr_key(0x1234_5678_9ABC_DEF0, 7)
    idx = torch.tensor([0, 1, 2, 255, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 32 + 5, 2 ** 40 + 3])
    assert lowbit.sr_bits(key, idx).tolist() == [lowbit.sr_bits_int(key, int(i)) for i in idx]
    # Different steps and seeds give different streams.
    assert lowbit.sr_key(1, 1) != lowbit.sr_key(1, 2) != lowbit.sr_key(2, 1)


def test_sr_is_unbiased_and_picks_a_neighbour():
    x = torch.full((200_000,), 1.0 + 2 ** -9 + 2 ** -11)  # 5/16 of the way from 1.0 to the next bf16
    lo, hi = 1.0, 1.0 + 2 ** -7  # its bf16 neighbours
    hits = lowbit.stochastic_round_bf16(x, lowbit.sr_key(3, 1)).float()
    assert set(hits.unique().tolist()) == {lo, hi}
    frac = (x[0].item() - lo) / (hi - lo)
    assert hits.eq(hi).double().mean().item() == pytest.approx(frac, abs=0.005)
    assert hits.double().mean().item() == pytest.approx(x[0].item(), abs=2e-5)
    # Negative values round away from zero with the same probability (sign-magnitude bits).
    neg = lowbit.stochastic_round_bf16(-x, lowbit.sr_key(3, 1)).float()
    assert torch.equal(neg, -hits)


def test_sr_special_values_and_exact_values():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, 3.0e38, 1e-40])
    out = lowbit.stochastic_round_bf16(x, lowbit.sr_key(1, 1))
    assert out[0].isnan() and out[0].view(torch.int16).item() == 0x7FC0
    assert out[1].item() == float("inf") and out[2].item() == -float("inf")
    assert out[3].view(torch.int16).item() == 0 and out[4].view(torch.int16).item() == -32768  # -0.0 bits
    assert out[5].item() == 1.5  # representable values are exact
    low = torch.tensor(x[6:].tolist()).to(torch.bfloat16).float()
    assert all(abs(a - b) <= abs(b) * 2 ** -7 for a, b in zip(out[6:].float().tolist(), low.tolist()))


@pytest.mark.parametrize("cls", [mfa.Adam, mfa.AdamW, mfa.FusedAdam, mfa.AdamW8bit])
def test_sr_option_reproducible_seeded_and_in_state_dict(cls):
    def run(seed_offset=0):
        torch.manual_seed(10 + seed_offset)
        p = torch.nn.Parameter(torch.randn(5000).bfloat16())
        opt = cls([p], lr=1e-3, bf16_stochastic_round=True)
        for i in range(3):
            p.grad = torch.randn(5000, generator=torch.Generator().manual_seed(i)).bfloat16()
            opt.step()
        return p, opt
    (p1, o1), (p2, _) = run(), run()
    assert torch.equal(p1.view(torch.int16), p2.view(torch.int16))
    seed = o1.state[p1]["sr_seed"]
    assert isinstance(seed, int) and o1.state_dict()["state"][0]["sr_seed"] == seed
    p3, _ = run(seed_offset=1)  # another torch seed: another rounding stream
    assert not torch.equal(p1.view(torch.int16), p3.view(torch.int16))
    # A reloaded optimizer continues with the same stream as the original.
    q = torch.nn.Parameter(p1.detach().clone())
    o3 = cls([q], lr=1e-3, bf16_stochastic_round=True)
    o3.load_state_dict(copy.deepcopy(o1.state_dict()))
    g = torch.randn(5000).bfloat16()
    p1.grad, q.grad = g, g.clone()
    o1.step()
    o3.step()
    assert torch.equal(p1.view(torch.int16), q.view(torch.int16))


@pytest.mark.parametrize("cls", [mfa.AdamW, mfa.AdamW8bit, mfa.AdamW4bit])
def test_sr_resume_seeds_a_param_first_stepped_after_it_as_without_the_interruption(cls):
    """The per-optimizer base seed is not in the state dict: a load recovers it from a loaded
    seed, so a param with no state at the checkpoint (no grad until then) draws the same seed,
    and rounds the same, as in the uninterrupted run, whatever torch's RNG holds at the resume."""
    def grads(ps, k, both):
        gen = torch.Generator().manual_seed(100 + k)
        for i, p in enumerate(ps):
            g = torch.randn(p.shape, generator=gen).bfloat16()
            p.grad = g if (i == 0 or both) else None

    def run(resume):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(5000).bfloat16()) for _ in range(2)]
        opt = cls(ps, lr=1e-2, bf16_stochastic_round=True)
        for k in range(3):
            grads(ps, k, both=False)
            opt.step()
        if resume:
            saved = copy.deepcopy(opt.state_dict())
            torch.manual_seed(1234)  # a fresh process's RNG
            ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
            opt = cls(ps, lr=1e-2, bf16_stochastic_round=True)
            opt.load_state_dict(saved)
        for k in range(3, 6):
            grads(ps, k, both=True)
            opt.step()
        return ps, opt
    (a, oa), (b, ob) = run(False), run(True)
    assert ob.state[b[1]]["sr_seed"] == oa.state[a[1]]["sr_seed"]
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_sr_copy_of_the_optimizer_seeds_later_params_as_the_original(how):
    """A deep copy or a pickle of the params with their optimizer keeps the base seed: a param
    first stepped after the copy gets the original's seed and rounds as it does."""
    import pickle
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(300).bfloat16()) for _ in range(2)]
    opt = mfa.AdamW([{"params": [ps[0]]}, {"params": [ps[1]]}], lr=1e-2, bf16_stochastic_round=True)
    ps[0].grad = torch.randn(300).bfloat16()
    opt.step()
    cps, copt = copy.deepcopy((ps, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((ps, opt)))
    torch.manual_seed(1234)  # other RNG state: the copy must not draw a new base seed
    for params, o in ((ps, opt), (cps, copt)):
        params[1].grad = torch.ones(300).bfloat16()
        o.step()
    assert copt.state[cps[1]]["sr_seed"] == opt.state[ps[1]]["sr_seed"]
    assert torch.equal(cps[1].view(torch.int16), ps[1].view(torch.int16))


@pytest.mark.parametrize("cls,size_key", [(mfa.AdamW8bit, "min_8bit_size"), (mfa.AdamW4bit, "min_4bit_size")])
def test_loading_a_torch_checkpoint_keeps_each_groups_own_keys(cls, size_key):
    """A torch.optim.AdamW state dict has no min_*bit_size or bf16_stochastic_round: each group
    keeps its own (not the constructor's), and its params are quantized by its own size."""
    ps = [torch.nn.Parameter(torch.randn(2000)), torch.nn.Parameter(torch.randn(2000).bfloat16())]
    torch_opt = torch.optim.AdamW([{"params": [ps[0]]}, {"params": [ps[1]]}], lr=1e-3)
    for p in ps:
        p.grad = torch.randn_like(p)
    torch_opt.step()
    ours = cls([{"params": [ps[0]], size_key: 1000}, {"params": [ps[1]], "bf16_stochastic_round": True}], lr=1e-3)
    ours.load_state_dict(torch_opt.state_dict())
    assert ours.param_groups[0][size_key] == 1000 and ours.param_groups[1]["bf16_stochastic_round"] is True
    assert ours.param_groups[0]["bf16_stochastic_round"] is False  # the constructor's, as before
    assert "exp_avg" not in ours.state[ps[0]]  # 2000 >= 1000: quantized
    assert "exp_avg" in ours.state[ps[1]]  # 2000 < the default size: fp32 moments


def test_sr_option_leaves_other_dtypes_alone():
    p = torch.nn.Parameter(torch.randn(100))
    q = torch.nn.Parameter(p.detach().clone())
    a, b = mfa.AdamW([p], bf16_stochastic_round=True), mfa.AdamW([q])
    p.grad = torch.randn(100)
    q.grad = p.grad.clone()
    a.step()
    b.step()
    assert torch.equal(p, q) and "sr_seed" not in a.state[p]


# ---- AdamW8bit / Adam8bit ---------------------------------------------------------------------

def test_state_layout_and_bytes_per_param():
    big = torch.nn.Parameter(torch.randn(256 * 64))
    odd = torch.nn.Parameter(torch.randn(5000))
    small = torch.nn.Parameter(torch.randn(100))
    opt = mfa.AdamW8bit([big, odd, small])
    for p in (big, odd, small):
        p.grad = torch.randn_like(p)
    opt.step()
    st = opt.state[big]
    assert st["exp_avg_codes"].dtype == torch.uint8 and st["exp_avg_codes"].shape == big.shape
    assert st["exp_avg_absmax"].shape == (64,) and st["exp_avg_sq_absmax"].dtype == torch.float32
    assert opt.state[odd]["exp_avg_absmax"].shape == (20,)  # ceil(5000 / 256)
    assert opt.state[small]["exp_avg"].dtype == torch.float32  # below min_8bit_size: fp32 moments
    only_big = mfa.AdamW8bit([big])
    big.grad = torch.randn_like(big)
    only_big.step()
    assert state_bytes_per_param(only_big) == 2 + 8 / 256 == 2.03125


def test_matches_reference_and_rejects_nothing_half_done():
    p = torch.nn.Parameter(torch.randn(4096 + 300))
    ref_p = p.detach().clone()
    n = p.numel()
    codes = [torch.full((n,), 127, dtype=torch.uint8), torch.zeros(lowbit.num_blocks(n)),
             torch.zeros(n, dtype=torch.uint8), torch.zeros(lowbit.num_blocks(n))]
    opt = mfa.Adam8bit([p], lr=1e-2, weight_decay=0.1)  # L2 mode, as torch.optim.Adam
    for step in (1, 2, 3):
        p.grad = torch.randn(n)
        opt.step()
        reference_adam8bit_(ref_p, p.grad, *codes, AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, step, adam_w_mode=False))
    assert torch.equal(p.detach(), ref_p)
    assert torch.equal(opt.state[p]["exp_avg_sq_codes"], codes[2])
    # A bad tensor anywhere rejects the whole step before anything is written.
    other = torch.nn.Parameter(torch.randn(10))
    opt.add_param_group({"params": [other]})
    before = p.detach().clone()
    p.grad = torch.randn(n)
    other.grad = torch.randn(10).to_sparse()
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\].*sparse"):
        opt.step()
    assert torch.equal(p.detach(), before) and opt.state[p]["step"] == 3 and other not in opt.state


@pytest.mark.parametrize("kwargs,match", [
    (dict(optim_bits=8), "optim_bits"), (dict(is_paged=True), "is_paged"), (dict(args=object()), "args"),
    (dict(percentile_clipping=5), "percentile_clipping"), (dict(block_wise=False), "block_wise"),
    (dict(amsgrad=True), "amsgrad"), (dict(min_8bit_size=0), "min_8bit_size"), (dict(lr=-1.0), "learning rate"),
])
def test_rejected_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mfa.AdamW8bit([torch.nn.Parameter(torch.randn(3))], **kwargs)
    if "lr" in kwargs:
        return  # as torch, a bad lr of an added group is refused at the step, before anything is written
    # The same option in a group added later is refused too (not stepped without it), and the
    # optimizer keeps its groups.
    opt = mfa.AdamW8bit([torch.nn.Parameter(torch.randn(3))])
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], **kwargs})
    assert len(opt.param_groups) == 1


def test_state_dict_round_trip_keeps_codes_and_fp32_scales_for_bf16_params():
    p = torch.nn.Parameter(torch.randn(8192).bfloat16())
    opt = mfa.AdamW8bit([p], lr=1e-2)
    p.grad = torch.randn(8192).bfloat16()
    opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = mfa.AdamW8bit([q], lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for k in ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax"):
        assert torch.equal(opt2.state[q][k], opt.state[p][k]) and opt2.state[q][k].dtype == opt.state[p][k].dtype
    g = torch.randn(8192).bfloat16()
    p.grad, q.grad = g, g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(p.view(torch.int16), q.view(torch.int16))


# ---- bitsandbytes ------------------------------------------------------------------------------

def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _close(a, b, rel):
    for pa, pb in zip(a.parameters(), b.parameters()):
        moved = (pa - pb).abs().max().item()
        assert moved <= rel * pb.abs().max().item(), moved


def test_numerics_comparable_with_bitsandbytes():
    """Same model, same data: ours and bitsandbytes' AdamW8bit stay close over 20 steps (their CPU
    path quantizes through a lookup table, ours by nearest code, and the op order differs)."""
    optim = bnb_optim()
    a, b, c = _model(), _model(), _model()
    _train(a, mfa.AdamW8bit(a.parameters(), lr=1e-3), 20, 1)
    _train(b, optim.AdamW8bit(b.parameters(), lr=1e-3), 20, 1)
    _train(c, torch.optim.AdamW(c.parameters(), lr=1e-3), 20, 1)
    diff_ours = max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))
    diff_fp32 = max((x - y).abs().max().item() for x, y in zip(c.parameters(), b.parameters()))
    print(f"\nmax |ours - bnb| = {diff_ours:.3g}; max |torch fp32 AdamW - bnb| = {diff_fp32:.3g}")
    assert diff_ours <= 2 * diff_fp32 + 1e-4


@pytest.mark.parametrize("cls_name", ["AdamW8bit", "Adam8bit"])
def test_state_dict_conversion_both_ways(cls_name):
    optim = bnb_optim()
    bnb_cls = getattr(optim, cls_name)
    # bitsandbytes -> ours: same codes, same scales, same dequantized moments.
    a = _model()
    oa = bnb_cls(a.parameters(), lr=1e-3, weight_decay=0.01)
    _train(a, oa, 5, 1)
    sd = bnb_compat.from_bitsandbytes(oa.state_dict())
    b = _model()
    b.load_state_dict(a.state_dict())
    ob = mfa.AdamW8bit(b.parameters(), lr=1e-3)
    ob.load_state_dict(sd)
    assert ob.param_groups[0]["weight_decay"] == 0.01 and ob.param_groups[0]["adam_w_mode"] is True
    big = next(b.parameters())  # 64 x 128 = 8192 elements: 8-bit in both
    bnb_state = oa.state[next(a.parameters())]
    assert torch.equal(ob.state[big]["exp_avg_codes"], bnb_state["state1"])
    assert torch.equal(ob.state[big]["exp_avg_sq_absmax"], bnb_state["absmax2"])
    m_ours = dequantize(ob.state[big]["exp_avg_codes"], ob.state[big]["exp_avg_absmax"], True)
    m_bnb = bnb_state["qmap1"][bnb_state["state1"].long()] * bnb_state["absmax1"].repeat_interleave(256).view(128, 64)
    assert torch.equal(m_ours, m_bnb)
    small = list(b.parameters())[1]  # 128 elements: fp32 moments in both
    assert torch.equal(ob.state[small]["exp_avg"], oa.state[list(a.parameters())[1]]["state1"])
    # Both continue from the converted state and stay close.
    _train(a, oa, 5, 2)
    _train(b, ob, 5, 2)
    _close(b, a, 0.02)
    # ours -> bitsandbytes: its load_state_dict takes the converted dict and continues.
    c = _model()
    c.load_state_dict(b.state_dict())
    oc = bnb_cls(c.parameters(), lr=1e-3, weight_decay=0.01)
    oc.load_state_dict(bnb_compat.to_bitsandbytes(ob.state_dict()))
    assert torch.equal(oc.state[next(c.parameters())]["state2"], ob.state[big]["exp_avg_sq_codes"])
    assert oc.state[next(c.parameters())]["step"] == 10
    _train(b, ob, 5, 3)
    _train(c, oc, 5, 3)
    _close(c, b, 0.02)


def test_conversion_rejects_a_foreign_map():
    sd = {"state": {0: {"step": 1, "state1": torch.zeros(4096, dtype=torch.uint8), "qmap1": torch.linspace(-1, 1, 256),
                        "state2": torch.zeros(4096, dtype=torch.uint8), "qmap2": lowbit.dynamic_map(False),
                        "absmax1": torch.zeros(16), "absmax2": torch.zeros(16)}},
          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}]}
    with pytest.raises(ValueError, match="qmap1 is not bitsandbytes' dynamic map"):
        bnb_compat.from_bitsandbytes(sd)


def test_docs_low_bit_example_steps():
    """docs/lowbit.md's example (tests/test_doc_blocks.py runs it too) steps both optimizers into the
    states it names, and another step after it works."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "lowbit.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    scope: dict = {}
    exec(blocks[0], scope)
    for opt, model in ((scope["opt"], scope["model"]), (scope["opt_bf16"], scope["bf16_model"])):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    assert "exp_avg_codes" in scope["opt"].state[scope["model"].weight]  # 65,536 elements: 8-bit
    assert "sr_seed" in scope["opt_bf16"].state[scope["bf16_model"].weight]


def test_non_contiguous_param_and_via_cpu_path(monkeypatch):
    """A transposed param is updated like a contiguous one; the MPS route (CPU copies written
    back) gives the reference's bits too (exercised here by pretending CPU tensors need it)."""
    from mps_fused_adam.numerics import reference_lowbit
    base = torch.randn(64, 80)
    p = torch.nn.Parameter(base.t())
    q = torch.nn.Parameter(base.t().contiguous())
    oa, ob = mfa.AdamW8bit([p], lr=1e-2), mfa.AdamW8bit([q], lr=1e-2)
    for _ in range(2):
        g = torch.randn(80, 64)
        p.grad, q.grad = g.t().contiguous().t(), g.clone()
        oa.step()
        ob.step()
    assert not p.is_contiguous() and torch.equal(p.detach(), q.detach())
    r = torch.nn.Parameter(q.detach().clone())
    monkeypatch.setattr(reference_lowbit, "_needs_cpu", lambda t: t.data_ptr() == r.data_ptr())
    g = torch.randn(80, 64)
    st = ob.state[q]
    args = [st[k] for k in ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")]
    reference_lowbit.reference_adam8bit_(r, g, *[a.clone() for a in args], AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.01, 3))
    q.grad = g
    ob.step()
    assert torch.equal(r.detach(), q.detach())


def test_sr_group_is_planned_with_a_fresh_key_each_step():
    """Cached step plans (step_plan.py) hold each param's state dict, from whose ``sr_seed`` every
    planned step makes that step's key: a group with ``bf16_stochastic_round`` is planned like a
    plain group of the same optimizer, used from its second step, and matches the reference with
    the key of every step."""
    from mps_fused_adam.optimizers import step_plan
    from mps_fused_adam.numerics.reference import reference_adam_
    from mps_fused_adam.numerics.reference_lowbit import reference_adam_sr_

    torch.manual_seed(3)
    sr_ps = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (300, 1000)]
    plain = torch.nn.Parameter(torch.randn(50))
    opt = mfa.AdamW([{"params": sr_ps, "bf16_stochastic_round": True}, {"params": [plain]}], lr=1e-2)
    refs = [[p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)] for p in sr_ps]
    pref = [plain.detach().clone(), torch.zeros(50), torch.zeros(50)]
    for step in range(1, 6):
        for p, r in zip(sr_ps, refs):
            p.grad = torch.randn(p.shape).bfloat16()
            r.append(p.grad.clone())
        plain.grad = torch.randn(50)
        opt.step()
        for p, r in zip(sr_ps, refs):
            hp = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 1e-2, step, adam_w_mode=True)
            reference_adam_sr_(r[0], r.pop(), r[1], r[2], hp, lowbit.sr_key(opt.state[p]["sr_seed"], step))
            assert torch.equal(p.detach().view(torch.int16), r[0].view(torch.int16)), step
            assert torch.equal(opt.state[p]["exp_avg_sq"], r[2]) and opt.state[p]["step"] == step
        reference_adam_(pref[0], plain.grad, pref[1], pref[2], AdamHyper(1e-2, 0.9, 0.999, 1e-8, 1e-2, step,
                                                                         adam_w_mode=True))
        assert torch.equal(plain.detach(), pref[0])
    if step_plan.native() is not None:
        for gi in (0, 1):
            assert isinstance(opt._plans.get(gi), step_plan.Plan) and opt._plans[gi].uses == 4


def test_stochastic_rounding_seeds_a_state_made_without_it():
    """A state made without the option (a loaded or converted checkpoint, the option switched on
    later) gets its seed at the next step, as Adam's stochastic rounding does: bf16 params of 1.0
    with updates of 1e-4 (far below half a bf16 ulp) move only through stochastic rounding."""
    p = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
    opt = mfa.AdamW8bit([p], lr=1e-4, weight_decay=0.0)
    p.grad = torch.ones(8192, dtype=torch.bfloat16)
    opt.step()
    assert "sr_seed" not in opt.state[p] and torch.equal(p.detach(), torch.ones(8192, dtype=torch.bfloat16))
    opt.param_groups[0]["bf16_stochastic_round"] = True
    for _ in range(20):
        p.grad = torch.ones(8192, dtype=torch.bfloat16)
        opt.step()
    assert "sr_seed" in opt.state[p]
    moved = int((p.detach() != 1).sum())
    assert 1000 < moved < 8192, moved  # about 20 * 1e-4 / 2**-8 of them: unbiased, not rounded to nearest


def test_clip_bound_past_doubles_range_steps_on():
    """betas (0.9, 0.8): beta1**2 / beta2 > 1, and the bound's geometric sum leaves double's range
    near step 57,140; the step must go on (no bound), every param updated and counted once."""
    a, b = (torch.nn.Parameter(torch.randn(8192)) for _ in range(2))
    opt = mfa.AdamW8bit([a, b], lr=1e-3, betas=(0.9, 0.8))
    for p in (a, b):
        p.grad = torch.randn(8192)
    opt.step()
    sd = opt.state_dict()
    sd["state"][1]["step"] = 57_200
    opt.load_state_dict(sd)
    before = [a.detach().clone(), b.detach().clone()]
    opt.step()
    assert [opt.state[a]["step"], opt.state[b]["step"]] == [2, 57_201]
    assert not torch.equal(a.detach(), before[0]) and not torch.equal(b.detach(), before[1])
    assert torch.isfinite(b.detach()).all()


@pytest.mark.parametrize("bad", [None, 0, -5, 2.5, True])
def test_group_options_checked_when_the_group_is_added(bad):
    a, b = torch.nn.Parameter(torch.randn(16)), torch.nn.Parameter(torch.randn(16))
    opt = mfa.AdamW8bit([a], lr=1e-3)
    with pytest.raises(ValueError, match=r"param_groups\[1\]: min_8bit_size must be a positive element count"):
        opt.add_param_group({"params": [b], "min_8bit_size": bad})
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["min_8bit_size"] = bad  # changed later: caught before anything is written
    a.grad = torch.randn(16)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: min_8bit_size"):
        opt.step()
    assert opt.state.get(a) is None or not opt.state[a]


def test_float64_params_rejected_when_added():
    with pytest.raises(ValueError, match="float64 is not supported"):
        mfa.AdamW8bit([torch.nn.Parameter(torch.randn(4, dtype=torch.float64))])
    opt = mfa.AdamW8bit([torch.nn.Parameter(torch.randn(4))])
    with pytest.raises(ValueError, match="float64 is not supported"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1


def test_load_state_dict_checks_before_loading():
    """Moments that do not fit, or another optimizer's state dict, are rejected before anything
    is loaded (the groups keep their hyperparameters)."""
    big, small = torch.nn.Parameter(torch.randn(8192)), torch.nn.Parameter(torch.randn(100))
    opt = mfa.AdamW8bit([big, small], lr=1e-3)
    for p in (big, small):
        p.grad = torch.randn(p.shape)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.5
    sd["state"][0]["exp_avg_codes"] = sd["state"][0]["exp_avg_codes"][:100]
    with pytest.raises(ValueError, match=r"\['params'\]\[0\].*'exp_avg_codes'.*expected shape \(8192,\)"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 1e-3
    sgd = torch.optim.SGD([big, small], lr=0.1, momentum=0.9)
    sgd.step()
    with pytest.raises(ValueError, match="not an Adam-family state dict"):
        opt.load_state_dict(sgd.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-3 and "momentum" not in opt.param_groups[0]
    good = copy.deepcopy(opt.state_dict())  # a fitting one still loads
    opt.load_state_dict(good)
