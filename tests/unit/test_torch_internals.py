"""Every private torch attribute the package touches, checked against the installed torch: an upgrade that renames or
moves one fails here, by name, instead of silently changing what a plan computes."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_comp.adapters import torch_internals as adapter
from lightning_comp.execution.compiled_regions import is_compiled
from lightning_comp.execution.saved_hooks import OuterHooks, take_back


def test_module_base_classes_are_those_of_the_convolutions_and_norms() -> None:
    assert all(issubclass(t, adapter.CONV_BASE) for t in (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d))
    assert all(issubclass(t, adapter.NORM_BASE) for t in (nn.BatchNorm1d, nn.BatchNorm2d, nn.InstanceNorm2d))
    assert issubclass(nn.BatchNorm2d, adapter.BATCH_NORM_BASE) and not issubclass(nn.InstanceNorm2d,
                                                                                   adapter.BATCH_NORM_BASE)


def test_an_rnn_points_at_its_own_parameters_again_after_a_swap() -> None:
    rnn = nn.LSTM(2, 2)
    with adapter.reparametrized(rnn, {n: p.to(torch.bfloat16) for n, p in rnn.named_parameters()}):
        assert rnn.weight_ih_l0.dtype == torch.bfloat16
    adapter.update_rnn_flat_weights(rnn)
    assert all(w is p for w, p in zip(rnn._flat_weights, rnn.parameters(), strict=True))
    out, _ = rnn(torch.ones(3, 1, 2))
    assert out.dtype == torch.float32


def test_tensor_base_and_version() -> None:
    base = torch.ones(4)
    view = base[1:3]
    assert adapter.tensor_base(view) is base and adapter.tensor_base(base) is base
    before = adapter.tensor_version(base)
    base.add_(1)
    assert adapter.tensor_version(base) == before + 1 and adapter.tensor_version(view) == before + 1


def test_storage_key_is_shared_by_views_and_tells_memoryless_storages_apart() -> None:
    base = torch.ones(4)
    assert adapter.storage_key(base[1:3]) == adapter.storage_key(base) == adapter.storage_key(base.view(2, 2))
    assert adapter.storage_key(base.clone()) != adapter.storage_key(base)
    meta = [torch.empty(3, device="meta") for _ in range(2)]
    assert meta[0].untyped_storage().data_ptr() == meta[1].untyped_storage().data_ptr() == 0  # why data_ptr won't do
    assert adapter.storage_key(meta[0]) != adapter.storage_key(meta[1])


def test_grad_scaler_scale_is_the_scale_tensor_updated_in_place() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert adapter.grad_scaler_scale(scaler) is None  # before the first scale()
    scaler.scale(torch.ones(()))
    scale = adapter.grad_scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor) and float(scale) == scaler.get_scale() == 8.0
    assert adapter.grad_scaler_scale(torch.amp.GradScaler("cpu", enabled=False)) is None


def test_a_reparametrized_module_computes_with_the_given_tensors_and_gets_its_own_back() -> None:
    layer = nn.Linear(2, 1, bias=False)
    weight = layer.weight
    with adapter.reparametrized(layer, {"weight": torch.zeros(1, 2)}):
        assert float(layer(torch.ones(1, 2))) == 0.0
    assert layer.weight is weight


def test_saved_tensor_hooks_in_force_are_seen_and_handed_on() -> None:
    # the query itself, not the adapter's fallback for a torch without it (which always answers True)
    assert callable(getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None))
    assert adapter.saved_tensors_hooks_enabled()
    with torch.autograd.graph.disable_saved_tensors_hooks("a region of torch's own"):
        assert not adapter.saved_tensors_hooks_enabled()
    assert adapter.top_saved_tensors_hooks() is None
    packed: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> Any:
        packed.append(tensor)
        return ("outer", tensor)

    def unpack(saved: Any) -> torch.Tensor:
        return saved[1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        hooks = adapter.top_saved_tensors_hooks()
        assert hooks is not None and hooks[0] is pack and hooks[1] is unpack
        outer = OuterHooks()
        tensor = torch.ones(2)
        assert take_back(outer.hand_on(tensor)) is tensor and packed == [tensor]
    assert take_back(OuterHooks().hand_on(tensor)) is tensor  # no outer hooks: kept as it is


def test_the_functional_autocast_pair_enters_and_leaves_a_region() -> None:
    assert adapter.ENTER_AUTOCAST is torch.amp.autocast_mode._enter_autocast
    assert adapter.EXIT_AUTOCAST is torch.amp.autocast_mode._exit_autocast
    mode = adapter.ENTER_AUTOCAST("cpu", torch.bfloat16, True, False)
    try:
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    finally:
        adapter.EXIT_AUTOCAST(mode)
    assert not torch.is_autocast_enabled("cpu")


def test_dynamo_settings_the_package_reads_and_patches() -> None:
    def code() -> None:
        return None

    # the function itself, not the adapter's silent fallback for a torch without it
    assert callable(getattr(torch._dynamo.eval_frame, "skip_code", None))
    adapter.never_compile_as_frame(code.__code__)
    assert torch._dynamo.config.skip_nnmodule_hook_guards
    with adapter.dynamo_guards_module_hooks():
        assert not torch._dynamo.config.skip_nnmodule_hook_guards
    assert torch._dynamo.config.skip_nnmodule_hook_guards
    assert adapter.dynamo_traces_rnn() is bool(torch._dynamo.config.allow_rnn)
    with adapter.dynamo_disabled():
        assert torch._dynamo.config.disable


def test_compiled_modules_and_forwards_are_recognised() -> None:
    plain = nn.Sequential(nn.Linear(2, 2))
    compiled = torch.compile(nn.Linear(2, 2))
    assert adapter.is_compiled_module(compiled) and not adapter.is_compiled_module(plain)
    assert getattr(compiled, adapter.COMPILED_WRAPPER_ATTRIBUTE) is not None
    module = nn.Linear(2, 2)
    module.forward = torch.compile(module.forward)  # type: ignore[method-assign]
    assert adapter.has_compiled_forward(module) and not adapter.has_compiled_forward(plain)
    # what the plugin asks: compiled for fit (Lightning unwraps it), a compiled submodule, or a compiled forward
    assert not is_compiled(plain) and is_compiled(nn.Sequential(compiled)) and is_compiled(module)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

    from lightning.pytorch.utilities.compile import _maybe_unwrap_optimized

    assert is_compiled(_maybe_unwrap_optimized(torch.compile(Module()))) and not is_compiled(Module())


@pytest.mark.parametrize("feature", ["avx2", "avx512", "avx512_bf16", "amx_tile", "amx_fp16"])
def test_torch_probes_each_cpu_feature(feature: str) -> None:
    probe = adapter.cpu_feature_probe(feature)
    assert probe is not None, f"torch.cpu._is_{feature}_supported is gone: /proc/cpuinfo answers instead"
    assert isinstance(probe(), bool)
    assert adapter.cpu_feature_probe("no_such_feature") is None


@pytest.mark.parametrize("name", adapter.__all__)
def test_every_adapter_symbol_is_exported(name: str) -> None:
    symbol = getattr(adapter, name)
    assert symbol is not None
    if callable(symbol) and not isinstance(symbol, type):
        assert symbol.__doc__ or symbol in (adapter.ENTER_AUTOCAST, adapter.EXIT_AUTOCAST)


def test_the_dispatch_mode_sees_aten_ops_and_backward_is_told_apart() -> None:
    seen: list[tuple[str, bool]] = []

    class Mode(adapter.TORCH_DISPATCH_MODE):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append((func.overloadpacket.__name__, adapter.in_backward()))
            return func(*args, **(kwargs or {}))

    weight = torch.randn(3, 2, requires_grad=True)
    with Mode():
        (torch.randn(4, 3) @ weight).sum().backward()
    assert ("mm", False) in seen and ("mm", True) in seen  # the forward matmul, and backward's
    assert not adapter.in_backward()


def test_the_wrapper_attributes_are_torchs_own() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_WRAPPED_MODULE
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._common_utils import FSDP_WRAPPED_MODULE

    assert {"_orig_mod", FSDP_WRAPPED_MODULE, _CHECKPOINT_WRAPPED_MODULE} == adapter.WRAPPER_ATTRIBUTES
    assert adapter.FSDP2_MODULE is FSDPModule


def test_a_cast_and_the_reshapes_are_told_by_their_autograd_nodes() -> None:
    leaf = torch.ones(2, 3, requires_grad=True)
    out = leaf * 2
    cast = out.to(torch.bfloat16)
    assert cast.grad_fn is not None and adapter.is_cast_node(cast.grad_fn)
    assert out.grad_fn is not None and not adapter.is_cast_node(out.grad_fn)
    matmul = torch.matmul(torch.ones(2, 3, 4, requires_grad=True), torch.ones(4, 5))  # a reshape of its own
    for reshaped in (out.view(6), out.reshape(3, 2), out.flatten(), matmul):
        assert reshaped.grad_fn is not None and adapter.is_reshape_node(reshaped.grad_fn), reshaped.grad_fn
    for other in (out.t(), out[:, 1:], cast):
        assert other.grad_fn is not None and not adapter.is_reshape_node(other.grad_fn)


@pytest.mark.parametrize("view", [
    lambda w: w.to(torch.bfloat16), lambda w: w.t(), lambda w: w.view(6), lambda w: w.transpose(0, 1),
    lambda w: w.permute(1, 0), lambda w: w.expand(2, 2, 3), lambda w: w.unsqueeze(0), lambda w: w.squeeze(),
    lambda w: w.squeeze(0), lambda w: torch.ops.aten.alias(w), lambda w: w[:, 1:], lambda w: w[0],
    lambda w: w.reshape(3, 2),
    lambda w: w.as_strided((2,), (1,)),
], ids=["cast", "t", "view", "transpose", "permute", "expand", "unsqueeze", "squeeze", "squeeze_dim", "alias",
        "slice", "select", "reshape", "as_strided"])
def test_views_and_casts_of_a_parameter_lead_to_its_gradient_accumulator(view: Any) -> None:
    weight = nn.Parameter(torch.ones(2, 3))
    made = view(weight)
    node = made.grad_fn
    assert node is not None and adapter.is_view_or_cast_node(node), node
    inputs = [n for n, _ in adapter.node_inputs(node) if n is not None]
    assert len(inputs) == 1 and adapter.is_gradient_accumulator(inputs[0])
    assert not adapter.is_view_or_cast_node(inputs[0]) and not adapter.is_gradient_accumulator(node)
    assert not adapter.is_view_or_cast_node((weight * 2).grad_fn)  # type: ignore[arg-type]


def test_an_output_is_found_from_its_node_and_the_node_keyed_without_keeping_it() -> None:
    x = torch.ones(4, requires_grad=True)
    first, second = (x * 2).split(2)
    node, index = adapter.autograd_output(second)
    assert node is second.grad_fn and index == 1 and adapter.autograd_output(first) == (first.grad_fn, 0)
    assert adapter.autograd_output(x) == (None, 0)
    edge_node, edge_index = adapter.node_inputs(torch.ones(2).mul(second).grad_fn)[1]  # type: ignore[arg-type]
    assert edge_node is node and edge_index == 1
    keys = [adapter.node_key(t.grad_fn) for t in (x * 1, x * 2)]  # type: ignore[arg-type]
    assert isinstance(keys[0], int) and keys[0] != keys[1]
    assert adapter.node_key(node) == adapter.node_key(second.grad_fn)  # type: ignore[arg-type]


def test_the_fsdp2_internals_a_policy_change_writes_exist() -> None:
    """``set_fsdp2_policy`` writes ``FSDPState._mp_policy``, ``FSDPParamGroup.mp_policy`` and re-runs its
    ``_init_mp_dtypes``, dropping ``FSDPParam.all_gather_outputs``/``_unsharded_param``/``_unsharded_inner_tensors``.
    (It runs for real, policies changing between trials, in ``tests/integration/test_search_sharded.py``.)"""
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group, _fsdp_state

    assert "_mp_policy" in inspect.getsource(_fsdp_state.FSDPState.__init__) or "_mp_policy" in inspect.getsource(
        _fsdp_state.FSDPState)
    group = inspect.getsource(_fsdp_param_group.FSDPParamGroup)
    assert "def _init_mp_dtypes" in group and "self.mp_policy" in group
    param = inspect.getsource(_fsdp_param.FSDPParam)
    for attribute in ("all_gather_outputs", "_unsharded_param", "_unsharded_inner_tensors", "def init_dtype_attrs"):
        assert attribute in param, attribute
