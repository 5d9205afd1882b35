"""One entry per public optimizer class: what the generic tests need to know about it.

The tests that once listed the classes by hand read this table instead (test_step_entry,
test_optim's deep-copy cases, test_dtensor and dtensor_worker, test_rules_contract's counterparts,
test_torch_compat's refused options), and ``test_every_public_class_has_an_entry`` fails when a
public class (``mps_fused_adam.__all__``) has none, as PyTorch's ``optim_db`` drives its generic
optimizer tests. Test-only facts live here, not in the package.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

import mps_fused_adam as mfa


@dataclass(frozen=True)
class OptimInfo:
    """One public class.

    - ``kwargs``: constructor arguments of the generic tests (test_step_entry: a small lr, 8-bit
      states on small params);
    - ``rule``: its update rule (``contract.RULES``); ``example_kwargs``: for the class that gives a
      rule's example (``contract.Example.optimizer``), the arguments that give ``Example.hyper``;
    - ``counterpart``: the independent implementation it stands in for (dotted name);
      ``rule_check``: for a rule's example class, ``(module, test)`` checking the rule's reference
      against that counterpart;
    - ``refused``: options of the torch class it mirrors that it refuses (not silently ignores);
    - ``kept``: constructor arguments it keeps as attributes (deep copy and pickling must keep them);
    - ``dtensor``: labelled constructor arguments the DTensor worker steps sharded (empty: DTensor
      params refused); capabilities ``eight_bit``, ``four_bit``, ``stochastic_round``,
      ``step_in_backward``.
    """

    name: str
    kwargs: dict
    rule: str
    counterpart: str
    refused: tuple[str, ...] = ()
    kept: Optional[dict] = None
    dtensor: dict = field(default_factory=dict)
    example_kwargs: Optional[dict] = None
    rule_check: Optional[tuple[str, str]] = None
    eight_bit: bool = False
    four_bit: bool = False
    stochastic_round: bool = False
    step_in_backward: bool = True

    @property
    def cls(self) -> type:
        return getattr(mfa, self.name)

    def make(self, params: Any, **overrides: Any) -> torch.optim.Optimizer:
        return self.cls(params, **{**self.kwargs, **overrides})


_TORCH_REFUSED = ("amsgrad", "capturable", "differentiable")

OPTIM_DB: dict[str, OptimInfo] = {info.name: info for info in [
    OptimInfo("AdamW", dict(lr=1e-2, weight_decay=0.1), "adam", "torch.optim.AdamW", _TORCH_REFUSED,
              kept=dict(lr=1e-2), dtensor={"AdamW": dict(lr=1e-2, weight_decay=0.1)},
              example_kwargs=dict(lr=1e-2, weight_decay=0.1),
              rule_check=("test_contract", "test_agreement_with_torch_adamw_got_no_worse"), stochastic_round=True),
    OptimInfo("Adam", dict(lr=1e-2), "adam", "torch.optim.Adam", _TORCH_REFUSED,
              dtensor={"Adam-L2": dict(lr=1e-2, weight_decay=0.1)}, stochastic_round=True),
    OptimInfo("FusedAdam", dict(lr=1e-2), "adam", "deepspeed.ops.adam.FusedAdam",
              kept=dict(lr=1e-2, set_grad_none=False), dtensor={"FusedAdam": dict(lr=1e-2)}, stochastic_round=True),
    OptimInfo("CPUAdam", dict(lr=1e-2), "adam", "deepspeed.ops.adam.DeepSpeedCPUAdam",
              kept=dict(lr=1e-2, fp32_optimizer_states=False),
              dtensor={"CPUAdam-fp32-states": dict(lr=1e-2, fp32_optimizer_states=True)}),
    OptimInfo("Lion", dict(lr=1e-3), "lion", "lion_pytorch.Lion",
              kept=dict(lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True),
              dtensor={"Lion": dict(lr=1e-3, weight_decay=0.1)}, example_kwargs=dict(lr=1e-2, weight_decay=0.1),
              rule_check=("test_rules_contract", "test_lion_reference_matches_lion_pytorch_class")),
    OptimInfo("FusedLion", dict(lr=1e-3), "lion", "deepspeed.ops.lion.FusedLion",
              kept=dict(lr=1e-3, set_grad_none=False), dtensor={"FusedLion": dict(lr=1e-3)}),
    OptimInfo("Adagrad", dict(lr=1e-2), "adagrad", "torch.optim.Adagrad", ("differentiable",),
              kept=dict(lr=1e-2), dtensor={"Adagrad": dict(lr=1e-2, initial_accumulator_value=0.1)},
              example_kwargs=dict(lr=1e-2, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1),
              rule_check=("test_rules_contract", "test_adagrad_reference_matches_torch")),
    OptimInfo("AdamW8bit", dict(lr=1e-2, min_8bit_size=16), "adam", "bitsandbytes.optim.AdamW8bit", _TORCH_REFUSED,
              kept=dict(lr=1e-2, min_8bit_size=8, bf16_stochastic_round=True), eight_bit=True, stochastic_round=True),
    OptimInfo("Adam8bit", dict(lr=1e-2, min_8bit_size=16), "adam", "bitsandbytes.optim.Adam8bit", _TORCH_REFUSED,
              eight_bit=True, stochastic_round=True),
    OptimInfo("AdamW4bit", dict(lr=1e-2, min_4bit_size=16), "adam", "torchao.optim.AdamW4bit", _TORCH_REFUSED,
              kept=dict(lr=1e-2, min_4bit_size=8, bf16_stochastic_round=True), four_bit=True, stochastic_round=True),
    OptimInfo("Adam4bit", dict(lr=1e-2, min_4bit_size=16), "adam", "torchao.optim.Adam4bit", _TORCH_REFUSED,
              four_bit=True, stochastic_round=True),
]}


def rule_example_class(rule: str) -> OptimInfo:
    """The entry whose class gives ``rule``'s example (``contract.Example.optimizer``)."""
    from mps_fused_adam.numerics.contract import example
    return OPTIM_DB[example(rule).optimizer]


def select(pred: Callable[[OptimInfo], bool]) -> list[OptimInfo]:
    return [info for info in OPTIM_DB.values() if pred(info)]
