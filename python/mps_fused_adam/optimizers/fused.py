"""The optimizer classes: ``FusedAdam`` (DeepSpeed's signature), ``Adam``/``AdamW`` (torch's),
``CPUAdam`` (DeepSpeed's ``DeepSpeedCPUAdam``), ``Lion`` (lion_pytorch's), ``FusedLion``
(DeepSpeed's) and ``Adagrad`` (torch's), and the one base of every optimizer class of the package
(the 8-bit ones in eight_bit.py included), all over one step function.

A step gathers every group's tensors, validates all of them, and only then creates missing state
and hands one call per (device, param dtype, state format, state dtype, step count) to the backend
that runs that kernel. A class names its update rule, its state format policy (state_formats.py),
how a group's hyperparameters become the rule's contract object, and its signature; nothing else.
"""
from __future__ import annotations

import functools
import operator
import sys
from typing import Any, Callable, Iterable, Optional

import torch

from . import dtensor, in_backward, sr_seeds, state_formats, step_counts, step_plan, torch_args, validate
from .state_formats import SEED_KEY
from .step_entry import fast_step_entry
from .. import backends
from ..backends import SUPPORTED_DTYPES, Addressed, Kernel, backend_for, update_staged
from ..backends.versions import bump
from ..numerics.contract import AdagradHyper, AdamHyper, LionHyper
from ..numerics.lowbit import sr_key

_Params = Iterable[Any]


def _optimizer_method(name: str) -> Callable[..., Any]:
    """``torch.optim.Optimizer.<name>`` without its ``torch._disable_dynamo`` wrapper while
    ``torch._dynamo`` is not loaded: the wrapper's first call imports it, the largest part of the
    time to a first step. Once torch.compile has loaded it, the
    wrapped method is used, so compiled code never traces into these."""
    fn = getattr(torch.optim.Optimizer, name)
    return fn if "torch._dynamo" in sys.modules else getattr(fn, "__wrapped__", fn)


_CPU = torch.device("cpu")


def load_state_dict_with_hooks(opt: torch.optim.Optimizer, state_dict: dict[str, Any],
                               check: Callable[[dict[str, Any]], None],
                               retake: Callable[[dict[str, Any]], None]) -> None:
    """torch's ``load_state_dict`` with a check before it and a re-take of states after it, the
    load hooks where torch runs them: the pre-hooks first (they may replace the dict, which is
    then the one checked and loaded), the post-hooks once everything, the re-take included, is
    loaded; each once."""
    state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
    pre = getattr(opt, "_optimizer_load_state_dict_pre_hooks", None)
    post = getattr(opt, "_optimizer_load_state_dict_post_hooks", None)
    for hook in list((pre or {}).values()):
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    check(state_dict)
    # torch's own load, with its hook tables empty for the call: the pre-hooks ran above, and the
    # post-hooks must see the re-taken states.
    if pre is not None:
        opt._optimizer_load_state_dict_pre_hooks = type(pre)()
    if post is not None:
        opt._optimizer_load_state_dict_post_hooks = type(post)()
    try:
        _optimizer_method("load_state_dict")(opt, state_dict)
    finally:
        if pre is not None:
            opt._optimizer_load_state_dict_pre_hooks = pre
        if post is not None:
            opt._optimizer_load_state_dict_post_hooks = post
    retake(state_dict)
    for hook in list((post or {}).values()):
        hook(opt)


def _materialised(g: torch.Tensor) -> torch.Tensor:
    """A ZeroTensor grad (no memory: what autograd can hand a param that no output reached) as
    the dense zeros it stands for, which the kernels read."""
    return torch.zeros(g.shape, dtype=g.dtype, device=g.device)


@functools.lru_cache(maxsize=None)
def _one_format(rule: str) -> state_formats.OneFormat:
    return state_formats.OneFormat(rule)


