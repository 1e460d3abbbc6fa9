"""Running a precision plan inside ``torch.compile`` graphs.

The executor's hooks enter an operator's autocast region in its forward pre-hook and leave it in its post-hook. A
``with torch.autocast(...)`` object entered in one hook and left in another cannot be traced by TorchDynamo, so under
``torch.compile`` the regions are entered and left through the functional pair that PyTorch provides for tracing
(``torch.amp.autocast_mode._enter_autocast``/``_exit_autocast``): Dynamo records each region into the graph, one
graph for the whole forward, and Inductor compiles every operator in its planned dtype.

Dynamo does not guard compiled graphs on modules' hooks by default (``skip_nnmodule_hook_guards``): a graph traced
under one plan would go on running after the hooks of another plan replace its hooks. :func:`guarding_hooks` turns
those guards on for as long as a compiled model trains under a plan, so that each new plan is traced anew.

A hook must only ever be traced *inside* its caller's graph. Where Dynamo gives up on a caller's frame ("falling
back to eager"), it compiles the functions that frame calls as frames of their own, a hook among them: the region
would then be entered in a graph of its own and be gone before the operator runs, and :func:`compiling`, compiled
alone, would answer ``True`` for ever after. :func:`only_inlined` marks the hooks' and these helpers' code so that
Dynamo never compiles it as a frame of its own.

An operator Dynamo cannot trace (recurrent modules: ``torch._dynamo.config.allow_rnn`` is off by default) breaks the
graph inside its own region, and a region entered in a graph is not in force in the eager code after the break: the
operator would silently compute in FP32. Such operators run whole outside the graph instead, hooks included
(:class:`EagerCall`).

Everything a hook does only in Python (the consumer tracing that finds cast boundaries, timers of the search) would
be traced once and then never run again, so it runs in eager mode: :func:`eager` makes compiled code run eagerly
for a while (``torch.compiler.set_stance("force_eager")``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_comp.adapters import lightning_internals, torch_internals
from lightning_comp.operators.kinds import is_recurrent

__all__ = ["EagerCall", "compiling", "eager", "enter_autocast", "exit_autocast", "guarding_hooks", "is_compiled",
           "only_inlined", "untraceable"]

# The functional pair torch.export and Dynamo trace (private: see the adapter), with a fallback for torch builds
# without it (their Dynamo cannot trace these regions: such a model then fails where it would have anyway).
_enter_autocast = torch_internals.ENTER_AUTOCAST
_exit_autocast = torch_internals.EXIT_AUTOCAST


_SKIPPED_CODES: set[Any] = set()
_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def only_inlined(fn: _Fn) -> _Fn:
    """Mark ``fn``'s code so that TorchDynamo traces it only when inlining a caller, never as a frame of its own
    (one call per code object; every closure made by the same ``def`` shares it). Returns ``fn``."""
    code = fn.__code__
    if code not in _SKIPPED_CODES:
        torch_internals.never_compile_as_frame(code)
        _SKIPPED_CODES.add(code)
    return fn


@only_inlined
def enter_autocast(device_type: str, dtype: torch.dtype, enabled: bool = True) -> Any:
    """Enter an autocast region (weight cache off, as the executor's eager regions; ``enabled=False``: a region in
    which autocast is off) and return its handle."""
    if _enter_autocast is None:  # pragma: no cover
        mode = torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False)
        mode.__enter__()
        return mode
    return _enter_autocast(device_type, dtype, enabled, False)


@only_inlined
def exit_autocast(mode: Any) -> None:
    """Leave the autocast region :func:`enter_autocast` entered."""
    if _exit_autocast is None:  # pragma: no cover
        mode.__exit__(None, None, None)
        return
    _exit_autocast(mode)


@only_inlined
def compiling() -> bool:
    """Whether the caller is being traced by TorchDynamo now."""
    return bool(torch.compiler.is_compiling())


@contextmanager
def eager() -> Iterator[None]:
    """Run compiled functions and modules eagerly inside this context (their graphs stay cached for later)."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    if set_stance is None:  # pragma: no cover
        with torch_internals.dynamo_disabled():
            yield
        return
    with set_stance("force_eager"):
        yield


@contextmanager
def guarding_hooks() -> Iterator[None]:
    """Compiled graphs traced inside this context guard on the hooks of the modules they call, so that a new plan's
    hooks recompile them. Graphs compiled before it carry no such guard and are dropped first
    (``torch.compiler.reset()``: anything else compiled in this process is compiled again on its next call)."""
    torch.compiler.reset()
    with torch_internals.dynamo_guards_module_hooks():
        yield


def untraceable(module: nn.Module) -> bool:
    """Whether TorchDynamo breaks the graph at ``module``'s forward (recurrent modules, unless ``allow_rnn``)."""
    return is_recurrent(module) and not torch_internals.dynamo_traces_rnn()


class EagerCall:
    """Runs ``module``'s forward between a pre- and a post-hook as one call Dynamo leaves out of the graph.

    It replaces the module's ``forward`` by an instance attribute (``torch.compiler.disable``d), so a compiled caller
    breaks the graph at the module and calls it eagerly, hooks included; :meth:`remove` puts the forward back.

    Args:
        module: the operator.
        pre_hook: a forward pre-hook with kwargs (returns ``None`` or new ``(args, kwargs)``).
        post_hook: a forward hook (returns ``None`` or a new output; called with ``None`` if forward raised).
    """

    def __init__(self, module: nn.Module, pre_hook: Callable[..., Any], post_hook: Callable[..., Any]) -> None:
        self._module = module
        self._own = module.__dict__.get("forward")  # an instance-level forward of the user's, put back on removal
        forward = module.forward

        def call(*args: Any, **kwargs: Any) -> Any:
            changed = pre_hook(module, args, kwargs)
            if changed is not None:
                args, kwargs = changed
            try:
                output = forward(*args, **kwargs)
            except BaseException:
                post_hook(module, args, None)
                raise
            result = post_hook(module, args, output)
            return output if result is None else result

        module.forward = torch.compiler.disable(call)  # type: ignore[method-assign]

    def remove(self) -> None:
        """Give the module its forward back."""
        if self._own is not None:
            self._module.forward = self._own  # type: ignore[method-assign]
        else:
            self._module.__dict__.pop("forward", None)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs under ``torch.compile``: handed to ``fit`` compiled (Lightning unwraps it and keeps the
    compile settings), holding a compiled submodule (e.g. from ``configure_model``), or with a compiled ``forward``
    (``module.forward = torch.compile(module.forward)``)."""
    if lightning_internals.compiled_by_lightning(module):
        return True
    return any(torch_internals.is_compiled_module(m) or torch_internals.has_compiled_forward(m)
               for m in module.modules())
