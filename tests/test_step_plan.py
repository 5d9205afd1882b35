"""The cached step plans (step_plan.py): each step after the first is checked against a plan
instead of validated in full. Whatever changes between steps, the result must be the full path's:
the same numbers as the reference, the same errors, nothing changed by a rejected step."""
from __future__ import annotations

import pytest
import torch

import mps_fused_adam as mfa
from mps_fused_adam.optimizers import step_plan
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference import reference_adam_

LR, WD = 1e-2, 1e-2


class Mirror:
    """Params and their reference copies, stepped by the optimizer and by ``reference_adam_``."""

    def __init__(self, shapes, dtype=torch.float32, state_dtype=None, cls=mfa.AdamW, **kw):
        self.params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
        sd = state_dtype or dtype
        self.refs = [[p.detach().clone(), None, torch.zeros(p.shape, dtype=sd), torch.zeros(p.shape, dtype=sd), 0]
                     for p in self.params]
        self.opt = cls(self.params, lr=LR, weight_decay=WD, **kw)

    def step(self, skip=()):
        for i, (p, r) in enumerate(zip(self.params, self.refs)):
            if i in skip:
                p.grad = None
                continue
            p.grad = torch.randn(p.shape).to(p.dtype)
            r[1] = p.grad.clone()
        self.opt.step()
        for i, r in enumerate(self.refs):
            if i not in skip:
                r[4] += 1
                reference_adam_(*r[:4], AdamHyper(LR, 0.9, 0.999, 1e-8, WD, r[4]))
        self.assert_matches()

    def assert_matches(self):
        for p, r in zip(self.params, self.refs):
            assert torch.equal(p.detach(), r[0])
            st = self.opt.state[p]
            assert torch.equal(st["exp_avg"], r[2]) and torch.equal(st["exp_avg_sq"], r[3])
            assert st["step"] == r[4]

    def plan(self, group=0):
        return self.opt._plans.get(group)


def uses(plan):
    return plan.uses if isinstance(plan, step_plan.Plan) else None


@pytest.fixture(autouse=True, params=["shim", "attributes"])
def check_path(request):
    """Every test twice: plans reading tensors through torch's C shim (tensor_handles.h), and
    through their Python attributes (the path where this torch lacks the shim)."""
    cpu = step_plan.native()
    cpu.set_tensor_handles_active(request.param == "shim")
    yield request.param
    cpu.set_tensor_handles_active(True)


def test_plans_use_the_shim_where_enabled(check_path):
    m = Mirror([(5,), (3, 4)])
    m.step()
    m.step()
    assert uses(m.plan()) == 1
    assert m.plan().native.uses_handles == (check_path == "shim")


def test_handles_hold_no_tensor_past_their_use(check_path):
    """A grad's handle lives for one check, a plan's handles as long as the plan: afterwards each
    tensor's C++ use count is what it was (a leaked handle would keep the tensor alive)."""
    import gc
    m = Mirror([(5,), (3, 4)])
    m.step()
    m.step()
    grads = [torch.randn(p.shape) for p in m.params]
    counts = [g._use_count() for g in grads]
    for p, g in zip(m.params, grads):
        p.grad = g
    m.opt.step()
    assert uses(m.plan()) == 2
    for p in m.params:
        p.grad = None
    assert [g._use_count() for g in grads] == counts
    p0, state0 = m.params[0], m.opt.state[m.params[0]]["exp_avg"]
    held, held_state = p0._use_count(), state0._use_count()
    m.opt._plans.clear()  # as a loaded state dict or a changed param list does
    gc.collect()
    released = 1 if check_path == "shim" else 0
    assert (p0._use_count(), state0._use_count()) == (held - released, held_state - released)


def test_steady_steps_use_the_plan_and_match_reference():
    m = Mirror([(5,), (3, 4), (7,)])
    m.step()  # full path; plans for the next step
    for expected in (1, 2, 3):
        m.step()
        assert uses(m.plan()) == expected


