"""Observing what a model computes: the dtypes of every aten op, attributed to the module that ran it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["CallRecord", "DtypeRecorder", "OpRecord", "ScaledMatmul", "ScaledMatmulRecorder", "count_forward_hooks",
           "sqnr"]


@dataclass
class OpRecord:
    module: str | None  # innermost recorded module running when the op ran (None: outside modules, e.g. backward)
    op: str  # aten overload packet name, e.g. "addmm"
    inputs: list[torch.dtype]
    outputs: list[torch.dtype]


@dataclass
class CallRecord:
    module: str
    inputs: list[torch.dtype]
    outputs: list[torch.dtype]


def _dtypes(obj: Any) -> list[torch.dtype]:
    return [t.dtype for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()]


class DtypeRecorder(TorchDispatchMode):
    """Records the dtypes of every aten op, attributed to the module whose forward was running.

    Attach it *after* the plugin has hooked the model: its pre-hook is prepended (runs before the plugin casts the
    inputs) and its post-hook is appended (runs after the plugin cast the outputs), so the casts the plugin inserts
    are attributed to the operator they belong to, and :attr:`calls` shows what each operator handed on.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpRecord] = []
        self.calls: list[CallRecord] = []
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def attach(self, model: nn.Module, names: tuple[str, ...] | None = None) -> DtypeRecorder:
        for name, module in model.named_modules():
            if not name or (names is not None and name not in names):
                continue
            self._handles.append(module.register_forward_pre_hook(self._push(name), prepend=True))
            self._handles.append(module.register_forward_hook(self._pop(name), always_call=True))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _push(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(name)

        return hook

    def _pop(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._stack.pop()
            self.calls.append(CallRecord(name, _dtypes(args), _dtypes(output)))

        return hook

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        module = self._stack[-1] if self._stack else None
        self.ops.append(OpRecord(module, func.overloadpacket.__name__, _dtypes((args, kwargs)), _dtypes(out)))
        return out

    def clear(self) -> None:
        self.ops.clear()
        self.calls.clear()

    def ops_of(self, module: str, *ops: str) -> list[OpRecord]:
        return [r for r in self.ops if r.module == module and (not ops or r.op in ops)]

    def calls_of(self, module: str) -> list[CallRecord]:
        return [c for c in self.calls if c.module == module]


@dataclass
class ScaledMatmul:
    module: str | None  # innermost recorded module running (None: outside modules, e.g. backward)
    operands: tuple[torch.dtype, torch.dtype]
    scales: tuple[tuple[int, ...], tuple[int, ...]]
    scale_dtypes: tuple[torch.dtype, torch.dtype]
    out_dtype: torch.dtype | None
    devices: tuple[str, ...]  # of the operands and scales


class ScaledMatmulRecorder:
    """Records every ``torch._scaled_mm`` call (torchao's float8 matmuls call it by attribute, at call time), with the
    module running it as ``modules`` (a :class:`DtypeRecorder` attached to the model) sees it.

    A ``TorchDispatchMode`` cannot see these calls: torchao's float8 tensors report their original dtype and make the
    call inside their own ``__torch_dispatch__``, below any mode.
    """

    def __init__(self, modules: DtypeRecorder | None = None) -> None:
        self.modules = modules
        self.calls: list[ScaledMatmul] = []
        self._real: Any = None

    def __enter__(self) -> ScaledMatmulRecorder:
        self._real = real = torch._scaled_mm

        def recorded(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                     *args: Any, **kwargs: Any) -> Any:
            stack = self.modules._stack if self.modules is not None else []
            self.calls.append(ScaledMatmul(
                stack[-1] if stack else None, (a.dtype, b.dtype), (tuple(scale_a.shape), tuple(scale_b.shape)),
                (scale_a.dtype, scale_b.dtype), kwargs.get("out_dtype"),
                tuple(str(t.device) for t in (a, b, scale_a, scale_b))))
            return real(a, b, scale_a, scale_b, *args, **kwargs)

        torch._scaled_mm = recorded
        return self

    def __exit__(self, *args: Any) -> None:
        torch._scaled_mm = self._real


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB, ``20 log10(||ref|| / ||ref - out||)`` (inf if identical)."""
    ref, out = ref.detach().double(), out.detach().double()
    noise = torch.linalg.vector_norm(ref - out)
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(torch.linalg.vector_norm(ref) / noise))


def count_forward_hooks(model: nn.Module) -> int:
    """Forward pre- and post-hooks registered on ``model`` and all its submodules."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