class _FusedOptimizer(torch.optim.Optimizer):
    """The one base of every optimizer class. A subclass sets ``_rule`` and implements
    ``_check_group`` and ``_hyper`` (and ``_new_state`` when a state does not start at 0); its
    state format policy (``_policy``, state_formats.py) is by default the rule's states
    (``contract.RULES``) in one dtype. Every public class takes ``step_in_backward=True``: each
    param is then stepped from its post-accumulate-grad hook by ``_step_one`` (in_backward.py)."""

    # The update rule (contract.RULES) every step of this class runs.
    _rule = "adam"
    # What a state dict this class loads looks like (load_state_dict rejects any other).
    _state_dict_kind = validate.ADAM_STATE_DICT
    # A subclass restricted to one device type (CPUAdam) sets this.
    _device_type: Optional[str] = None

    @property
    def _policy(self) -> Any:
        """How each param's state is kept (state_formats.py): the rule's states in one dtype."""
        return _one_format(self._rule)

    def _check_added_group(self, group: dict[str, Any], where: str) -> None:
        """Options checked when a group is added (the 8-bit classes' ``min_8bit_size``)."""

    def __init__(self, params: _Params, defaults: dict[str, Any], step_in_backward: bool = False) -> None:
        self._check_group(defaults, "")
        self._group_defaults = dict(defaults)  # what __setstate__ fills groups from (not torch's additions)
        in_backward.setup(self, step_in_backward)  # before torch's __init__ adds (and so hooks) the groups
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        """Raise ValueError for hyperparameters the rule cannot take (torch's messages)."""
        raise NotImplementedError

    def _hyper(self, group: dict[str, Any], step: int) -> Any:
        """The rule's contract object (contract.py) for ``group`` at step ``step``."""
        raise NotImplementedError

    def _new_state(self, p: torch.Tensor, name: str, dtype: torch.dtype, group: dict[str, Any]) -> torch.Tensor:
        return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group`` (also used by the constructor), then a dtype check of the new
        group's parameters: a rejected group is removed again, so the optimizer is unchanged."""
        _optimizer_method("add_param_group")(self, param_group)
        gi = len(self.param_groups) - 1
        try:
            self._check_added_group(self.param_groups[gi], f"param_groups[{gi}]")
            validate.check_group_param_dtypes(self.param_groups[gi], gi)
            in_backward.group_added(self, gi, self._device_type)
        except Exception:
            self.param_groups.pop()
            raise

    def zero_grad(self, set_to_none: bool = True) -> None:
        _optimizer_method("zero_grad")(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, each ``step`` as torch's 0-dim tensor (the live count stays an int:
        step_counts.py says why)."""
        return step_counts.state_dict(self, _optimizer_method("state_dict"))

    # Group keys of ours that torch.optim's state dicts lack (load_state_dict keeps the live values).
    _kept_group_keys: tuple[str, ...] = ("bf16_stochastic_round",)

    # The dtype the moment estimates are kept in: a fixed one, or (None) the param's, as torch does.
    _fixed_state_dtype: Optional[torch.dtype] = None

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self._fixed_state_dtype or p.dtype

    # Constructor options kept as attributes (DeepSpeed's and lion_pytorch's signatures), which
    # torch's Optimizer.__getstate__ leaves out: carried through pickling and copy.deepcopy here.
    _config_attributes: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["mps_fused_adam_config"] = {k: getattr(self, k) for k in self._config_attributes}
        state["mps_fused_adam_config"]["_group_defaults"] = self.__dict__.get("_group_defaults")
        # The stochastic-rounding base seed (sr_seeds.py): a copy's params first stepped later get
        # the seeds the original's would.
        state["mps_fused_adam_config"]["_sr_base_seed"] = self.__dict__.get("_sr_base_seed")
        return in_backward.getstate(self, state)

    def __setstate__(self, state: dict[str, Any]) -> None:
        config = state.pop("mps_fused_adam_config", None)
        hooked = in_backward.take_state(state)
        # Our own defaults as the constructor made them, not with the key torch's __setstate__ adds
        # to them ('differentiable'): only these are group keys of ours, so a round trip or a deep
        # copy leaves the groups' keys as they were. (A pickle made before they were kept: its
        # defaults, as they were saved.)
        ours = (self.__dict__.get("_group_defaults") or (config or {}).get("_group_defaults")
                or dict(state.get("defaults", {})))
        super().__setstate__(state)
        self.__dict__.pop("_one_plans", None)  # torch's load_state_dict comes here: the old states go
        self._group_defaults = ours
        if config is not None:
            self.__dict__.update(config)
        for group in self.param_groups:
            self._adopt_group_keys(group)
            # A state dict from torch.optim lacks our group keys: take them from our defaults.
            for key, value in ours.items():
                group.setdefault(key, value)
        in_backward.restore(self, hooked)

    def _adopt_group_keys(self, group: dict[str, Any]) -> None:
        """A loaded group of the optimizer we stand in for may say under its own name what ours
        says under another (torch's ``decoupled_weight_decay``, ours ``adam_w_mode``)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of ours or of the optimizer we stand in for (``torch.optim.Adam``/
        ``AdamW``/``Adagrad``, ``lion_pytorch.Lion``).

        torch casts loaded states to the parameter's dtype; we re-take them from the saved
        tensors in this optimizer's state dtype (fp32 states of bf16 params stay exact), and keep
        ``step`` as a Python int, whether saved as torch's tensor or as an int (earlier versions). A state dict of another optimizer (SGD's, say) or with moments
        of the wrong shape is rejected before anything is loaded. As in torch, the load pre-hooks
        (``register_load_state_dict_pre_hook``) see the dict first and may replace it, and the
        post-hooks run after everything is loaded.
        """
        policy = self._policy
        kind = policy.kind or self._state_dict_kind
        # Our own group keys that the saved groups lack (a torch.optim checkpoint's) keep the live
        # groups' values, not the constructor's: a group's own min_4bit_size or stochastic rounding
        # survives loading torch's state dict.
        kept = [{k: g[k] for k in self._kept_group_keys if k in g} for g in self.param_groups]

        def retake(sd: dict[str, Any]) -> None:
            for saved, group, live in zip(sd["param_groups"], self.param_groups, kept):
                group.update({k: v for k, v in live.items() if k not in saved})
            self._retake_states(sd)
            sr_seeds.recover_base_seed(self, SEED_KEY)
        load_state_dict_with_hooks(
            self, state_dict, lambda sd: validate.check_state_dict(sd, self.param_groups, kind, policy.check_saved),
            retake)

    def _retake_states(self, state_dict: dict[str, Any]) -> None:
        saved_state = state_dict["state"]
        policy = self._policy
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for key, p in zip(saved_group["params"], group["params"]):
                saved = saved_state.get(key)
                if saved is None:
                    continue
                st = self.state[p]
                policy.of_state(saved).retake(self, p, saved, st)
                for name in ("step", SEED_KEY):
                    if name in saved:
                        st[name] = int(saved[name])

    def _slots(self, gi: int, params: list) -> list:
        """Each group's states as a list aligned with its params, so a step looks states up by
        position instead of hashing 1,000 tensors (torch's Tensor.__hash__ runs in Python).
        Kept while the group holds the same param objects in the same places and ``self.state``
        the same per-param dicts (``_cpu.DictSnapshot``: a replaced or removed dict shows); a dict
        emptied in place reads as no state (``_plan_group``), as torch's optimizers take it."""
        cache = self.__dict__.setdefault("_slot_cache", {})
        entry = cache.get(gi)
        state = self.state
        if (entry is None or entry[0] is not params or len(entry[1]) != len(params)
                or not all(map(operator.is_, entry[1], params)) or not entry[2].unchanged(state)):
            native = step_plan.native()
            snapshot = native.DictSnapshot(state) if native is not None else None
            slots = [state[p] if state.get(p) else None for p in params]
            if snapshot is None:
                return slots  # no extension: nothing to prove the cache with, so no cache
            entry = cache[gi] = (params, tuple(params), snapshot, slots)
        return entry[3]

    @fast_step_entry
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        return self._step(closure)

    @torch.no_grad()
    def _step(self, closure: Optional[Callable[[], Any]]) -> Any:
        # The step itself; `step` is its entry (torch's hooks and profiler range: step_entry.py),
        # which subclasses that take more arguments (FusedAdam, FusedLion) replace.
        in_backward.refuse_closure(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every group is validated and sorted into kernel calls before anything is written (no
        # state created, no step counted) until the whole step is known good. A group whose cached
        # plan still holds (step_plan.py) is checked in C++; any other takes the full path.
        plans = self._step_plans()
        work = []
        kernels: dict[torch.device, set] = {}
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, f"param_groups[{gi}]")
            plan = plans.get(gi)
            fast = step_plan.check(plan, group["params"]) if isinstance(plan, step_plan.Plan) else None
            if fast is not None and group.get("bf16_stochastic_round"):
                fast = _with_sr_seeds(fast)
            if fast is not None:
                work.append((gi, group, plan, fast))
            else:
                planned = self._plan_full(gi, group)
                _kernels_of(self, planned[0], kernels)
                work.append((gi, group, plan, planned))
        if kernels:  # a plan's kernels were prepared by the full step it was made after
            backends.prepare(kernels)
        replan = []
        for gi, group, plan, planned in work:
            if isinstance(planned, list):
                self._step_planned(group, plan, planned)
                continue
            first, later = planned
            self._step_full(group, *first[1:])
            for sub in later:  # a param's further appearances in the group, one round each (same kernels)
                self._step_full(group, *self._plan_group(gi, sub, [self.state.get(p) or None for p in sub["params"]])[1:])
            if later:
                plans.pop(gi, None)  # a plan's one kernel call per bucket would update such a param from two threads
            else:
                replan.append((gi, group, plan))
        if replan:
            self._replan(plans, replan)
        return loss

    def _step_one(self, gi: int, group: dict[str, Any], pi: int, p: torch.Tensor) -> None:
        """Step ``group["params"][pi]`` alone (``step_in_backward``'s hook, in_backward.py).

        The first time, and whenever anything changed: the full path's validation, state creation
        and kernel, over a group of this one param, after which the param gets a plan of its own
        (step_plan.py, as a group gets in ``step()``). Later hooks prove that plan in C++ and run the
        same kernel call: the full path's Python was what made a small model's in-backward step
        slower than the grouped one (docs/memory.md)."""
        self._check_group(group, f"param_groups[{gi}]")
        plans = self.__dict__.setdefault("_one_plans", {})
        entry = plans.get(id(p))
        if entry is not None:
            plan, state, st, state_dtype = entry
            # The plan holds p, so id(p) is still p's; self.state replaced (load_state_dict) or p's
            # state dict replaced: the full path. An emptied or edited state dict fails the check.
            if (plan.params[0] is p and state is self.state and state_dtype == self._fixed_state_dtype
                    and self.state.get(p) is st):
                planned = step_plan.check(plan, plan.params)
                if planned is not None and group.get("bf16_stochastic_round"):
                    planned = _with_sr_seeds(planned)
                if planned is not None:
                    self._step_planned(group, plan, planned)
                    return
        one = self._subgroup(group, gi, [pi])
        full = self._plan_group(gi, one, [self.state.get(p) or None])
        kernels: dict[torch.device, set] = {}
        _kernels_of(self, full, kernels)
        backends.prepare(kernels)
        self._step_full(*full)
        native = step_plan.native()
        plan = step_plan.build(native, one["params"], self.state, self._policy) if native is not None else None
        if plan is not None and plan.buckets:
            plans[id(p)] = (plan, self.state, self.state.get(p), self._fixed_state_dtype)
        else:
            plans.pop(id(p), None)

    def _subgroup(self, group: dict[str, Any], gi: int, indices: list[int]) -> dict[str, Any]:
        """``group`` with only the params at ``indices``, each keeping the name errors give it."""
        sub = dict(group)
        sub["params"] = [group["params"][i] for i in indices]
        sub["param_names"] = [self._param_name(group, gi, i) for i in indices]
        return sub

    def _plan_full(self, gi: int, group: dict[str, Any]) -> tuple[tuple, list]:
        """``_plan_group`` of a group, and the sub-groups to step after it when the group holds a
        param more than once. torch's optimizers warn about such a group (in ``add_param_group``)
        and update the param once per appearance, one update after the other; here the group's
        first appearances are stepped first, then each further round of appearances (a step
        count each), so no kernel call holds a tensor twice (which would race)."""
        rounds = validate.appearance_rounds(group["params"])
        if rounds is None:
            return self._plan_group(gi, group), []
        subs = [self._subgroup(group, gi, indices) for indices in rounds]
        first = subs[0]
        return self._plan_group(gi, first, [self.state.get(p) or None for p in first["params"]]), subs[1:]

    def _step_planned(self, group: dict[str, Any], plan: step_plan.Plan, planned: list) -> None:
        plan.uses += 1
        for bucket, grads, seeds in planned:
            step = bucket.step + 1
            plan.native.set_steps(bucket.begin, bucket.end, step)
            bucket.step = step
            hp = self._hyper(group, step)
            # The plan holds only contiguous tensors and checked that each grad is: no staging.
            if seeds is None:
                backend_for(bucket.device, bucket.kernel).update(bucket.fmt.rule, bucket.params, grads,
                                                                 bucket.states, hp)
            else:
                rule = bucket.fmt.sr_rule
                backend_for(bucket.device, bucket.kernel._replace(rule=rule)).update(
                    rule, bucket.params, grads, bucket.states, hp, sr_keys=[sr_key(seed, step) for seed in seeds])
            bump(bucket.params)

    def _step_full(self, group: dict[str, Any], fresh: list, buckets: dict) -> None:
        # A bucket (_plan_group): params (a DTensor's local shard), grads, one list per state, the
        # state dicts, and the params as the group holds them (whose version counters autograd reads).
        for p, pi, slots, fmt in fresh:
            st = slots[pi] = self.state[p]
            st["step"] = 0
            st.update(fmt.new(self, p, group))
            key = (p.device, p.dtype, fmt, fmt.state_dtype(self, p), 0)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = tuple([] for _ in range(len(fmt.names) + 4))
            # A DTensor param's new states are DTensors like it (zeros_like): its shards are stepped.
            g = p.grad
            tensors = (p, _materialised(g) if g._is_zerotensor() else g, *(st[name] for name in fmt.names))
            for lst, t in zip(bucket, tensors):
                t = dtensor.local(t)
                lst.append(t)
                if type(lst) is Addressed:  # a bucket of loaded states at step 0 (_gather_addresses)
                    lst.addresses.append(t.data_ptr())
            bucket[-2].append(st)
            bucket[-1].append(p)
        sr = bool(group.get("bf16_stochastic_round"))
        for (device, pdtype, fmt, sd, last_step), bucket in buckets.items():
            step = int(last_step) + 1
            for st in bucket[-2]:
                st["step"] = step
            keys, rule = None, fmt.rule
            if sr and pdtype is torch.bfloat16:
                rule = fmt.sr_rule
                # Stochastic rounding (only the Adam rule has the option): each param's own 64-bit
                # seed (sr_seeds.py: independent of the order params are stepped in), drawn on its
                # first such step, and this step's key of it.
                keys = []
                for p, st in zip(bucket[0], bucket[-2]):
                    if SEED_KEY not in st:
                        st[SEED_KEY] = sr_seeds.param_seed(self, p)
                    keys.append(sr_key(int(st[SEED_KEY]), step))
            update_staged(backend_for(device, Kernel(rule, pdtype, sd)), rule, bucket[0], bucket[1],
                          list(bucket[2:-2]), self._hyper(group, step), keys)
            bump(bucket[-1])

    def _step_plans(self) -> dict[int, Any]:
        """The groups' cached plans, or none when the optimizer's state dict has changed since they
        were made (or the state dtype policy has: CPUAdam's ``fp32_optimizer_states``)."""
        plans = self.__dict__.setdefault("_plans", {})
        snapshot = self.__dict__.get("_plans_snapshot")
        if plans and (snapshot is None or self.__dict__.get("_plans_state_dtype") != self._fixed_state_dtype
                      or not snapshot.unchanged(self.state)):
            plans.clear()
        for gi in [gi for gi in plans if gi >= len(self.param_groups)]:
            del plans[gi]  # a removed group's plan would keep its tensors alive
        return plans

    def _replan(self, plans: dict[int, Any], groups: list) -> None:
        """Plan the groups that just took the full path, for the next step."""
        native = step_plan.native()
        if native is None:
            return
        for gi, group, previous in groups:
            plans[gi] = step_plan.replan(native, previous, group["params"], self.state, self._policy)
        self._plans_snapshot = native.DictSnapshot(self.state)
        self._plans_state_dtype = self._fixed_state_dtype

    @staticmethod
    def _param_name(group: dict[str, Any], gi: int, pi: int) -> str:
        """How errors name a param: its name where the optimizer was given named parameters."""
        pnames = group.get("param_names")
        return pnames[pi] if pnames else f"param_groups[{gi}]['params'][{pi}]"

    def _plan_group(self, gi: int, group: dict[str, Any], slots: Optional[list] = None
                    ) -> tuple[dict[str, Any], list, dict]:
        """Validate one group; return it, its params that need new state, and its kernel calls
        keyed by (device, param dtype, state dtype, step count so far). ``slots``: the params'
        states, when not the group's cached ones (``_step_one``)."""
        params = group["params"]
        slots = self._slots(gi, params) if slots is None else slots
        supported, strided, only = SUPPORTED_DTYPES, torch.strided, self._device_type
        policy = self._policy
        single = policy.only  # the one format of every param's state, or None: the policy's per state
        fresh: list = []
        buckets: dict[tuple, tuple] = {}
        fixed_sd = self._fixed_state_dtype
        cpu = _CPU
        # FSDP2 / tensor-parallel params: their local shards are stepped (dtensor.py). Without
        # torch.distributed.tensor loaded there is no DTensor to look for. It is loaded with
        # torch._dynamo (any torch.compile), so plain tensors are told apart by their exact type
        # first: isinstance against DTensor made this loop markedly slower for plain params
        # (docs/benchmarks.md, "Figures behind the code").
        dt_cls = dtensor.dtensor_type()
        plain_t, plain_p = torch.Tensor, torch.nn.Parameter
        sr_group = bool(group.get("bf16_stochastic_round"))
        for pi, p in enumerate(params):
            g = p.grad
            if g is None:
                continue
            st = slots[pi] or None  # a state dict emptied since: fresh state, as torch takes it
            fmt = None if st is None else single or policy.of_state(st)
            dt = p.dtype
            shape = p.shape
            on_cpu = p.is_cpu
            # The common case is this one expression per tensor (and per state); any failure (an
            # AttributeError included: a state entry that is not a tensor) re-runs the detailed
            # checks, which raise naming the parameter.
            try:
                ok = (dt in supported and g.dtype is dt and g.layout is strided and g.shape == shape
                      and not g._is_zerotensor())
                if st is None:
                    if p.numel() == 0:
                        continue
                    states = None
                    ok = ok and (g.is_cpu if on_cpu else g.device == p.device)
                else:
                    states = [st.get(name) for name in fmt.names]
                    ok = ok and (g.is_cpu if on_cpu else g.device == p.device)
                    if fmt.plain:
                        sd = fmt.dtype or fixed_sd or dt
                        for t in states:
                            ok = (ok and type(t) is plain_t and t.dtype is sd and t.shape == shape
                                  and (t.is_cpu if on_cpu else t.device == p.device))
                    else:
                        ok = ok and fmt.fits(p, states, on_cpu, st)
                    taken = st.get("step", 0)
                    ok = ok and type(taken) is int and taken >= 0
                if ok and only is not None:
                    ok = p.device.type == only
            except AttributeError:
                ok = False
            if not ok:
                validate.check_param(p, g, self._param_name(group, gi, pi), only)
                if st is not None:
                    fmt.check(self, p, st, self._param_name(group, gi, pi))
                if g._is_zerotensor():
                    g = _materialised(g)  # torch steps a ZeroTensor grad as the zeros it stands for
            # With ok, every state is exactly a torch.Tensor (checked above): no DTensor among them.
            if dt_cls is not None and (not ok or type(g) is not plain_t
                                       or (type(p) is not plain_p and type(p) is not plain_t)) and (
                    isinstance(p, dt_cls) or isinstance(g, dt_cls)
                    or any(isinstance(t, dt_cls) for t in states or ())):
                if isinstance(p, dt_cls):
                    name = self._param_name(group, gi, pi)
                    if getattr(policy, "refuses_dtensor", False):
                        # Blocks over each rank's shard would quantize other blocks than over the
                        # whole tensor, and codes and scales are no DTensors to checkpoint.
                        raise ValueError(f"{name}: {type(self).__name__} does not step DTensor params (FSDP2, "
                                         f"tensor parallel); AdamW, Adam, Lion and Adagrad do")
                    if sr_group and dt is torch.bfloat16:
                        # The random bits are drawn per element index of the tensor stepped, here the
                        # local shard, and the seed from each rank's RNG: replicas of a Replicate
                        # param would drift apart, and shards would not round as the whole does.
                        raise ValueError(f"{name}: bf16_stochastic_round=True does not step bf16 DTensor params "
                                         f"(FSDP2, tensor parallel); keep fp32 params or leave the option off")
                    dtensor.check_like_param(p, g, name, "grad")
                    for state_name, t in zip(fmt.names if st is not None else (), states or ()):
                        dtensor.check_like_param(p, t, name, f"state {state_name!r}")
                    if st is not None:
                        p, g, states = p.to_local(), g.to_local(), [t.to_local() for t in states]
                else:
                    dtensor.check_plain(p, g, states or (), self._param_name(group, gi, pi),
                                        fmt.names if st is not None else ())
            if st is None:
                if group.get("fused"):
                    torch_args.check_fused_param(p)
                fresh.append((p, pi, slots, single or policy.for_new(p, group)))
                continue
            key = (cpu if on_cpu else p.device, dt, fmt, states[0].dtype, st.get("step", 0))
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = tuple([] for _ in range(len(states) + 4))  # see _step_full
            bucket[0].append(p)
            bucket[1].append(g)
            for k, t in enumerate(states):
                bucket[2 + k].append(t)
            bucket[-2].append(st)
            bucket[-1].append(params[pi])
        _gather_addresses(buckets, fresh, lambda p: self._param_name(group, gi, _index(params, p)))
        return group, fresh, buckets


def _index(params: list, p: torch.Tensor) -> int:
    return next(i for i, q in enumerate(params) if q is p)


def _gather_addresses(buckets: dict, fresh: list, name_of: Callable[[torch.Tensor], str]) -> None:
    """Before anything of the step is written: every tensor's address, which a backend reads anyway
    (each bucket's tensor lists become ``Addressed``), so that a tensor whose storage was freed
    (``untyped_storage().resize_(0)``: elements, no memory) is refused naming its param here, not
    by the kernel after other tensors and the step counts were written."""
    for key, bucket in buckets.items():
        what = ("the param", "its grad", *(f"its state {n!r}" for n in key[2].names))  # key[2]: the format
        lists = list(bucket)
        for k in range(len(lists) - 2):  # the tensor lists; then the state dicts and the params
            lst = lists[k] = Addressed(lists[k])
            lst.addresses = [t.data_ptr() for t in lst]
            lst.numels = None
            if 0 in lst.addresses:
                for i, (t, a) in enumerate(zip(lst, lst.addresses)):
                    if a == 0:
                        validate.check_memory(bucket[-1][i], name_of(bucket[-1][i]), t, what[k])
        buckets[key] = tuple(lists)
    for p, *_ in fresh:
        for what, t in (("the param", p), ("its grad", p.grad)):
            t = dtensor.local(t)
            if not t.data_ptr():
                validate.check_memory(p, name_of(p), t, what)


class _AdamBase(_FusedOptimizer):
    """The Adam rule. Group keys: lr, betas, eps, weight_decay, bias_correction, maximize, and the
    weight-decay mode under the name of the optimizer a class stands in for (``_mode_key``)."""

    # torch.optim.Adam/AdamW: decoupled_weight_decay; DeepSpeed's FusedAdam/DeepSpeedCPUAdam: adam_w_mode.
    _mode_key = "adam_w_mode"
    _MODE_KEYS = ("adam_w_mode", "decoupled_weight_decay")
    # AdamW's classes: torch's AdamW.__setstate__ (which its load_state_dict runs) sets decoupled
    # decay on every group, so a state dict saved by Adam (L2 decay) loads as decoupled decay.
    _always_decoupled = False

    def _adopt_group_keys(self, group: dict[str, Any]) -> None:
        if self._always_decoupled:
            group[self._mode_key] = True
        elif self._mode_key not in group:
            for other in self._MODE_KEYS:
                if other in group:
                    group[self._mode_key] = bool(group[other])
                    break

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        validate.check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"], where=where)

    def _hyper(self, group: dict[str, Any], step: int) -> AdamHyper:
        beta1, beta2 = group["betas"]
        return AdamHyper(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                         weight_decay=float(group["weight_decay"]), step=step,
                         adam_w_mode=bool(group[self._mode_key]), bias_correction=bool(group.get("bias_correction", True)),
                         maximize=bool(group["maximize"]))


def _with_sr_seeds(planned: list) -> Optional[list]:
    """A planned step of a stochastic-rounding group: each bf16 bucket with its params' seeds
    (their keys follow from the step), or None where one lacks its seed (the full path draws it)."""
    out = []
    for bucket, grads, _ in planned:
        seeds = None
        if bucket.kernel.param_dtype is torch.bfloat16:
            seeds = [st.get(SEED_KEY) for st in bucket.sts]
            if not all(type(seed) is int for seed in seeds):
                return None
        out.append((bucket, grads, seeds))
    return out


def _kernels_of(opt: _FusedOptimizer, planned: tuple, kernels: dict) -> None:
    """Add the kernels of a group's full step (``_plan_group``'s result) to ``kernels`` by device."""
    group, fresh, buckets = planned
    sr = bool(group.get("bf16_stochastic_round"))

    def rule(fmt: Any, pdtype: torch.dtype) -> str:
        return fmt.sr_rule if sr and pdtype is torch.bfloat16 else fmt.rule
    for device, pdtype, fmt, sd, _ in buckets:
        kernels.setdefault(device, set()).add(Kernel(rule(fmt, pdtype), pdtype, sd))
    for p, _, _, fmt in fresh:
        kernels.setdefault(p.device, set()).add(Kernel(rule(fmt, p.dtype), p.dtype, fmt.state_dtype(opt, p)))


def _check_unsupported(group: dict[str, Any], cls: str, algorithm: str, options: tuple[str, ...]) -> None:
    """A group (the constructor's defaults, an added or a loaded group) that turns on an option of
    torch's class this package does not implement is refused, not silently stepped without it."""
    for option in options:
        if group.get(option):
            _reject(option, group[option], cls, algorithm)


def _reject(option: str, value: Any, cls: str, algorithm: str) -> None:
    """An option of torch's class ``cls`` that this package's ``cls`` (which runs ``algorithm``) does not implement."""
    raise ValueError(f"{cls} does not support {option}={value!r}; mps_fused_adam implements plain {algorithm} "
                     f"(use torch.optim.{cls} for {option})")


class Adam(_AdamBase):
    """Drop-in for ``torch.optim.Adam``: same arguments and defaults, L2 weight decay unless
    ``decoupled_weight_decay=True``. ``foreach`` and ``fused`` are accepted and ignored (this is
    always fused); ``amsgrad``, ``capturable`` and ``differentiable`` are rejected.

    ``bf16_stochastic_round=True``: bf16 parameters are stored from the fp32 update by stochastic
    rounding (unbiased; random bits from a hash of the param's ``sr_seed`` state, the step and the
    element index: reproducible under ``torch.manual_seed``); other dtypes are unaffected."""

    _name = "Adam"
    _mode_key = "decoupled_weight_decay"  # torch's group key, so state dicts carry the mode both ways

    def __init__(self, params: _Params, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, *, foreach: Optional[bool] = None, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
                 decoupled_weight_decay: bool = False, bf16_stochastic_round: bool = False,
                 step_in_backward: bool = False) -> None:
        betas = torch_args.check_adam_args(lr, betas, eps, weight_decay, foreach, capturable)
        torch_args.check_fused_flags(fused, foreach, differentiable)  # before our refusal of differentiable
        # torch's group keys and only those, kept as given (foreach and fused change nothing here),
        # so that state dicts have torch's structure both ways (torch.distributed.checkpoint refuses
        # to load a checkpoint that lacks a key of the target's). bias_correction is always on here
        # (_hyper's default); bf16_stochastic_round is a key only where it is on.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=bool(decoupled_weight_decay))
        if bf16_stochastic_round:
            defaults["bf16_stochastic_round"] = True
        super().__init__(params, defaults, step_in_backward)

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        super()._check_group(group, where)
        _check_unsupported(group, self._name, "Adam", ("amsgrad", "capturable", "differentiable"))


class AdamW(Adam):
    """Drop-in for ``torch.optim.AdamW`` (decoupled weight decay, default 1e-2)."""

    _name = "AdamW"
    _always_decoupled = True

    def __init__(self, params: _Params, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False, foreach: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
                 bf16_stochastic_round: bool = False, step_in_backward: bool = False) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, bf16_stochastic_round=bf16_stochastic_round,
                         step_in_backward=step_in_backward)


class FusedAdam(_AdamBase):
    """DeepSpeed's ``FusedAdam`` signature, on any device: Metal on MPS, the C++ kernel on CPU,
    torch's fused kernel or the fp32 foreach tier elsewhere. States are kept in the param dtype.
    ``bf16_stochastic_round=True`` as for :class:`Adam`."""

    def __init__(self, params: _Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 bf16_stochastic_round: bool = False, *, step_in_backward: bool = False) -> None:
        if amsgrad:
            raise ValueError("FusedAdam does not support the AMSGrad variant (amsgrad=True)")
        self.set_grad_none = set_grad_none
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      adam_w_mode=adam_w_mode, bias_correction=bias_correction, maximize=False,
                                      bf16_stochastic_round=bool(bf16_stochastic_round)), step_in_backward)

    _config_attributes = ("set_grad_none",)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """DeepSpeed's ``zero_grad()``: grads set to None whatever ``set_grad_none`` says (with
        ``set_grad_none=False`` DeepSpeed 0.19.8 falls back to torch's ``zero_grad()``, whose default
        also sets them to None). ``set_to_none=False`` fills them with zeros, as torch's does."""
        super().zero_grad(True if set_to_none is None else set_to_none)

    @fast_step_entry
    def step(self, closure: Optional[Callable[[], Any]] = None, grads: Any = None, output_params: Any = None,
             scale: Any = None, grad_norms: Any = None, grad_scaler: Any = None) -> Any:
        """One step. DeepSpeed's legacy arguments (``grads``, ``output_params``, ``scale``,
        ``grad_norms``) are rejected and ``grad_scaler`` is ignored, as DeepSpeed's FusedAdam does."""
        if any(a is not None for a in (grads, output_params, scale, grad_norms)):
            raise RuntimeError("FusedAdam has been updated; simply initialize it identically to torch.optim.Adam "
                               "and call step() with no arguments except an optional closure")
        return self._step(closure)