def test_param_data_replaced():
    m = Mirror([(6,), (2, 3)])
    m.step()
    m.step()
    new = torch.randn(6)
    m.params[0].data = new.clone()  # new storage, same shape: the plan's address no longer holds
    m.refs[0][0] = new
    m.step()
    assert uses(m.plan()) == 0  # re-planned after a full step
    m.step()
    assert uses(m.plan()) == 1


def test_param_dtype_change_with_fp32_states():
    m = Mirror([(8,), (8,)], state_dtype=torch.float32, cls=mfa.CPUAdam)
    m.step()
    m.step()
    m.params[1].data = m.params[1].data.to(torch.bfloat16)
    m.refs[1][0] = m.refs[1][0].to(torch.bfloat16)
    m.step()
    m.step()


def test_param_dtype_change_rejected_when_states_follow_the_param():
    m = Mirror([(8,), (8,)])
    m.step()
    m.step()
    p = m.params[1]
    p.data = p.data.to(torch.bfloat16)
    p.grad = torch.randn(8).bfloat16()
    m.params[0].grad = torch.randn(8)
    before = [t.detach().clone() for t in m.params]
    with pytest.raises(ValueError, match=r"\['params'\]\[1\].*optimizer state 'exp_avg'.*expected shape \(8,\), "
                                         r"bfloat16, cpu"):
        m.opt.step()
    assert all(torch.equal(a.detach(), b) for a, b in zip(m.params, before))
    assert m.opt.state[m.params[0]]["step"] == 2


def test_param_on_another_device_rejected():
    # torch refuses `.data` of another device type, so the group's list gets another param.
    m = Mirror([(4,), (4,)], cls=mfa.CPUAdam)
    m.step()
    m.step()
    elsewhere = torch.nn.Parameter(torch.empty(4, device="meta"))
    elsewhere.grad = torch.empty(4, device="meta")
    m.opt.param_groups[0]["params"][0] = elsewhere
    m.params[1].grad = torch.randn(4)
    with pytest.raises(ValueError, match=r"\['params'\]\[0\].*expected a cpu tensor, found one on meta"):
        m.opt.step()
    assert m.opt.state[m.params[1]]["step"] == 2


def test_param_shrunk_at_same_address_rejected():
    """A shorter view of its own storage keeps the address: only the shape tells the plan apart."""
    m = Mirror([(16,), (4,)])
    m.step()
    m.step()
    p = m.params[0]
    addr = p.data_ptr()
    p.data = p.data[:8]
    assert p.data_ptr() == addr
    p.grad = torch.randn(8)
    m.params[1].grad = torch.randn(4)
    before = m.params[1].detach().clone()
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] \(shape \(8,\).*optimizer state 'exp_avg'.*expected shape \(8,\)"):
        m.opt.step()
    assert torch.equal(m.params[1].detach(), before)


def test_square_param_transposed_in_place_is_staged():
    """Same address, same shape, other strides: the plan must notice and stage the update."""
    m = Mirror([(4, 4), (3,)])
    m.step()
    m.step()
    p = m.params[0]
    p.data = p.data.t()
    assert not p.is_contiguous()
    m.refs[0][0] = p.detach().clone()
    m.step()
    assert not p.is_contiguous()


def test_stale_grad_after_reshape_in_place_rejected():
    """The param takes a new shape at the same address and keeps its grad of the planned shape:
    only the param's own shape tells the plan apart, and the full validation names the mismatch."""
    m = Mirror([(4, 4), (3,)])
    m.step()
    m.step()
    p = m.params[0]
    p.grad = torch.randn(4, 4)
    m.params[1].grad = torch.randn(3)
    addr = p.data_ptr()
    p.data = p.data.view(2, 8)
    assert p.data_ptr() == addr and p.grad.shape == (4, 4)
    before = m.params[1].detach().clone()
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] \(shape \(2, 8\).*grad shape \(4, 4\) does not match; "
                                         r"expected \(2, 8\)"):
        m.opt.step()
    assert torch.equal(m.params[1].detach(), before)


