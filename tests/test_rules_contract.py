"""Every rule of contract.RULES is registered everywhere (test_rule_is_registered_everywhere), and the
Lion and Adagrad contracts (contract.py / reference.py) against independent implementations:
torch.optim.Adagrad, and Lion as lion_pytorch writes it (Adam's: test_contract.py).

The reference is what every backend must match bit for bit; here it is checked to be the algorithm
users know. The independent implementations round differently (torch's CPU add-with-alpha and
addcdiv may fuse multiply-adds; torch's fp32 sqrt is not always correctly rounded), so they agree
to a few fp32 ulps, not bit for bit: the bound used is 8 ulps of max(|p|, lr) per element after
several steps, and a wrong rule (a halved learning rate, a dropped term) is far outside it.
"""
from __future__ import annotations

import os
import struct

import pytest
import torch

from optim_db import OPTIM_DB, rule_example_class
from mps_fused_adam.numerics.contract import RULES, element_rules, AdagradHyper, LionHyper, adagrad_scalars, lion_scalars
from mps_fused_adam.numerics.reference import lion_sign, reference_adagrad_, reference_lion_

ULP = torch.finfo(torch.float32).eps

# Each rule's independent implementation and the test (module, function) that checks the rule's
# reference against it: a rule of contract.RULES without an entry fails test_rule_is_registered_everywhere.
# (tests/optim_db.py: the ``rule_check`` of the rule's example class.)
COUNTERPARTS = {info.rule: (info.counterpart, *info.rule_check) for info in OPTIM_DB.values() if info.rule_check}
# The (param, state) dtype pairs every rule has a Metal kernel for (Metal type names).
METAL_PAIRS = [("float", "float"), ("half", "float"), ("half", "half"), ("bfloat", "float"), ("bfloat", "bfloat")]


