"""The test table of the optimizer classes (tests/optim_db.py) covers every public class."""
from __future__ import annotations

import torch

import mps_fused_adam as mfa
from mps_fused_adam.numerics.contract import RULES, element_rules

from conftest import public_optimizer_names
from optim_db import OPTIM_DB


def test_every_public_class_has_an_entry():
    """A new public optimizer class (``__all__`` and the lazy table of ``__init__.py``) without an
    entry fails here, before any test that reads the table can silently leave it out."""
    lazy = sorted(n for n in mfa._PUBLIC
                  if isinstance(getattr(mfa, n), type) and issubclass(getattr(mfa, n), torch.optim.Optimizer))
    assert sorted(OPTIM_DB) == public_optimizer_names() == lazy


def test_entries_describe_their_classes():
    """Each entry's rule and capabilities are its class's (a class that gains or loses an option
    changes its entry), and each rule has an example class naming its counterpart's test."""
    for name, info in OPTIM_DB.items():
        cls = info.cls
        assert cls._rule == info.rule and info.rule in RULES, name
        opt = info.make([torch.nn.Parameter(torch.zeros(4))])
        assert type(opt) is cls, name
        options = cls.__init__.__code__.co_varnames
        assert info.eight_bit == ("min_8bit_size" in opt.defaults), name
        assert info.four_bit == ("min_4bit_size" in opt.defaults), name
        assert info.stochastic_round == ("bf16_stochastic_round" in options), name
        assert info.step_in_backward == ("step_in_backward" in options), name
        assert all(option in options for option in info.refused), name
        assert "." in info.counterpart, name
    for rule in element_rules():
        assert [i.name for i in OPTIM_DB.values() if i.rule == rule and i.rule_check and i.example_kwargs], rule