def test_state_dict_loaded():
    m = Mirror([(5,), (5,)])
    m.step()
    saved = m.opt.state_dict()
    saved = {"state": {k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else vv) for kk, vv in v.items()}
                       for k, v in saved["state"].items()}, "param_groups": saved["param_groups"]}
    refs_at_1 = [[t.clone() if isinstance(t, torch.Tensor) else t for t in r] for r in m.refs]
    m.step()
    m.step()
    m.opt.load_state_dict(saved)  # moments and step counts of step 1, params as they are now
    for r, old in zip(m.refs, refs_at_1):
        r[2], r[3], r[4] = old[2], old[3], old[4]
    m.step()
    m.step()


def test_add_param_group():
    m = Mirror([(5,), (2, 2)])
    m.step()
    m.step()
    q = torch.nn.Parameter(torch.randn(6))
    m.opt.add_param_group({"params": [q]})
    m.params.append(q)
    m.refs.append([q.detach().clone(), None, torch.zeros(6), torch.zeros(6), 0])
    m.step()
    assert uses(m.plan(0)) == 2  # the first group's plan still holds
    m.step()
    assert uses(m.plan(1)) == 1


def test_param_list_changed_in_place():
    m = Mirror([(5,), (3,)])
    m.step()
    m.step()
    q = torch.nn.Parameter(torch.randn(4))
    m.opt.param_groups[0]["params"].append(q)
    m.params.append(q)
    m.refs.append([q.detach().clone(), None, torch.zeros(4), torch.zeros(4), 0])
    m.step()
    m.step()
    r = torch.nn.Parameter(torch.randn(4))
    m.opt.param_groups[0]["params"][2] = r  # same length, another param
    m.params[2] = r
    m.refs[2] = [r.detach().clone(), None, torch.zeros(4), torch.zeros(4), 0]
    m.step()


@pytest.mark.parametrize("how", ["tensor", "dict", "deleted"])
def test_state_replaced(how):
    m = Mirror([(6,), (6,)])
    m.step()
    m.step()
    p, r = m.params[1], m.refs[1]
    if how == "tensor":
        r[2] = torch.randn(6) * 0.1
        m.opt.state[p]["exp_avg"] = r[2].clone()
    elif how == "dict":
        r[2], r[3], r[4] = torch.randn(6) * 0.1, torch.rand(6) * 0.01, 7
        m.opt.state[p] = {"step": 7, "exp_avg": r[2].clone(), "exp_avg_sq": r[3].clone()}
    else:
        del m.opt.state[p]
        r[2], r[3], r[4] = torch.zeros(6), torch.zeros(6), 0
    m.step()
    m.step()


def test_state_tensor_data_replaced():
    m = Mirror([(6,), (6,)])
    m.step()
    m.step()
    st = m.opt.state[m.params[0]]
    fresh = torch.rand(6) * 0.01
    st["exp_avg_sq"].data = fresh.clone()  # same tensor object, new storage
    m.refs[0][3] = fresh
    m.step()


def test_step_count_changed():
    m = Mirror([(6,), (6,)])
    m.step()
    m.step()
    m.opt.state[m.params[0]]["step"] = 0
    m.refs[0][4] = 0
    m.step()
    m.step()


def test_grads_come_and_go():
    m = Mirror([(5,), (5,), (5,)])
    m.step()
    m.step(skip={1})
    m.step(skip={1})
    m.step()
    m.step(skip={0, 2})
    m.step()


def test_non_contiguous_grad_on_planned_param():
    m = Mirror([(3, 3), (4,)])
    m.step()
    m.step()
    p, r = m.params[0], m.refs[0]
    p.grad = torch.randn(3, 3).t()
    r[1] = p.grad.clone()
    m.params[1].grad = torch.randn(4)
    m.refs[1][1] = m.params[1].grad.clone()
    m.opt.step()
    for rr in m.refs:
        rr[4] += 1
        reference_adam_(*rr[:4], AdamHyper(LR, 0.9, 0.999, 1e-8, WD, rr[4]))
    m.assert_matches()