def _metal_instantiations() -> dict[str, set[tuple[str, str, str]]]:
    """rule -> {(kernel shape, param type, state type)} that a Metal 3.1 compiler instantiates from
    the shipped source: preprocessed first (the instantiation macros expanded, bfloat included),
    then each ``[[host_name("fused_" "<rule>" ...)]] ... decltype(<shape><Rule, P, S>)`` read."""
    import re
    import subprocess
    from emulated_mps import METAL_SOURCE, find_compiler
    proc = subprocess.run([find_compiler(), "-E", "-P", "-x", "c++", "-D__METAL_VERSION__=310",
                           "-DFUSED_ADAM_HOST_EMULATOR", "-"], input=METAL_SOURCE.read_text(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    found: dict[str, set[tuple[str, str, str]]] = {}
    for name, shape, p, st in re.findall(r'host_name\(\s*"fused_"\s*"(\w+)"[^)]*\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*'
                                         r'decltype\(\s*(\w+)\s*<\s*\w+\s*,\s*(\w+)\s*,\s*(\w+)\s*>', proc.stdout):
        found.setdefault(name, set()).add((shape, p, st))
    assert found, "no kernel instantiations found in the preprocessed Metal source"
    return found


@pytest.mark.parametrize("rule", element_rules())
def test_rule_is_registered_everywhere(rule):
    """Every rule of contract.RULES has each piece a rule needs (contract.py's docstring lists
    them): a forgotten registration fails here by name instead of going untested."""
    import importlib
    import mps_fused_adam as mfa
    from mps_fused_adam import _cpu, backends
    from mps_fused_adam.tools import selfcheck
    from mps_fused_adam.numerics.reference import REFERENCES
    spec = RULES[rule]
    assert rule in REFERENCES, f"{rule}: no reference in reference.REFERENCES"
    assert rule in backends.ForeachBackend.RULES, f"{rule}: no foreach form in backends.ForeachBackend.RULES"
    assert rule in _cpu.rules(), f"{rule}: the CPU kernel lacks it (src/cpu/adam_types.h, MFA_RULES)"
    shape = f"fused_step_{len(spec.states)}"
    want = {(shape, p, st) for p, st in METAL_PAIRS}
    assert want <= _metal_instantiations().get(rule, set()), \
        f"{rule}: Metal kernels missing from metal/fused_adam.metal: {sorted(want - _metal_instantiations().get(rule, set()))}"
    ex = spec.example
    assert ex is not None, f"{rule}: no example (contract.Example in its RULES entry)"
    for step in (1, 2):
        for maximize in (False, True):
            for wd in (0.0, 0.1):
                hp = ex.hyper(step, maximize=maximize, weight_decay=wd)
                assert isinstance(hp, spec.hyper) and len(spec.pack(hp)) == struct.calcsize(spec.struct_format)
                assert hp.maximize == maximize and hp.weight_decay == wd
    assert set(ex.nonnegative) <= set(spec.states) and len(ex.modes) == 2
    cls = getattr(mfa, ex.optimizer)
    assert cls._rule == rule, f"{rule}: its example's optimizer {ex.optimizer} runs rule {cls._rule!r}"
    kwargs = rule_example_class(rule).example_kwargs
    opt = cls([torch.nn.Parameter(torch.zeros(3))], **kwargs)
    assert opt._hyper(opt.param_groups[0], 2) == ex.hyper(2), f"{rule}: optim_db's example_kwargs do not give hyper(step)"
    for flag in (True, False):  # the self-check's cases are the rule's own (once: Adagrad's for any rule)
        assert isinstance(selfcheck._hypers(rule, 3, flag), spec.hyper)
    assert rule in COUNTERPARTS, f"{rule}: no independent implementation checked against its reference (COUNTERPARTS)"
    _, module, test = COUNTERPARTS[rule]
    assert callable(getattr(importlib.import_module(module), test, None)), f"{rule}: {module}.{test} does not exist"


def within_ulps(ours: torch.Tensor, theirs: torch.Tensor, scale: float, ulps: float = 8.0) -> float:
    """Largest difference in fp32 ulps of max(|theirs|, scale); asserts it is at most ``ulps``."""
    err = ((ours.float() - theirs.float()).abs() / (ULP * theirs.float().abs().clamp_min(scale))).max().item()
    assert err <= ulps, f"{err:.1f} ulps"
    return err


def lion_pytorch_update_fn(p, grad, exp_avg, lr, wd, beta1, beta2):
    """lion_pytorch 0.2.5's update_fn (lion_pytorch/lion_pytorch.py, MIT licence), verbatim: the
    independent statement of Lion that the package's ``lion_pytorch.Lion`` runs."""
    p.data.mul_(1. - lr * wd)
    update = exp_avg.clone().mul_(beta1).add(grad, alpha=1. - beta1).sgn_()
    p.add_(update, alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1. - beta2)


def lion_pytorch_or_skip():
    """The real lion_pytorch package (the [test] extra installs it; CI must have it)."""
    try:
        import lion_pytorch
    except ImportError:
        if os.environ.get("MFA_REQUIRE_TOOLS"):
            pytest.fail("lion_pytorch is not installed (the [test] extra installs it; MFA_REQUIRE_TOOLS is set)")
        pytest.skip("lion_pytorch not installed (pip install lion-pytorch==0.2.5)")
    return lion_pytorch


def test_lion_scalars_rounded_once_from_double():
    s = lion_scalars(LionHyper(lr=3e-4, beta1=0.9, beta2=0.99, weight_decay=0.1))
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    assert s.one_minus_beta1 == f32(1 - 0.9) and s.one_minus_beta2 == f32(1 - 0.99)
    assert s.decay == f32(1 - 3e-4 * 0.1)
    assert s.one_minus_beta1 != f32(1 - f32(0.9))  # the fp32 subtraction would round differently


def test_adagrad_scalars_lr_decay_in_double():
    s = adagrad_scalars(AdagradHyper(lr=0.1, eps=1e-10, weight_decay=0.0, step=11, lr_decay=0.05))
    assert s.clr == torch.tensor(0.1 / 1.5, dtype=torch.float32).item()
    assert s.l2 == 0
    assert adagrad_scalars(AdagradHyper(lr=0.1, eps=1e-10, weight_decay=1e-4, step=1)).l2 == 1


def test_lion_sign_semantics():
    c = torch.tensor([2.0, -3.0, 0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45])
    s = lion_sign(c)
    assert s[:6].tolist() == [1.0, -1.0, 0.0, 0.0, 1.0, -1.0] and s[7].item() == 1.0
    assert not torch.signbit(s[3]), "sign(-0) is +0, as torch.sign gives"
    assert torch.isnan(s[6]), "sign(NaN) is NaN: NaN propagates instead of skipping the update"


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_reference_matches_lion_pytorch_update(wd):
    # fp32 only: with bf16 storage lion_pytorch rounds every intermediate (and the momentum that
    # decides the sign) to bf16, so signs near zero legitimately differ from the fp32 contract.
    torch.manual_seed(0)
    n, lr, b1, b2 = 50_000, 1e-3, 0.9, 0.99
    p0 = torch.randn(n)
    ours = [p0.clone(), torch.zeros(n)]
    theirs = [p0.clone(), torch.zeros(n)]
    half = [p0.clone(), torch.zeros(n)]
    for _ in range(6):
        g = torch.randn(n)
        reference_lion_(ours[0], g, ours[1], LionHyper(lr=lr, beta1=b1, beta2=b2, weight_decay=wd))
        reference_lion_(half[0], g, half[1], LionHyper(lr=lr / 2, beta1=b1, beta2=b2, weight_decay=wd))
        lion_pytorch_update_fn(theirs[0], g, theirs[1], lr, wd, b1, b2)
    within_ulps(ours[0], theirs[0], lr)
    within_ulps(ours[1], theirs[1], 0.1)
    # A wrong rule is far outside the bound: half the learning rate is off by about 3 lr.
    with pytest.raises(AssertionError):
        within_ulps(half[0], theirs[0], lr)


def test_lion_nan_propagates_and_zero_momentum_keeps_param():
    p = torch.tensor([1.0, 2.0, -0.0])
    g = torch.tensor([float("nan"), 0.0, 0.0])
    m = torch.zeros(3)
    reference_lion_(p, g, m, LionHyper(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0))
    assert torch.isnan(p[0]) and torch.isnan(m[0])
    assert p[1].item() == 2.0 and m[1].item() == 0.0
    assert p[2].item() == 0.0 and torch.signbit(p[2]), "-0 stays -0 when sign(c) = 0"


@pytest.mark.parametrize("kwargs", [
    dict(lr=0.1),
    dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.2),
    dict(lr=0.05, eps=1e-6, maximize=True),
])
def test_adagrad_reference_matches_torch(kwargs):
    torch.manual_seed(0)
    n = 50_000
    p0 = torch.randn(n)
    ours, state_sum = p0.clone(), torch.full((n,), float(kwargs.get("initial_accumulator_value", 0.0)))
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.Adagrad([param], **kwargs)
    for step in range(1, 7):
        g = torch.randn(n)
        hp = AdagradHyper(lr=kwargs["lr"], eps=kwargs.get("eps", 1e-10), weight_decay=kwargs.get("weight_decay", 0.0),
                          step=step, lr_decay=kwargs.get("lr_decay", 0.0), maximize=kwargs.get("maximize", False))
        reference_adagrad_(ours, g, state_sum, hp)
        param.grad = g.clone()
        opt.step()
    within_ulps(ours, param.detach(), kwargs["lr"])
    within_ulps(state_sum, opt.state[param]["sum"], 1.0)
    assert not torch.equal(ours, p0)


def test_adagrad_first_step_moves_by_lr():
    """With a zero accumulator the first step is lr * g / (|g| + eps): about lr for every element."""
    p = torch.zeros(1000)
    g = torch.randn(1000)
    s = torch.zeros(1000)
    reference_adagrad_(p, g, s, AdagradHyper(lr=0.01, eps=1e-10, weight_decay=0.0, step=1))
    torch.testing.assert_close(p, -0.01 * torch.sign(g), rtol=1e-6, atol=0)
    assert torch.equal(s, g * g)


def test_lion_reference_matches_lion_pytorch_class():
    lion_pytorch = lion_pytorch_or_skip()
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(20_000))
    ours, m = p.detach().clone(), torch.zeros(20_000)
    opt = lion_pytorch.Lion([p], lr=3e-4, betas=(0.9, 0.99), weight_decay=0.5)
    for _ in range(5):
        g = torch.randn(20_000)
        p.grad = g.clone()
        opt.step()
        reference_lion_(ours, g, m, LionHyper(lr=3e-4, beta1=0.9, beta2=0.99, weight_decay=0.5))
    within_ulps(ours, p.detach(), 3e-4)
    within_ulps(m, opt.state[p]["exp_avg"], 0.1)
