"""The entry of every optimizer's ``step``: torch's step hooks and profiler range, paid only when used.

``torch.optim.Optimizer`` wraps each subclass's ``step`` in ``profile_hook_step``: it runs the
global and per-optimizer step pre- and post-hooks and opens a ``record_function`` range named
``Optimizer.step#<class>.step``. Opening and closing that range goes through torch's operator
dispatcher every step, profiler or not. Right after a kernel pass has streamed the step's tensors
through the caches, that path runs cold and costs as much as the rest of a planned step's Python
(``benchmarks/diag_step_path.py``; docs/benchmarks.md, "Figures behind the code"). ``fast_step_entry`` marks ``step`` as already hooked (torch then leaves it alone) and
calls torch's own wrapper whenever anything could observe it: a step hook registered on this
optimizer or globally, or an enabled profiler. Otherwise it calls the step directly. So hooks,
their argument rewriting and the profiler's range behave exactly as torch defines them, from
torch's own code.

Under ``torch.compile`` (``torch.compile(opt.step)``, or a compiled training step that calls it,
as PyTorch's optimizer tutorial shows) the step runs eagerly: it is one fused kernel call already,
and Dynamo cannot trace the extension's methods (it called a nanobind method without its ``self``
and the step failed with a ``TypeError``). Once ``torch._dynamo`` is loaded, the entry
goes through ``torch.compiler.disable`` (a small cost per step), whether or not this call is
compiled: Dynamo compiles each new frame below a frame it gave up on,
so ``is_compiling()`` read in the entry says False there and cannot tell."""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import torch
from torch.optim import optimizer as _torch_optimizer

_F = TypeVar("_F", bound=Callable[..., Any])

# Module-level hook registries of torch.optim (register_optimizer_step_pre_hook/post_hook).
# A torch without them gets torch's wrapper on every step.
_GLOBAL_PRE = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)
_GLOBAL_POST = getattr(_torch_optimizer, "_global_optimizer_post_hooks", None)
_profiler_enabled = torch.autograd._profiler_enabled


def _observed(opt: torch.optim.Optimizer) -> bool:
    """True when a step hook or the profiler could see this step (then torch's wrapper runs)."""
    return (_GLOBAL_PRE is None or _GLOBAL_POST is None or bool(_GLOBAL_PRE) or bool(_GLOBAL_POST)
            or bool(getattr(opt, "_optimizer_step_pre_hooks", True))
            or bool(getattr(opt, "_optimizer_step_post_hooks", True)) or _profiler_enabled())


def fast_step_entry(step: _F) -> _F:
    """Decorate an optimizer class's ``step`` (see the module docstring). The decorated method
    must not call another decorated ``step`` (``super().step``): each would run the hooks.

    A user's subclass that overrides ``step`` and calls ``super().step()`` gets torch's wrapper
    around its own ``step`` (torch's ``_patch_step_function``), which runs the hooks once; the
    entry then calls the step directly, so the hooks do not run a second time."""
    hooked = torch.optim.Optimizer.profile_hook_step(step)

    @functools.wraps(step)
    def entry(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if _observed(self):
            outer = type(self).step
            if outer is public or not getattr(outer, "hooked", False):
                return hooked(self, *args, **kwargs)
        return step(self, *args, **kwargs)

    eager: list = []  # torch.compiler.disable(entry), made once torch._dynamo is loaded

    def public(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        # Only where torch._dynamo is loaded can torch.compile be tracing this call; importing it
        # here would slow the first step severalfold (tests/test_optim.py).
        if "torch._dynamo" in sys.modules:
            if not eager:
                eager.append(torch.compiler.disable(entry))
            return eager[0](self, *args, **kwargs)
        return entry(self, *args, **kwargs)

    functools.update_wrapper(public, step)
    public.hooked = True  # type: ignore[attr-defined]  # torch's _patch_step_function skips it
    return public  # type: ignore[return-value]