def test_state_dtype_policy_changed():
    m = Mirror([(8,)], dtype=torch.bfloat16, state_dtype=torch.float32, cls=mfa.CPUAdam)
    m.step()
    m.step()
    m.opt.fp32_optimizer_states = False
    m.params[0].grad = torch.randn(8).bfloat16()
    with pytest.raises(ValueError, match="optimizer state 'exp_avg'.*expected shape \\(8,\\), bfloat16"):
        m.opt.step()


def test_hyperparameters_read_every_step():
    m = Mirror([(5,), (5,)])
    m.step()
    m.step()
    m.opt.param_groups[0]["lr"] = -1.0
    for p in m.params:
        p.grad = torch.randn(5)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        m.opt.step()
    m.opt.param_groups[0]["lr"] = LR
    m.step()
    assert uses(m.plan()) == 2


def test_group_of_1000_tensors_matches_reference():
    m = Mirror([(3,)] * 1000)
    for _ in range(4):
        m.step()
    assert uses(m.plan()) == 3


@pytest.fixture(params=["torch openmp", "own pool"])
def pool(request):
    """The pool that shares a large group's reads: torch's OpenMP threads (the default where found),
    where the planned tensors' shim reads overlap the caller's Python reads, and our own pool, where
    they follow them (no Python runs inside our pool's run: step_plan.cpp says why)."""
    from mps_fused_adam import _cpu
    _cpu.use_torch_openmp(request.param == "torch openmp")
    yield request.param
    _cpu.use_torch_openmp(True)


@pytest.mark.parametrize("where", ["param", "state", "grad", "no grad", "state object"])
@pytest.mark.parametrize("index", [0, 350, 699])
def test_check_shared_over_threads_sees_a_change_in_every_part(where, index, pool):
    """A large group's shim reads are split over pool threads (step_plan.cpp, ShimCheck), those of
    the planned params and states running while the caller reads the grads and state dicts:
    whichever part holds the change (a shim read: param, state, grad; a Python read: a grad gone,
    a state tensor replaced by another object), and however many threads share the reads, the
    check rejects the step and hands back nothing; otherwise it hands back every grad and its
    address in entry order, and keeps no grad alive."""
    m = Mirror([(4,)] * 700)
    m.step()
    m.step()
    plan = m.plan().native
    for p in m.params:
        p.grad = torch.randn(4)
    counts = [p.grad._use_count() for p in m.params]
    for threads in (1, 2, 5):
        grads, addresses = [], []
        assert plan.check(m.params, grads, addresses, threads)
        assert [g is p.grad for g, p in zip(grads, m.params)] == [True] * 700
        assert addresses == [p.grad.data_ptr() for p in m.params]
    del grads
    assert [p.grad._use_count() for p in m.params] == counts
    p = m.params[index]
    if where == "param":
        p.data = torch.randn(4)
    elif where == "state":
        m.opt.state[p]["exp_avg_sq"].data = torch.zeros(4)
    elif where == "grad":
        p.grad.data = torch.randn(3)
    elif where == "no grad":
        p.grad = None
    else:
        m.opt.state[p]["exp_avg"] = m.opt.state[p]["exp_avg"].clone()
    for threads in (1, 2, 5):
        grads, addresses = [], []
        assert not plan.check(m.params, grads, addresses, threads)
        assert grads == [] and addresses == []
    assert [q.grad._use_count() for q in m.params if q.grad is not None] == [
        c for q, c in zip(m.params, counts) if q.grad is not None]


class _ObservedGradParam(torch.nn.Parameter):
    """A param whose ``grad`` is a Python property that runs torch operators (and counts its
    reads): the check then runs Python code in its Python part."""

    reads = 0

    @property
    def grad(self):
        type(self).reads += 1
        torch.ones(1 << 16).add_(1.0).sum()  # an operator that may use torch's threads
        return torch.nn.Parameter.grad.__get__(self)

    @grad.setter
    def grad(self, value):
        torch.nn.Parameter.grad.__set__(self, value)


