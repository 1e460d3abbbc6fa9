"""What a step computes on CUDA: every aten op with its operator, phase, operand dtypes and devices.

:class:`CudaRecorder` is a ``TorchDispatchMode``: it sees ops after autocast has chosen their dtypes, i.e. what the
CUDA kernels would be called with. Forward ops belong to the innermost recorded operator whose forward is running;
backward ops to the operator whose forward created the autograd node being run (found by tagging, when each
operator's forward ends, the nodes its forward created). Each op is checked as it is recorded against:

- :data:`SAME_DTYPE`, the operands a CUDA kernel requires to share a dtype (meta kernels accept mixes that CUDA's
  kernels refuse, e.g. ``mm(bf16, fp32)`` or LayerNorm with a bf16 input and fp32 weight: "expected scalar type
  BFloat16 but found Float"; BatchNorm's input may differ from its parameters, its parameters may not differ);
- no device-to-host copy (``.item()``, ``bool(tensor)``, ``nonzero``, a copy from cuda to the CPU): a host sync in
  forward or backward stalls the GPU's queue once per op.

A violation raises :class:`CudaRuleViolation` at once (so a fake-tensor ``DataDependentOutputException`` never hides
which operator asked for a host read).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["SAME_DTYPE", "WORK", "CallEvent", "CudaRecorder", "CudaRuleViolation", "OpEvent"]

# aten op (overload packet) -> the operands its CUDA kernel requires to share one dtype (None operands are skipped)
SAME_DTYPE: dict[str, tuple[str, ...]] = {
    "mm": ("self", "mat2"),
    "addmm": ("self", "mat1", "mat2"),
    "bmm": ("self", "mat2"),
    "baddbmm": ("self", "batch1", "batch2"),
    "addbmm": ("self", "batch1", "batch2"),
    "mv": ("self", "vec"),
    "addmv": ("self", "mat", "vec"),
    "dot": ("self", "tensor"),
    "convolution": ("input", "weight", "bias"),
    "convolution_backward": ("grad_output", "input", "weight"),
    "cudnn_convolution": ("self", "weight"),
    "native_layer_norm": ("input", "weight", "bias"),
    "native_layer_norm_backward": ("grad_out", "input", "weight", "bias"),
    "native_group_norm": ("input", "weight", "bias"),
    "native_group_norm_backward": ("grad_out", "input", "weight"),
    "_fused_rms_norm": ("input", "weight"),
    "_fused_rms_norm_backward": ("grad_out", "input", "weight"),
    # batch norm: a 16-bit input with FP32 parameters is legal on CUDA (cuDNN and native); mixed parameters are not
    "native_batch_norm": ("weight", "bias"),
    "_native_batch_norm_legit": ("weight", "bias"),
    "_native_batch_norm_legit_no_training": ("weight", "bias"),
    "native_batch_norm_backward": ("grad_out", "input"),
    "_thnn_fused_lstm_cell": ("input_gates", "hidden_gates", "cx", "input_bias", "hidden_bias"),
    "_thnn_fused_gru_cell": ("input_gates", "hidden_gates", "hx", "input_bias", "hidden_bias"),
    "_scaled_dot_product_flash_attention": ("query", "key", "value"),
    "_scaled_dot_product_efficient_attention": ("query", "key", "value", "attn_bias"),
    "_scaled_dot_product_cudnn_attention": ("query", "key", "value"),
    "_scaled_dot_product_attention_math": ("query", "key", "value"),
    "_flash_attention_forward": ("query", "key", "value"),
    "_efficient_attention_forward": ("query", "key", "value"),
    "_scaled_dot_product_flash_attention_backward": ("grad_out", "query", "key", "value"),
    "_scaled_dot_product_efficient_attention_backward": ("grad_out_", "query", "key", "value"),
}

# the ops that do an operator's arithmetic (what must run in its planned dtype), and the operand whose dtype is the
# precision it computes in
WORK: dict[str, str] = {
    "mm": "self", "addmm": "mat1", "bmm": "self", "baddbmm": "batch1", "addbmm": "batch1", "mv": "self",
    "addmv": "mat", "convolution": "input", "convolution_backward": "grad_output",
    "native_layer_norm": "input", "native_layer_norm_backward": "grad_out",
    "native_group_norm": "input", "native_group_norm_backward": "grad_out",
    "_fused_rms_norm": "input", "_fused_rms_norm_backward": "grad_out",
    "native_batch_norm": "input", "_native_batch_norm_legit": "input",
    "_native_batch_norm_legit_no_training": "input", "native_batch_norm_backward": "grad_out",
    "_thnn_fused_lstm_cell": "input_gates", "_thnn_fused_lstm_cell_backward_impl": "grad_hy",
    "_thnn_fused_gru_cell": "input_gates", "_thnn_fused_gru_cell_backward": "grad_hy",
    "_scaled_dot_product_flash_attention": "query", "_scaled_dot_product_efficient_attention": "query",
    "_scaled_dot_product_cudnn_attention": "query", "_scaled_dot_product_attention_math": "query",
    "_scaled_dot_product_flash_attention_backward": "grad_out",
    "_scaled_dot_product_efficient_attention_backward": "grad_out_",
    "_cudnn_rnn": "input", "_cudnn_rnn_backward": "input",
}

_HOST_READS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "unique",
                         "_unique2", "equal", "allclose"})


class CudaRuleViolation(AssertionError):
    """An op that a CUDA kernel would reject, or that reads a value back to the host."""


@dataclass(frozen=True)
class OpEvent:
    """One aten op as the CUDA kernel would be called with it.

    Attributes:
        owner: the operator it belongs to (``None``: outside every recorded operator, e.g. the loss).
        phase: ``"forward"`` or ``"backward"``.
        op: the overload packet's name (``"addmm"``).
        operands: dtype of each tensor operand by schema name (lists: their first tensor's dtype).
        outputs: dtypes of the floating outputs.
        devices: device types of every tensor in and out.
    """

    owner: str | None
    phase: str
    op: str
    operands: Mapping[str, torch.dtype]
    outputs: tuple[torch.dtype, ...]
    devices: frozenset[str]

    @property
    def computes_in(self) -> torch.dtype | None:
        """The dtype its arithmetic runs in (work ops only)."""
        name = WORK.get(self.op)
        return None if name is None else self.operands.get(name)

    def describe(self) -> str:
        operands = ", ".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in self.operands.items())
        return f"{self.phase} {self.op}({operands}) in {self.owner or '<outside operators>'}"


@dataclass(frozen=True)
class CallEvent:
    """What an operator's forward was called with, after the plugin's pre-hook (its inputs and own parameters)."""

    owner: str
    inputs: tuple[torch.dtype, ...]
    parameters: Mapping[str, torch.dtype]


def _floating(obj: Any) -> tuple[torch.dtype, ...]:
    return tuple(t.dtype for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point())


def _operands(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, torch.dtype]:
    found: dict[str, torch.dtype] = {}
    names = [a.name for a in func._schema.arguments]  # noqa: SLF001
    for name, value in [*zip(names, args, strict=False), *kwargs.items()]:
        if isinstance(value, torch.Tensor):
            found[name] = value.dtype
        elif isinstance(value, (list, tuple)):
            first = next((v for v in value if isinstance(v, torch.Tensor)), None)
            if first is not None:
                found[name] = first.dtype
    return found


def _devices(obj: Any) -> frozenset[str]:
    return frozenset(t.device.type for t in tree_leaves(obj) if isinstance(t, torch.Tensor))


class CudaRecorder(TorchDispatchMode):
    """Records and checks every aten op of the steps run while it is active (see the module docstring).

    Args:
        model: the model; ``operators`` name its operators (name -> module), whose forwards own ops.
        operators: the recorded operators (default: every named submodule).
        on_event: called with each event before its checks (a negative control can inspect or inject there).
    """

    def __init__(self, model: nn.Module, operators: Mapping[str, nn.Module] | None = None,
                 on_event: Callable[[OpEvent], None] | None = None) -> None:
        super().__init__()
        self.events: list[OpEvent] = []
        self.on_event = on_event
        self.watched: set[str] = set()
        self._stack: list[str] = []
        self._inputs: list[set[Any]] = []
        self._owner_of_node: dict[Any, str] = {}
        self.calls: list[CallEvent] = []
        self._handles: list[Any] = []
        self.watch(dict(model.named_modules()) if operators is None else dict(operators))

    def watch(self, operators: Mapping[str, nn.Module]) -> None:
        """Own ops by these operators too (those a trace of the first step found, once it has run)."""
        for name, module in operators.items():
            if name and name not in self.watched:
                self.watched.add(name)
                self._handles.append(module.register_forward_pre_hook(self._push(name), prepend=True))
                self._handles.append(module.register_forward_pre_hook(self._called(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._pop(name), always_call=True))

    # --------------------------------------------------------------------------------------------- attribution
    def _push(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(name)
            self._inputs.append({t.grad_fn for t in tree_leaves(args) if isinstance(t, torch.Tensor)
                                 and t.grad_fn is not None})
        return hook

    def _called(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:  # after the plugin's pre-hook: what forward gets
            self.calls.append(CallEvent(name, _floating((args, kwargs)),
                                        {n: p.dtype for n, p in module.named_parameters(recurse=False)}))
        return hook

    def _pop(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._stack.pop()
            stop = self._inputs.pop()
            if output is not None:
                self._tag(name, [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor)], stop)
        return hook

    def _tag(self, name: str, roots: Iterable[Any], stop: set[Any]) -> None:
        """Tag the autograd nodes the operator's forward created (inner operators keep their own tags)."""
        seen: set[Any] = set()
        todo = [n for n in roots if n is not None]
        while todo:
            node = todo.pop()
            if node in seen or node in stop:
                continue
            seen.add(node)
            self._owner_of_node.setdefault(node, name)
            todo.extend(n for n, _ in node.next_functions if n is not None)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---------------------------------------------------------------------------------------------- recording
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        node = torch._C._current_autograd_node()  # noqa: SLF001 - set while the engine runs a node
        phase = "forward" if node is None else "backward"
        owner = (self._stack[-1] if self._stack else None) if node is None else self._owner_of_node.get(node)
        name = func.overloadpacket.__name__
        operands = _operands(func, args, kwargs)
        if name in _HOST_READS:
            self._violation(f"a device-to-host read ({name}) in {phase} of {owner or '<outside operators>'}",
                            OpEvent(owner, phase, name, operands, (), _devices((args, kwargs))))
        out = func(*args, **kwargs)
        event = OpEvent(owner, phase, name, operands, _floating(out), _devices((args, kwargs, out)))
        if self.on_event is not None:
            self.on_event(event)
        self.events.append(event)
        self._check(event, args, out)
        return out

    def _check(self, event: OpEvent, args: Any, out: Any) -> None:
        shared = [event.operands[n] for n in SAME_DTYPE.get(event.op, ()) if n in event.operands]
        # an op on a wrapper subclass (torchao's float8 tensors report their original dtype) is not the kernel: the
        # subclass runs its own (``_scaled_mm``, on float8 data), below this mode; its checks are fp8's own
        wrapped = any(is_traceable_wrapper_subclass(t) for t in tree_leaves(args))
        if len(set(shared)) > 1 and not wrapped:
            self._violation(f"operands a CUDA kernel requires to share a dtype differ: {event.describe()}", event)
        if event.op in ("_to_copy", "copy_") and "cuda" in _devices(args) and _devices(out) == {"cpu"}:
            self._violation(f"a device-to-host copy in {event.phase} of {event.owner or '<outside operators>'}",
                            event)

    def _violation(self, message: str, event: OpEvent) -> None:
        self.events.append(event)
        raise CudaRuleViolation(message)

    # -------------------------------------------------------------------------------------------------- queries
    def of(self, owner: str | None = None, phase: str | None = None, ops: str | None = None) -> list[OpEvent]:
        """Events of ``owner`` (``None``: all) in ``phase``, whose op matches the regular expression ``ops``."""
        pattern = re.compile(ops) if ops else None
        return [e for e in self.events if (owner is None or e.owner == owner) and (phase is None or e.phase == phase)
                and (pattern is None or pattern.fullmatch(e.op))]

    def work(self, owner: str, phase: str) -> list[OpEvent]:
        """The ops doing ``owner``'s arithmetic in ``phase``."""
        return [e for e in self.of(owner, phase) if e.op in WORK]