class CPUAdam(_AdamBase):
    """DeepSpeed's ``DeepSpeedCPUAdam`` signature on the prebuilt C++ kernel: CPU tensors only.

    With ``fp32_optimizer_states=True`` (default) the moments are fp32 whatever the param dtype;
    otherwise they are kept in the param dtype.
    """

    _device_type = "cpu"
    _config_attributes = ("fp32_optimizer_states",)

    def __init__(self, model_params: _Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True, *,
                 step_in_backward: bool = False) -> None:
        if amsgrad:
            raise ValueError("CPUAdam does not support the AMSGrad variant (amsgrad=True)")
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                            adam_w_mode=adamw_mode, bias_correction=bias_correction, maximize=False),
                         step_in_backward)

    @property
    def _fixed_state_dtype(self) -> Optional[torch.dtype]:  # type: ignore[override]
        return torch.float32 if self.fp32_optimizer_states else None


class Lion(_FusedOptimizer):
    """Drop-in for ``lion_pytorch.Lion`` (same arguments and defaults; state ``exp_avg`` in the
    param's dtype, so state dicts move between the two). Contract: ``contract.py``, Lion section.

    ``decoupled_weight_decay=True`` divides the weight decay by the initial learning rate, as
    lion_pytorch does; ``use_triton`` is an implementation switch, accepted and ignored.
    """

    _rule = "lion"
    # lion_pytorch's Lion keeps no step count (nor does its rule use one).
    _state_dict_kind = validate.StateDictKind("Lion", ("betas",), ("eps", "lr_decay"), ("exp_avg",), has_steps=False)
    _config_attributes = ("_init_lr", "decoupled_wd")

    def __init__(self, params: _Params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, use_triton: bool = False, decoupled_weight_decay: bool = False, *,
                 step_in_backward: bool = False) -> None:
        # Checked before float(lr) below, so a 2-element Tensor lr gets torch's message.
        validate.check_lion_hyperparameters(lr, betas, weight_decay)
        if decoupled_weight_decay and not float(lr) > 0:
            raise ValueError(f"decoupled_weight_decay=True divides the weight decay by the initial learning rate, "
                             f"which must be > 0; got lr={float(lr)}")
        self._init_lr = float(lr)
        self.decoupled_wd = bool(decoupled_weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), step_in_backward)

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        validate.check_lion_hyperparameters(group["lr"], group["betas"], group["weight_decay"], where=where)

    def _hyper(self, group: dict[str, Any], step: int) -> LionHyper:
        beta1, beta2 = group["betas"]
        wd = float(group["weight_decay"])
        if self.decoupled_wd:
            wd /= self._init_lr
        return LionHyper(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), weight_decay=wd)


