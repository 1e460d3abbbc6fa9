"""Every private torch attribute lightning-comp reads or calls, in one place.

Some of what the package does has no public API in torch: entering an autocast region in a form TorchDynamo traces,
handing tensors on to the saved-tensor hooks already in force, swapping a module's parameters for 16-bit copies for
one call, the CPU's native 16-bit features, the classes all convolutions and norms derive from, what
``torch.compile`` wraps a module in, the names of autograd's nodes (which kind of operation made a tensor). Each
access is a small function or constant here, and ``tests/unit/test_torch_internals.py`` checks every one against the
installed torch, so an upgrade that moves one fails in one named test instead of silently changing what a plan
computes. Where torch may lack a symbol, the function says what happens instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import CodeType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.nn.utils import stateless
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "BATCH_NORM_BASE",
    "COMPILED_WRAPPER_ATTRIBUTE",
    "FSDP2_MODULE",
    "fsdp2_policy_of",
    "set_fsdp2_policy",
    "WRAPPER_ATTRIBUTES",
    "CONV_BASE",
    "ENTER_AUTOCAST",
    "EXIT_AUTOCAST",
    "NORM_BASE",
    "autograd_output",
    "is_cast_node",
    "is_gradient_accumulator",
    "is_reshape_node",
    "is_view_or_cast_node",
    "node_inputs",
    "node_key",
    "cpu_feature_probe",
    "dynamo_disabled",
    "dynamo_guards_module_hooks",
    "dynamo_traces_rnn",
    "TORCH_DISPATCH_MODE",
    "grad_scaler_scale",
    "has_compiled_forward",
    "in_backward",
    "is_compiled_module",
    "never_compile_as_frame",
    "reparametrized",
    "saved_tensors_hooks_enabled",
    "storage_key",
    "tensor_base",
    "tensor_version",
    "top_saved_tensors_hooks",
    "update_rnn_flat_weights",
]

# ------------------------------------------------------------------------------------------------- module classes
#: The base class of every ``nn.Conv*``/``nn.ConvTranspose*`` (``torch.nn.modules.conv._ConvNd``).
CONV_BASE: type[nn.Module] = nn.modules.conv._ConvNd
#: The base class of batch and instance norms (``torch.nn.modules.batchnorm._NormBase``).
NORM_BASE: type[nn.Module] = nn.modules.batchnorm._NormBase
#: The base class of the batch norms, not the instance norms (``torch.nn.modules.batchnorm._BatchNorm``).
BATCH_NORM_BASE: type[nn.Module] = nn.modules.batchnorm._BatchNorm


def update_rnn_flat_weights(module: nn.RNNBase) -> None:
    """Point an RNN's flat-weight list at its current parameters again (``RNNBase._update_flat_weights``): after
    its parameters were swapped for 16-bit copies and back, the list still holds the copies."""
    module._update_flat_weights()


# ------------------------------------------------------------------------------------------------------- tensors
def tensor_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor ``tensor`` is a view of, or ``tensor`` itself (``Tensor._base``)."""
    base = tensor._base
    return tensor if base is None else base


def tensor_version(tensor: torch.Tensor) -> int:
    """The in-place modification counter of ``tensor`` (``Tensor._version``)."""
    return int(tensor._version)


def storage_key(tensor: torch.Tensor) -> int:
    """What identifies the memory ``tensor`` lives in, shared by its views (the storage's C++ object,
    ``UntypedStorage._cdata``). Unlike ``data_ptr()`` it tells storages apart that have no memory of their own:
    fake and meta tensors (``data_ptr() == 0`` for all of them) and storages of no bytes. A ``DTensor`` (an FSDP2
    shard) has no storage of its own: its local shard's identifies it."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None and _is_dtensor(tensor):
        tensor = to_local()
    return int(tensor.untyped_storage()._cdata)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def grad_scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The scaler's current scale as the tensor on its device (``GradScaler._scale``; ``None`` before its first
    ``scale()`` or when disabled). ``get_scale()`` reads it back to the host: a sync each call."""
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


