"""The fp8 lowering of one ``nn.Linear`` call: its ``F.linear`` computed with float8 operands.

While an operator whose plan entry is ``fp8``/``fp8-rowwise`` runs (between its forward pre- and post-hook), a
``TorchFunctionMode`` sends the ``F.linear`` call that reads the operator's own weight (Hugging Face's ``Conv1D``: its
``torch.addmm(bias, input, weight)``) to torchao's float8 matmul
(:func:`lightning_comp.adapters.torchao_float8.float8_linear`), its input cast to bf16 (the activations' dtype of an
fp8 operator: its output is bf16 too); every other torch call of the forward runs as it is.
The module keeps its class and parameters (no module swap), so the same ``nn.Linear`` can compute in fp8 in one step
and in bf16 or FP32 in the next. A call that made no such ``F.linear`` (a subclass whose forward computes otherwise)
is an error, never a silent FP32 or bf16 matmul under an fp8 plan entry.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_comp.adapters.torchao_float8 import float8_linear
from lightning_comp.errors import PlanError

__all__ = ["Float8Calls"]


class Float8Calls(TorchFunctionMode):
    """The mode in force during one fp8 operator's forward call (entered by its pre-hook, left by its post-hook).

    Args:
        name: the operator's name in the plan (for messages).
        module: the operator; its ``weight`` is read at the call (a sharded strategy may swap it in just before).
        recipe: torchao's scaling recipe (``"tensorwise"``, ``"rowwise"``).
        dtype: the dtype of the matmul's input and output (bf16).
    """

    def __init__(self, name: str, module: nn.Module, recipe: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.name = name
        self.module = module
        self.recipe = recipe
        self.dtype = dtype
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        own = getattr(self.module, "weight", None)
        if func is F.linear and isinstance(own, torch.Tensor):  # nn.Linear: F.linear(input, weight, bias)
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if weight is own:
                self.calls += 1
                given = args[0] if args else kwargs["input"]
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return float8_linear(given.to(self.dtype), own, bias, self.recipe)
        if func is torch.addmm and isinstance(own, torch.Tensor) and len(args) >= 3 and args[2] is own \
                and not kwargs:  # Hugging Face's Conv1D: addmm(bias, input, weight), weight of shape (in, out)
            self.calls += 1
            return float8_linear(args[1].to(self.dtype), own.t(), args[0], self.recipe)
        return func(*args, **kwargs)

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        super().__exit__(exc_type, exc, traceback)
        if exc_type is None and self.calls == 0 and sys.exc_info()[1] is None:  # (a raising forward: its error)
            raise PlanError(
                f"Operator {self.name or '<root>'!r} is planned in fp8, but its forward made no F.linear call with its"
                " own weight (nor, for a Conv1D, a torch.addmm), which is what fp8 computes: a Linear subclass whose"
                " forward computes otherwise cannot be lowered to fp8. Assign it 'bf16' (or 'fp32') in the plan.")