def test_check_shared_over_threads_runs_python_grad_getters(pool):
    """Python code in the check's Python part (a grad property running torch operators), while
    pool threads share the shim reads: the steps still match the reference and use the plan."""
    torch.manual_seed(3)
    params = [_ObservedGradParam(torch.randn(4)) for _ in range(300)]
    refs = [[p.detach().clone(), None, torch.zeros(4), torch.zeros(4), 0] for p in params]
    opt = mfa.AdamW(params, lr=LR, weight_decay=WD)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for _ in range(4):
            for p, r in zip(params, refs):
                p.grad = torch.randn(4)
                r[1] = p.grad.clone()
                r[4] += 1
                reference_adam_(*r[:4], AdamHyper(LR, 0.9, 0.999, 1e-8, WD, r[4]))
            before = _ObservedGradParam.reads
            opt.step()
            assert _ObservedGradParam.reads - before >= len(params)
    finally:
        torch.set_num_threads(threads)
    assert uses(opt._plans.get(0)) == 3
    for p, r in zip(params, refs):
        assert torch.equal(p.detach(), r[0]) and torch.equal(opt.state[p]["exp_avg_sq"], r[3])


def test_mps_buffers_match_mps_buffer():
    """Tier 1's quick buffer triples are mps_buffer's, for views at an offset, with addresses from a
    plan's list or read afresh, and for an empty tensor."""
    from mps_fused_adam.backends import Addressed
    from mps_fused_adam.backends.mps import mps_buffer, mps_buffers
    base = torch.randn(64).bfloat16()
    tensors = [base[10:30], base[3:7], torch.randn(5).bfloat16(), base.view(8, 8)[2:4], base[5:5]]
    expected = [mps_buffer(t) for t in tensors]
    numels = [t.numel() for t in tensors]
    assert mps_buffers(tensors, numels) == expected
    listed = Addressed(tensors)
    listed.addresses, listed.numels = [t.data_ptr() for t in tensors], numels
    assert mps_buffers(listed, numels) == expected
    assert expected[0][1] == 20 and expected[0][0] == base.untyped_storage().data_ptr()


def test_param_dtype_reinterpreted_at_same_address_rejected():
    """A bf16 param viewed as fp16 keeps its address and shape: only its dtype tells the plan apart."""
    m = Mirror([(8,), (8,)], dtype=torch.bfloat16)
    m.step()
    m.step()
    p = m.params[0]
    p.grad = torch.randn(8).bfloat16()
    m.params[1].grad = torch.randn(8).bfloat16()
    addr = p.data_ptr()
    p.data = p.data.view(torch.float16)
    assert p.data_ptr() == addr
    before = m.params[1].detach().clone()
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] \(shape \(8,\), float16, cpu\): grad dtype "
                                         r"torch.bfloat16 does not match; expected torch.float16"):
        m.opt.step()
    assert torch.equal(m.params[1].detach(), before)


def test_state_tensor_replaced_by_a_view_at_same_address_rejected():
    """Another tensor object over the same memory, of another dtype: only its identity tells."""
    m = Mirror([(8,), (8,)], dtype=torch.bfloat16)
    m.step()
    m.step()
    st = m.opt.state[m.params[1]]
    st["exp_avg"] = st["exp_avg"].view(torch.float16)
    for p in m.params:
        p.grad = torch.randn(8).bfloat16()
    before = [p.detach().clone() for p in m.params]
    with pytest.raises(ValueError, match=r"\['params'\]\[1\].*optimizer state 'exp_avg' is exp_avg \(shape \(8,\), "
                                         r"float16, cpu\); expected shape \(8,\), bfloat16, cpu"):
        m.opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(m.params, before))