@contextmanager
def reparametrized(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module`` computes with ``tensors`` (name -> tensor, dotted names reach into children) in place of its
    parameters inside the block (``torch.nn.utils.stateless._reparametrize_module``; ``torch.func.functional_call``
    is the public form, but it runs the call itself, and a forward hook must let the module's own call run)."""
    with stateless._reparametrize_module(module, tensors):
        yield


# ------------------------------------------------------------------------------------------------ autograd nodes
# What kind of operation made a tensor shows only in the name of its autograd node (``Node.name()``), a C++ class
# name torch may change between releases.
_CAST_NODE = "ToCopyBackward0"  # ``.to(dtype)``, autocast's casts, ``Tensor.type``
# views that only reshape (row-major order kept): ``view``/``reshape``/``flatten``, and ``matmul``'s own reshapes
_RESHAPE_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
# views of any kind (transposes, slices, expansions, ...) and casts
_VIEW_OR_CAST_NODES = _RESHAPE_NODES | {
    _CAST_NODE, "TBackward0", "TransposeBackward0", "PermuteBackward0", "ExpandBackward0", "UnsqueezeBackward0",
    "SqueezeBackward0", "SqueezeBackward1", "AliasBackward0", "SliceBackward0", "SelectBackward0",
    "AsStridedBackward0",
}
_GRADIENT_ACCUMULATOR = "torch::autograd::AccumulateGrad"  # the node of a leaf that needs a gradient


def is_cast_node(node: Node) -> bool:
    """Whether autograd node ``node`` is that of a dtype cast (``ToCopyBackward0``: ``.to(dtype)``, an autocast
    region's or a hook's input cast)."""
    return node.name() == _CAST_NODE


def is_reshape_node(node: Node) -> bool:
    """Whether autograd node ``node`` is that of a view that only reshapes, keeping row-major order
    (``ViewBackward0``, ``UnsafeViewBackward0``, ``ReshapeAliasBackward0``: ``view``, ``reshape``, ``flatten``)."""
    return node.name() in _RESHAPE_NODES


def is_view_or_cast_node(node: Node) -> bool:
    """Whether autograd node ``node`` only views (reshape, transpose, permute, expand, (un)squeeze, slice, select,
    alias, ``as_strided``) or casts its input."""
    return node.name() in _VIEW_OR_CAST_NODES


def is_gradient_accumulator(node: Node) -> bool:
    """Whether autograd node ``node`` accumulates a leaf's gradient (``AccumulateGrad``: the leaf needs one)."""
    return node.name() == _GRADIENT_ACCUMULATOR


def node_inputs(node: Node) -> tuple[tuple[Node | None, int], ...]:
    """The ``(node, output index)`` edges to the nodes of ``node``'s inputs (``Node.next_functions``; ``None``
    for an input that needs no gradient)."""
    return node.next_functions


def node_key(node: Node) -> int:
    """A number telling autograd node ``node`` from the others made in this thread (``Node._sequence_nr()``, counted
    up at each node made): a key that does not keep the node alive, as the node itself would."""
    return int(node._sequence_nr())


def autograd_output(tensor: torch.Tensor) -> tuple[Node | None, int]:
    """The autograd node that made ``tensor`` (``None``: a leaf, or made without recording) and which of its
    outputs ``tensor`` is (``Tensor.grad_fn``, ``Tensor.output_nr``)."""
    return tensor.grad_fn, int(tensor.output_nr)


# -------------------------------------------------------------------------------------------- saved-tensor hooks
def saved_tensors_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be installed now (``torch._C._autograd._saved_tensors_hooks_is_enabled``;
    torch disables them inside some of its own regions). ``True`` where torch has no such query."""
    query = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return True if query is None else bool(query())


def top_saved_tensors_hooks() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The ``(pack, unpack)`` pair of the innermost saved-tensor hooks in force (``save_on_cpu``, a memory probe, a
    user's own), or ``None`` (``torch._C._autograd._top_saved_tensors_default_hooks``). Only the innermost pair is
    called by autograd, so hooks installed inside must hand tensors on to these themselves."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - every torch this package supports has it
        return None
    hooks = top(False)
    return None if hooks is None else (hooks[0], hooks[1])


# ------------------------------------------------------------------------------------------------- torch.compile
#: The autocast region functions ``torch.export`` and TorchDynamo trace into a graph
#: (``torch.amp.autocast_mode._enter_autocast(device_type, dtype, enabled, cache_enabled)`` and ``_exit_autocast``),
#: the very function objects Dynamo recognises; ``None`` in a torch without them.
ENTER_AUTOCAST: Callable[..., Any] | None = getattr(torch.amp.autocast_mode, "_enter_autocast", None)
EXIT_AUTOCAST: Callable[[Any], None] | None = getattr(torch.amp.autocast_mode, "_exit_autocast", None)

#: The attribute under which ``torch.compile``'s wrapper (``OptimizedModule``) holds the module it compiles.
COMPILED_WRAPPER_ATTRIBUTE = "_orig_mod"

#: The attributes under which wrappers hold the module they wrap, and which module names therefore contain:
#: ``torch.compile``'s ``OptimizedModule``, FSDP1's ``FullyShardedDataParallel`` (``_fsdp_wrapped_module``, as
#: ``torch.distributed.fsdp._common_utils.FSDP_WRAPPED_MODULE``) and activation checkpointing's
#: ``CheckpointWrapper`` (``_checkpoint_wrapped_module``, ``torch.distributed.algorithms._checkpoint.
#: checkpoint_wrapper._CHECKPOINT_WRAPPED_MODULE``). A plan names modules without them.
WRAPPER_ATTRIBUTES: frozenset[str] = frozenset({COMPILED_WRAPPER_ATTRIBUTE, "_fsdp_wrapped_module",
                                                "_checkpoint_wrapped_module"})


def _fsdp2_module() -> type[Any] | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    return FSDPModule  # type: ignore[no-any-return]


#: The class FSDP2's ``fully_shard`` mixes into every module it shards (``FSDP<Class>``), or ``None``.
FSDP2_MODULE: type[Any] | None = _fsdp2_module()


def fsdp2_policy_of(module: nn.Module) -> Any:
    """The ``MixedPrecisionPolicy`` an FSDP2 unit was sharded with (``FSDPState._mp_policy``)."""
    return module._get_fsdp_state()._mp_policy  # type: ignore[operator]


def set_fsdp2_policy(module: nn.Module, policy: Any) -> None:
    """Give an FSDP2 unit ``policy`` from its next unshard on, as if ``fully_shard`` had been given it: the state's
    and the parameter group's ``mp_policy``, and each sharded parameter's all-gather and reduce dtypes
    (``FSDPParamGroup._init_mp_dtypes``), dropping its all-gather buffers and unsharded parameter where the dtype
    changes. Call it between steps (while the unit holds its shards)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    state._mp_policy = policy
    group = state._fsdp_param_group
    if group is None:
        return
    missing = object()  # (before the unit's first forward its parameters have no dtypes yet: nothing to drop)
    before = [getattr(fsdp_param, "param_dtype", missing) for fsdp_param in group.fsdp_params]
    group.mp_policy = policy
    group._init_mp_dtypes()
    for fsdp_param, dtype in zip(group.fsdp_params, before, strict=True):
        if dtype is not missing and fsdp_param.param_dtype != dtype:
            # the all-gather buffers and the unsharded parameter were made in the old dtype at the first all-gather:
            # dropped, FSDP2 makes them again at the next one (FSDPParam.init_all_gather_outputs and
            # init_unsharded_param build them only where there are none)
            fsdp_param.all_gather_outputs = []
            fsdp_param._unsharded_inner_tensors = []
            if hasattr(fsdp_param, "_unsharded_param"):
                del fsdp_param._unsharded_param


def never_compile_as_frame(code: CodeType) -> None:
    """TorchDynamo traces ``code`` only when inlining a caller, never as a frame of its own
    (``torch._dynamo.eval_frame.skip_code``); nothing happens in a torch without it."""
    skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)
    if skip_code is not None:
        skip_code(code)


def dynamo_guards_module_hooks() -> AbstractContextManager[Any]:
    """Graphs compiled inside guard on the hooks of the modules they call
    (``torch._dynamo.config.skip_nnmodule_hook_guards=False``; by default Dynamo skips those guards)."""
    return torch._dynamo.config.patch(skip_nnmodule_hook_guards=False)


def dynamo_traces_rnn() -> bool:
    """Whether TorchDynamo traces recurrent modules (``torch._dynamo.config.allow_rnn``, off by default)."""
    return bool(torch._dynamo.config.allow_rnn)


def dynamo_disabled() -> AbstractContextManager[Any]:
    """Compiled code runs eagerly inside (``torch._dynamo.config.disable``): the fallback for a torch without the
    public ``torch.compiler.set_stance`` (before 2.6)."""
    return torch._dynamo.config.patch(disable=True)


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper of another module (``OptimizedModule``)."""
    return type(module).__name__ == "OptimizedModule" and hasattr(module, COMPILED_WRAPPER_ATTRIBUTE)


def has_compiled_forward(module: nn.Module) -> bool:
    """Whether ``module.forward`` was replaced by a compiled function (``module.forward = torch.compile(...)``:
    the function carries ``_torchdynamo_orig_callable``)."""
    return getattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable", None) is not None


# ------------------------------------------------------------------------------------------------------------ CPU
def cpu_feature_probe(name: str) -> Callable[[], bool] | None:
    """torch's own probe of a CPU feature (``torch.cpu._is_<name>_supported``, e.g. ``avx512_bf16``,
    ``amx_tile``), or ``None`` where this torch has none (callers then read ``/proc/cpuinfo``)."""
    probe = getattr(getattr(torch, "cpu", None), f"_is_{name}_supported", None)
    return probe if callable(probe) else None


# ----------------------------------------------------------------------------------------------------- dispatch
#: The base class of modes that see every aten op a step runs, after autograd and autocast
#: (``torch.utils._python_dispatch.TorchDispatchMode``: documented, but in a private module).
TORCH_DISPATCH_MODE: type[Any] = TorchDispatchMode


def in_backward() -> bool:
    """Whether the calling code runs inside the autograd engine, computing a backward node
    (``torch._C._current_autograd_node()`` is not ``None`` there)."""
    return torch._C._current_autograd_node() is not None