class FusedLion(Lion):
    """DeepSpeed's ``FusedLion`` signature (its defaults, ``set_grad_none``), on any device."""

    _config_attributes = Lion._config_attributes + ("set_grad_none",)

    def __init__(self, params: _Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True, *, step_in_backward: bool = False) -> None:
        self.set_grad_none = set_grad_none
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay, step_in_backward=step_in_backward)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """As :meth:`FusedAdam.zero_grad` (DeepSpeed's ``FusedLion`` has the same one)."""
        super().zero_grad(True if set_to_none is None else set_to_none)

    @fast_step_entry
    def step(self, closure: Optional[Callable[[], Any]] = None, grads: Any = None, output_params: Any = None,
             scale: Any = None, grad_norms: Any = None, grad_scaler: Any = None) -> Any:
        """One step. DeepSpeed's legacy arguments are rejected, as DeepSpeed's FusedLion does."""
        if any(a is not None for a in (grads, output_params, scale, grad_norms)):
            raise RuntimeError("FusedLion has been updated; call step() with no arguments except an optional closure")
        return self._step(closure)


class Adagrad(_FusedOptimizer):
    """Drop-in for ``torch.optim.Adagrad``: same arguments and defaults, state ``sum`` in the
    param's dtype, created when the optimizer is (as torch does), so state dicts move between the
    two. ``foreach`` and ``fused`` are accepted and ignored (this is always fused);
    ``differentiable=True`` is rejected; sparse gradients are rejected. ``maximize`` and
    ``initial_accumulator_value`` are supported (a group's own value applies to its params).
    Contract: ``contract.py``, Adagrad section.
    """

    _rule = "adagrad"
    _state_dict_kind = validate.StateDictKind("Adagrad", ("lr_decay", "eps"), ("betas",), ("sum",))

    def __init__(self, params: _Params, lr: float | torch.Tensor = 1e-2, lr_decay: float = 0,
                 weight_decay: float = 0, initial_accumulator_value: float = 0, eps: float = 1e-10,
                 foreach: Optional[bool] = None, *, maximize: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, step_in_backward: bool = False) -> None:
        torch_args.check_adagrad_args(lr, lr_decay, weight_decay, initial_accumulator_value, eps)
        torch_args.check_fused_flags(fused, foreach, differentiable)  # before our refusal of differentiable
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, foreach=foreach,
                                      maximize=maximize, differentiable=differentiable, fused=fused),
                         step_in_backward)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["step"] = 0
                st["sum"] = self._new_state(p, "sum", self._state_dtype(p), group)

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        validate.check_adagrad_hyperparameters(group["lr"], group["lr_decay"], group["weight_decay"],
                                               group["initial_accumulator_value"], group["eps"], where=where)
        _check_unsupported(group, "Adagrad", "Adagrad", ("differentiable",))
        if group.get("fused") and self.__dict__.get("_need_device_dtype_check_for_fused", True):
            # torch's fused Adagrad checks its params at its first step (the states exist from
            # the constructor on, so the check of new states that Adam's makes would never run).
            for p in group.get("params", ()):
                if p.grad is not None:
                    torch_args.check_fused_param(p)
            if "params" in group:
                self._need_device_dtype_check_for_fused = False

    def _new_state(self, p: torch.Tensor, name: str, dtype: torch.dtype, group: dict[str, Any]) -> torch.Tensor:
        return torch.full_like(p, float(group["initial_accumulator_value"]), dtype=dtype,
                               memory_format=torch.preserve_format)

    def _hyper(self, group: dict[str, Any], step: int) -> AdagradHyper:
        return AdagradHyper(lr=float(group["lr"]), eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                            step=step, lr_decay=float(group["lr_decay"]), maximize=bool(group["maximize"]))