def test_grad_of_another_shape_through_its_data_rejected():
    """torch's grad setter checks the shape, but a grad's own ``.data`` can still change it: the
    plan must read the new grad's shape, or the kernel would read past its memory."""
    m = Mirror([(8,), (8,)])
    m.step()
    m.step()
    for p in m.params:
        p.grad = torch.randn(8)
    m.params[0].grad.data = torch.randn(3)
    before = [p.detach().clone() for p in m.params]
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] \(shape \(8,\).*grad shape \(3,\) does not match; "
                                         r"expected \(8,\)"):
        m.opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(m.params, before))


def test_environment_variable_turns_the_shim_off():
    import subprocess
    import sys
    code = ("import torch, mps_fused_adam as mfa\n"
            "p = torch.nn.Parameter(torch.randn(4)); o = mfa.AdamW([p])\n"
            "for _ in range(2):\n    p.grad = torch.randn(4); o.step()\n"
            "print(o._plans[0].native.uses_handles)")
    out = {}
    for value in ("0", "1"):
        env = dict(__import__("os").environ, MPS_FUSED_ADAM_TENSOR_HANDLES=value)
        out[value] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True).stdout.strip()
    assert out == {"0": "False", "1": "True"}


@pytest.mark.parametrize("how", ["unsqueeze_", "resize_", "as_strided_"])
def test_state_tensor_changed_in_place_is_seen(how):
    """An in-place shape or stride change of a state tensor keeps its object and its address: the
    plan must still see it and leave the step to the full validation, which rejects it (a shape
    change) or stages it (a square state transposed in place), as on the first step."""
    m = Mirror([(4, 4), (4, 4)])
    m.step()
    m.step()
    st = m.opt.state[m.params[1]]
    t = st["exp_avg"]
    if how == "unsqueeze_":
        t.unsqueeze_(0)
    elif how == "resize_":
        st["exp_avg_sq"].resize_(2, 8)
    else:
        t.as_strided_((4, 4), (1, 4))  # transposed in place: same memory, other element order
    for p in m.params:
        p.grad = torch.randn(4, 4)
    before = [p.detach().clone() for p in m.params]
    if how == "as_strided_":
        # The full path updates the transposed state through a contiguous copy, element for element.
        m.refs[1][2] = t.detach().clone()  # the state as a tensor now reads: transposed
        for i, (p, ref) in enumerate(zip(m.params, m.refs)):
            ref[1] = p.grad.clone()
            ref[4] += 1
            reference_adam_(*ref[:4], AdamHyper(LR, 0.9, 0.999, 1e-8, WD, ref[4]))
        m.opt.step()
        assert torch.equal(m.params[1].detach(), m.refs[1][0])
        assert torch.equal(m.opt.state[m.params[1]]["exp_avg"], m.refs[1][2])
        return
    with pytest.raises(ValueError, match=r"\['params'\]\[1\].*optimizer state 'exp_avg(_sq)?' is"):
        m.opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(m.params, before))


def test_no_leak_warnings_at_exit_with_optimizer_in_backward():
    """PyTorch's optimizer-in-backward pattern: each param's post-accumulate-grad hook holds its
    optimizer, so the step plans are alive when the interpreter tears the extension down. nanobind
    printed "leaked N instances" there, at the exit of a correct program; the steps must also be
    the ordinary ones."""
    import subprocess
    import sys
    code = ("import torch, mps_fused_adam as mfa\n"
            "torch.manual_seed(0)\n"
            "a = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))\n"
            "b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)); b.load_state_dict(a.state_dict())\n"
            "opts = {p: mfa.AdamW([p], lr=1e-2) for p in a.parameters()}\n"
            "def hook(p):\n"
            "    opts[p].step(); opts[p].zero_grad()\n"
            "for p in a.parameters(): p.register_post_accumulate_grad_hook(hook)\n"
            "ob = mfa.AdamW(b.parameters(), lr=1e-2)\n"
            "for _ in range(3):\n"
            "    x = torch.randn(4, 8)\n"
            "    a(x).sum().backward()\n"
            "    b(x).sum().backward(); ob.step(); ob.zero_grad()\n"
            "print(all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "True"
    assert "leaked" not in proc.stderr, proc.stderr
