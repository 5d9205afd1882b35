"""The AdamW4bit/Adam4bit classes: steps against the 4-bit reference on every backend the device
has, step_in_backward, state dicts (round trip, torch.optim and 8-bit checkpoints, torchao's
layout built by hand and, where installed, torchao itself), refusals."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import mps_fused_adam as mfa
from mps_fused_adam import torchao_compat
from mps_fused_adam.numerics import lowbit, lowbit4
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference_lowbit import (block_absmax, dequantize, dequantize4, quantize4,
                                                      reference_adam4bit_)
from mps_fused_adam.optimizers.low_bit import state_bytes_per_param
from mps_fused_adam.optimizers.state_formats import Blockwise4bit

from conftest import require_torchao

NAMES = Blockwise4bit.names


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(40, 130), (513,), (7, 3), (300,)]  # 5200 (41 blocks), odd 513, small 21, 300
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).to(dtype)) for s in shapes]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(p.shape, generator=gen) * 10.0 ** (-2 * torch.rand(p.shape, generator=gen))).to(p.dtype)
            for p in params]


def _hyper(step, wd=0.01, adam_w=True, lr=1e-2):
    return AdamHyper(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, step=step, adam_w_mode=adam_w)


@pytest.mark.parametrize("dtype,sr", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True),
                                      (torch.float16, False)])
@pytest.mark.parametrize("cls", ["AdamW4bit", "Adam4bit"])
def test_steps_match_the_reference(cls, dtype, sr):
    """Every param of at least min_4bit_size steps as reference_adam4bit_ says, bit for bit, on
    whatever backend this device has (kernels and reference agree by the contract); smaller
    params take the fp32 Adam rule."""
    params = _params(dtype)
    wd, adam_w = (0.01, True) if cls == "AdamW4bit" else (0.1, False)
    opt = getattr(mfa, cls)(params, lr=1e-2, weight_decay=wd, min_4bit_size=300, bf16_stochastic_round=sr)
    ref = [p.detach().clone() for p in params]
    ref_st = [(lowbit4.fresh_codes4(p.numel(), True), torch.zeros(lowbit4.num_blocks4(p.numel())),
               lowbit4.fresh_codes4(p.numel(), False), torch.zeros(lowbit4.num_blocks4(p.numel())))
              for p in params]
    for step in range(1, 5):
        grads = _grads(params, step)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for i, (p, g) in enumerate(zip(ref, grads)):
            if p.numel() < 300:
                continue
            key = lowbit.sr_key(opt.state[params[i]]["sr_seed"], step) if sr and dtype is torch.bfloat16 else None
            reference_adam4bit_(p, g, *ref_st[i], _hyper(step, wd, adam_w), key)
    for i, p in enumerate(params):
        st = opt.state[p]
        assert st["step"] == 4
        if p.numel() < 300:
            assert set(st) >= {"exp_avg", "exp_avg_sq"} and st["exp_avg"].dtype == torch.float32
            continue
        assert torch.equal(p.detach().view(torch.uint8), ref[i].view(torch.uint8)), i
        for name, want in zip(NAMES, ref_st[i]):
            assert torch.equal(st[name], want), (i, name)
        assert st[NAMES[0]].shape == ((p.numel() + 1) // 2,) and st[NAMES[1]].shape == (math.ceil(p.numel() / 128),)


@pytest.mark.parametrize("cls", ["AdamW4bit", "AdamW8bit"])
def test_an_overflowing_gradient_fails_its_block_visibly(cls):
    """One gradient element whose square overflows fp32 (a second-moment scale of +inf): the next
    step turns that element's whole block into NaN, as for AdamW8bit and torchao, instead of
    freezing its healthy neighbours silently (4-bit: the zero-free map would dequantize them all
    to inf, their updates to 0). Other blocks step as before."""
    torch.manual_seed(0)
    n, block = 4 * 256, (lowbit4.BLOCK4 if cls == "AdamW4bit" else lowbit.BLOCK)
    p = torch.nn.Parameter(torch.randn(n))
    healthy = torch.nn.Parameter(p.detach().clone())
    opts = [getattr(mfa, cls)([x], lr=1e-2, min_4bit_size=1) if cls == "AdamW4bit" else
            getattr(mfa, cls)([x], lr=1e-2, min_8bit_size=1) for x in (p, healthy)]
    scale2 = NAMES[3] if cls == "AdamW4bit" else "exp_avg_sq_absmax"
    for step in range(3):
        g = torch.randn(n) * 1e-2
        p.grad, healthy.grad = g.clone(), g.clone()
        if step == 1:
            p.grad[block + 5] = 1e20  # its square is inf in fp32
        for o in opts:
            o.step()
        if step == 1:  # 4-bit stores NaN (lowbit4.stored_scale2); 8-bit keeps inf, its zero code makes NaN
            s = opts[0].state[p][scale2][1]
            assert math.isnan(s) if cls == "AdamW4bit" else s == float("inf"), opts[0].state[p][scale2][:3]
    assert torch.isnan(p[block:2 * block]).all()  # the whole block, loudly
    assert torch.equal(p[:block], healthy[:block]) and torch.equal(p[2 * block:], healthy[2 * block:])


def test_stored_scale2_rule():
    """lowbit4.stored_scale2: +inf becomes the fixed NaN 0xFFC00000; finite, zero and NaN scales stay."""
    a = torch.tensor([0.0, 1.5, float("inf"), float("nan"), 3e38])
    out = lowbit4.stored_scale2(a)
    assert out.view(torch.int32)[2].item() & 0xFFFFFFFF == 0xFFC00000
    assert torch.equal(out[[0, 1, 4]], a[[0, 1, 4]]) and torch.isnan(out[3])


def test_step_in_backward_matches_step():
    def run(in_backward):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 3)).bfloat16()
        opt = mfa.AdamW4bit(model.parameters(), lr=1e-2, min_4bit_size=256, bf16_stochastic_round=True,
                            step_in_backward=in_backward)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
        for _ in range(3):
            loss = model(x).float().square().mean()
            loss.backward()
            if not in_backward:
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], opt
    (a, oa), (b, ob) = run(False), run(True)
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))
    assert NAMES[0] in oa.state[next(iter(oa.state))]


def test_state_layout_and_bytes_per_param():
    p = torch.nn.Parameter(torch.randn(1 << 16))
    opt = mfa.AdamW4bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    st = opt.state[p]
    assert sorted(k for k in st if isinstance(st[k], torch.Tensor)) == sorted([*NAMES, "param_shape4"])
    # Two codes a byte per moment and one fp32 scale per 128 elements: 2 * (0.5 + 4 / 128) bytes;
    # and the param's shape, one int64 per dim.
    assert state_bytes_per_param(opt) == pytest.approx(2 * (0.5 + 4 / 128) + 8 / (1 << 16))


def test_state_dict_round_trip_continues_identically():
    params = _params(torch.bfloat16)
    opt = mfa.AdamW4bit(params, lr=1e-2, min_4bit_size=300, bf16_stochastic_round=True)
    for step in (1, 2):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = mfa.AdamW4bit(twin_params, lr=1e-2, min_4bit_size=300, bf16_stochastic_round=True)
    sd = copy.deepcopy(opt.state_dict())
    twin.load_state_dict(sd)
    for p, q in zip(params, twin_params):
        for k, v in opt.state[p].items():
            w = twin.state[q][k]
            assert (torch.equal(v, w) and v.dtype == w.dtype) if isinstance(v, torch.Tensor) else v == w, k
    for ps in (params, twin_params):
        for p, g in zip(ps, _grads(ps, 3)):
            p.grad = g
    opt.step()
    twin.step()
    assert all(torch.equal(p.view(torch.int16), q.view(torch.int16)) for p, q in zip(params, twin_params))


@pytest.mark.parametrize("source", ["torch.optim.AdamW", "AdamW8bit"])
def test_loading_fp32_and_8bit_checkpoints_quantizes(source):
    params = _params()
    if source == "torch.optim.AdamW":
        other = torch.optim.AdamW(params, lr=1e-2)
    else:
        other = mfa.AdamW8bit(params, lr=1e-2, min_8bit_size=300)
    for step in (1, 2):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        other.step()
    sd = copy.deepcopy(other.state_dict())
    opt = mfa.AdamW4bit(params, lr=1e-2, min_4bit_size=300)
    opt.load_state_dict(sd)
    for p in params:
        st, src = opt.state[p], other.state[p]
        if "exp_avg" in src:
            m, v = src["exp_avg"].float().reshape(-1), src["exp_avg_sq"].float().reshape(-1)
        else:
            m = dequantize(src["exp_avg_codes"], src["exp_avg_absmax"], True).reshape(-1)
            v = dequantize(src["exp_avg_sq_codes"], src["exp_avg_sq_absmax"], False).reshape(-1)
        assert st["step"] == 2
        if p.numel() < 300:
            assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
            assert torch.equal(st["exp_avg"].reshape(-1), m) and torch.equal(st["exp_avg_sq"].reshape(-1), v)
            continue
        assert set(st) == {"step", *NAMES, "param_shape4"} and st["param_shape4"].tolist() == list(p.shape)
        a1, a2 = block_absmax(m, 128), block_absmax(v, 128)
        assert torch.equal(st[NAMES[1]], a1) and torch.equal(st[NAMES[3]], a2)
        assert torch.equal(st[NAMES[0]], quantize4(m, a1, True)) and torch.equal(st[NAMES[2]], quantize4(v, a2, False))
    for p, g in zip(params, _grads(params, 3)):
        p.grad = g
    opt.step()  # and it trains on
    assert all(opt.state[p]["step"] == 3 for p in params)


@pytest.mark.parametrize("shapes", [[(4999,), (64, 130)], [(5000,), (130, 64)]], ids=["one-fewer", "transposed"])
def test_states_of_another_shape_are_refused(shapes):
    """Packed codes and block scales have the same sizes for 5000 and 4999 elements, and for any
    shape of 8320: the state's param_shape4 tells, so a state dict made for other shapes is refused
    before anything is loaded, and so is a param whose data changed shape after its first step."""
    made = [torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(64, 130))]
    opt = mfa.AdamW4bit(made)
    for p in made:
        p.grad = torch.randn_like(p)
    opt.step()
    assert [opt.state[p]["param_shape4"].tolist() for p in made] == [[5000], [64, 130]]
    others = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    other_opt = mfa.AdamW4bit(others)
    with pytest.raises(ValueError, match=r"4-bit states were made for a param of shape \(\d+, ?\d*\)"):
        other_opt.load_state_dict(opt.state_dict())
    assert not other_opt.state
    changed = 0 if shapes[0] != (5000,) else 1
    p, kept = made[changed], made[1 - changed]
    p.data = torch.randn(shapes[changed])
    p.grad = torch.randn_like(p)
    before = kept.detach().clone()
    kept.grad = torch.randn_like(before)
    with pytest.raises(ValueError, match="4-bit states were made for a param of shape"):
        opt.step()
    assert torch.equal(kept.detach(), before)  # nothing stepped


def test_4bit_state_dict_into_8bit_is_refused_clearly():
    p = torch.nn.Parameter(torch.randn(5000))
    opt = mfa.AdamW4bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    eight = mfa.AdamW8bit([p])
    with pytest.raises(ValueError, match="4-bit states.*AdamW4bit"):
        eight.load_state_dict(opt.state_dict())
    assert not eight.state  # nothing loaded


@pytest.mark.parametrize("kwargs,match", [
    (dict(amsgrad=True), "AdamW4bit does not support amsgrad=True"),
    (dict(capturable=True), "does not support capturable=True"),
    (dict(differentiable=True), "does not support differentiable=True"),
    (dict(block_size=64), "block_size=64 is not supported.*128"),
    (dict(min_4bit_size=0), "min_4bit_size must be a positive element count"),
    (dict(min_4bit_size="4096"), "min_4bit_size must be a positive element count"),
])
def test_rejected_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mfa.AdamW4bit([torch.nn.Parameter(torch.zeros(4))], **kwargs)
    # The same option in a group added later is refused too (not stepped without it), and the
    # optimizer keeps its groups.
    opt = mfa.AdamW4bit([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match=match.replace("AdamW4bit does", "AdamW4bit param_groups.1. does")):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))], **kwargs})
    assert len(opt.param_groups) == 1


def test_group_defaults_and_keys():
    opt = mfa.Adam4bit([torch.nn.Parameter(torch.zeros(4))])
    g = opt.param_groups[0]
    assert g["min_4bit_size"] == lowbit4.MIN_4BIT_SIZE and g["adam_w_mode"] is False and g["weight_decay"] == 0.0
    assert mfa.AdamW4bit([torch.nn.Parameter(torch.zeros(4))]).param_groups[0]["adam_w_mode"] is True
    assert mfa.Adam4bit([torch.nn.Parameter(torch.zeros(4))], decoupled_weight_decay=True).param_groups[0]["adam_w_mode"]


# ---- torchao's state dicts ------------------------------------------------------------------

class _TorchaoState:
    """torchao's OptimState4bit as its documented attributes (``codes``, ``scale``, ``qmap``,
    ``signed``, the shape), without torchao: CI does not install it."""

    def __init__(self, values: torch.Tensor, signed: bool, block: int = 128, qmap=None):
        self.shape = values.shape
        flat = values.reshape(-1).float()
        scale = flat.view(-1, block).abs().amax(-1).clip(1e-12)  # torchao's scale_tensor
        xn = flat.view(-1, block) / scale.view(-1, 1)
        self.qmap = lowbit4.map4(signed).clone() if qmap is None else qmap
        codes = (xn.reshape(-1, 1) - self.qmap.view(1, -1)).abs().argmin(-1).to(torch.uint8)  # nearest code
        self.codes = (codes[::2] << 4) | codes[1::2]  # torchao's packing
        self.scale = scale
        self.signed = signed


def _torchao_like_state_dict(**state_kw):
    gen = torch.Generator().manual_seed(8)
    m = torch.randn(64, 128, generator=gen) * 1e-2
    v = torch.rand(64, 128, generator=gen) * 1e-4
    st0 = {"step": torch.tensor(7.0), "exp_avg": _TorchaoState(m, True, **state_kw),
           "exp_avg_sq": _TorchaoState(v, False, **state_kw)}
    st1 = {"step": torch.tensor(7.0), "exp_avg": torch.randn(10, generator=gen), "exp_avg_sq": torch.rand(10)}
    group = {"lr": torch.tensor(1e-3), "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
             "params": [0, 1]}
    return {"state": {0: st0, 1: st1}, "param_groups": [group]}, m, v


def test_from_torchao_layout_built_by_hand():
    sd, m, v = _torchao_like_state_dict()
    ours = torchao_compat.from_torchao(sd)
    st = ours["state"][0]
    assert st["step"] == 7 and st[NAMES[0]] is not sd["state"][0]["exp_avg"].codes
    assert torch.equal(st[NAMES[0]], sd["state"][0]["exp_avg"].codes)
    assert torch.equal(st[NAMES[3]], sd["state"][0]["exp_avg_sq"].scale)
    assert ours["param_groups"][0]["lr"] == pytest.approx(1e-3) and ours["param_groups"][0]["adam_w_mode"] is True
    p0, p1 = torch.nn.Parameter(torch.zeros(64, 128)), torch.nn.Parameter(torch.zeros(10))
    opt = mfa.AdamW4bit([p0, p1], lr=1e-3)
    opt.load_state_dict(ours)
    got = opt.state[p0]
    # The codes mean what torchao's meant: dequantized, within half a code gap of the moments.
    back = dequantize4(got[NAMES[0]], got[NAMES[1]], True, m.numel()).view(m.shape)
    assert (back - m).abs().max().item() <= 0.12 * m.abs().max().item()
    assert set(opt.state[p1]) == {"step", "exp_avg", "exp_avg_sq"}  # 10 elements: fp32 moments
    p0.grad, p1.grad = torch.randn_like(p0), torch.randn_like(p1)
    opt.step()
    assert opt.state[p0]["step"] == 8


def test_loading_torchao_state_unconverted_says_how():
    sd, _, _ = _torchao_like_state_dict()
    opt = mfa.AdamW4bit([torch.nn.Parameter(torch.zeros(64, 128)), torch.nn.Parameter(torch.zeros(10))])
    with pytest.raises(ValueError, match="torchao_compat.from_torchao"):
        opt.load_state_dict(sd)


def test_from_torchao_refusals():
    sd, _, _ = _torchao_like_state_dict(block=256)
    with pytest.raises(ValueError, match="block size 256.*128"):
        torchao_compat.from_torchao(sd)
    sd, _, _ = _torchao_like_state_dict(qmap=torch.linspace(-1, 1, 16))
    with pytest.raises(ValueError, match="qmap is not torchao's 4-bit signed map"):
        torchao_compat.from_torchao(sd)
    sd, _, _ = _torchao_like_state_dict()
    sd["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        torchao_compat.from_torchao(sd)
    sd, _, _ = _torchao_like_state_dict()
    sd["state"][0]["exp_avg"].codes = sd["state"][0]["exp_avg"].codes[:-1]
    with pytest.raises(ValueError, match="code bytes for 8192 elements"):
        torchao_compat.from_torchao(sd)

    class OptimState8bit:  # torchao's 8-bit state, by its class name
        pass
    sd, _, _ = _torchao_like_state_dict()
    sd["state"][0]["exp_avg"] = OptimState8bit()
    with pytest.raises(ValueError, match="OptimState8bit.*only its 4-bit"):
        torchao_compat.from_torchao(sd)


def test_from_torchao_real_checkpoint():
    """A state dict of torchao's own AdamW4bit (its tensor subclass): our load reads the same
    moments, and a step from them agrees with the 4-bit reference."""
    require_torchao()
    from torchao.optim import AdamW4bit as TorchaoAdamW4bit
    from torchao.optim.subclass_4bit import OptimState4bit
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 128))
    theirs = OptimState4bit.zeros(p.shape, signed=True, block_size=128)
    theirs.copy_(torch.randn(p.shape) * 1e-2)
    theirs_sq = OptimState4bit.zeros(p.shape, signed=False, block_size=128)
    theirs_sq.copy_(torch.rand(p.shape) * 1e-4)
    # torchao's step needs torch.compile with a GPU backend; its state dict is plain torch's.
    opt_ao = TorchaoAdamW4bit([p], lr=1e-3)
    opt_ao.state[p] = {"step": torch.tensor(3.0), "exp_avg": theirs, "exp_avg_sq": theirs_sq}
    sd = opt_ao.state_dict()
    ours = mfa.AdamW4bit([p], lr=1e-3)
    ours.load_state_dict(torchao_compat.from_torchao(sd))
    st = ours.state[p]
    assert torch.equal(dequantize4(st[NAMES[0]], st[NAMES[1]], True, p.numel()).view(p.shape), theirs.dequantize())
    assert torch.equal(dequantize4(st[NAMES[2]], st[NAMES[3]], False, p.numel()).view(p.shape),
                       theirs_sq.dequantize())
    assert st["step"] == 3


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("cls", ["AdamW4bit", "AdamW8bit"])
def test_distributed_checkpoint_round_trip(tmp_path, cls, flatten):
    """torch.distributed.checkpoint (single process) saves and loads the low-bit states, nested or
    flattened (flattening takes tensor, int, float and dict states only: param_shape4 is a
    tensor), and the loaded optimizer continues bit for bit as the saver."""
    import warnings
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    size_key = "min_4bit_size" if cls == "AdamW4bit" else "min_8bit_size"

    def model_and_opt(seed=0):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 5))
        return m, getattr(mfa, cls)(m.parameters(), lr=1e-2, **{size_key: 1024})

    def train(m, opt, steps, start):
        for s in range(start, start + steps):
            torch.manual_seed(1000 + s)
            opt.zero_grad()
            m(torch.randn(4, 64)).pow(2).sum().backward()
            opt.step()

    m, opt = model_and_opt()
    train(m, opt, 3, 0)
    dcp.save({"optim": get_optimizer_state_dict(m, opt, options=options)}, checkpoint_id=str(tmp_path))
    m2, opt2 = model_and_opt(seed=1)
    m2.load_state_dict(m.state_dict())
    target = {"optim": get_optimizer_state_dict(m2, opt2, options=options)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(m2, opt2, target["optim"], options=options)
    train(m, opt, 2, 3)
    train(m2, opt2, 2, 3)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a.detach(), b.detach())
