"""TEMPORARY (until issue 10a's rule structure is merged): Lion and Adagrad through the reference.

Replaced by the backends' rule API at the merge; nothing else may depend on this module.
"""
from __future__ import annotations

from .reference import reference_adagrad_, reference_lion_


def update_rule_staged(backend, rule, params, grads, states, hp) -> None:
    fn = {"lion": reference_lion_, "adagrad": reference_adagrad_}[rule]
    for i, (p, g) in enumerate(zip(params, grads)):
        fn(p, g, *[lst[i] for lst in states], hp)
