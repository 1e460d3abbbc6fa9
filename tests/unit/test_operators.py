"""Operator discovery, classification and how each precision is lowered per operator and device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_comp import ConfigError
from lightning_comp.devices import Lowering
from lightning_comp.devices.lowering import lowering_for
from lightning_comp.numerics import ComputePrecision
from lightning_comp.operators import OperatorKind, discover_operators, register_atomic
from lightning_comp.operators import kinds as ops_mod
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.operators.kinds import classify


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))  # a parameter next to a child: the block is not an operator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class _Scale(nn.Module):  # a user-defined leaf with parameters
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(10, 4),
        nn.LSTM(4, 4),
        nn.MultiheadAttention(4, 2),
        nn.Sequential(nn.Conv1d(4, 4, 1), nn.BatchNorm1d(4), nn.GELU()),
        nn.Flatten(),
        _Block(),
        _Scale(),
    )


def test_discover_lists_leaves_and_atomic_modules_only() -> None:
    infos = discover_operators(_model())
    assert [i.name for i in infos] == ["0", "1", "2", "3.0", "3.1", "3.2", "4", "5.proj", "6"]
    by_name = {i.name: i for i in infos}
    assert by_name["2"].type_name == "MultiheadAttention"  # its out_proj child is not an operator
    assert by_name["2"].num_params == sum(p.numel() for p in nn.MultiheadAttention(4, 2).parameters())
    assert by_name["1"].kind is OperatorKind.COMPUTE
    assert by_name["0"].kind is OperatorKind.EMBEDDING
    assert by_name["3.1"].kind is OperatorKind.NORM
    assert by_name["3.2"].kind is OperatorKind.ELEMENTWISE
    assert by_name["4"].kind is OperatorKind.SHAPE and not by_name["4"].lowerable
    assert by_name["6"].kind is OperatorKind.OTHER and by_name["6"].num_params == 4
    assert all(i.lowerable for i in infos if i.name != "4")


def test_operators_follow_named_modules_order_and_skip_containers() -> None:
    model = _model()
    names = [n for n, _ in iter_operators(model)]
    order = [n for n, _ in model.named_modules()]
    assert names == sorted(names, key=order.index)
    assert "3" not in names and "5" not in names and "" not in names


@pytest.mark.parametrize("root", [nn.Linear(3, 3), nn.LSTM(3, 3), nn.MultiheadAttention(4, 2)])
def test_root_operator_is_named_empty_and_has_no_children_operators(root: nn.Module) -> None:
    # A bare atomic module used as the whole model: its children (e.g. MHA.out_proj) must not become operators.
    assert [i.name for i in discover_operators(root)] == [""]


def test_register_atomic_makes_a_block_one_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops_mod, "_ATOMIC_TYPES", set(ops_mod._ATOMIC_TYPES))  # do not leak the registration
    model = nn.Sequential(_Block(), nn.ReLU())
    assert [i.name for i in discover_operators(model)] == ["0.proj", "1"]
    assert register_atomic(_Block) is _Block  # usable as a decorator
    infos = discover_operators(model)
    assert [i.name for i in infos] == ["0", "1"]
    assert infos[0].num_params == 4 * 4 + 4 + 4
    assert infos[0].kind is OperatorKind.OTHER


@pytest.mark.parametrize("bad", [int, nn.Linear(2, 2), "Linear"])
def test_register_atomic_rejects_non_module_types(bad: object) -> None:
    with pytest.raises(ConfigError, match="torch.nn.Module subclass"):
        register_atomic(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("module", "kind"),
    [
        (nn.Linear(2, 2), OperatorKind.COMPUTE),
        (nn.Conv2d(2, 2, 1), OperatorKind.COMPUTE),
        (nn.ConvTranspose1d(2, 2, 1), OperatorKind.COMPUTE),
        (nn.GRU(2, 2), OperatorKind.COMPUTE),
        (nn.LayerNorm(2), OperatorKind.NORM),
        (nn.GroupNorm(1, 2), OperatorKind.NORM),
        (nn.BatchNorm2d(2), OperatorKind.NORM),
        (nn.EmbeddingBag(3, 2), OperatorKind.EMBEDDING),
        (nn.Softmax(-1), OperatorKind.ELEMENTWISE),
        (nn.Dropout(), OperatorKind.ELEMENTWISE),
        (nn.Identity(), OperatorKind.SHAPE),
        (nn.Unflatten(1, (2, 1)), OperatorKind.SHAPE),
        (_Scale(), OperatorKind.OTHER),
    ],
)
def test_classify(module: nn.Module, kind: OperatorKind) -> None:
    assert classify(module) is kind


BF16, FP16, FP32 = ComputePrecision.BF16, ComputePrecision.FP16, ComputePrecision.FP32


@pytest.mark.parametrize(
    ("module", "precision", "device", "expected"),
    [
        (nn.Linear(2, 2), FP32, "cpu", Lowering.NONE),
        (nn.Linear(2, 2), BF16, "cpu", Lowering.AUTOCAST),
        (nn.Linear(2, 2), FP16, "cuda", Lowering.AUTOCAST),
        (nn.Conv2d(2, 2, 1), BF16, "cpu", Lowering.AUTOCAST),
        (nn.MultiheadAttention(4, 2), BF16, "cpu", Lowering.AUTOCAST),
        (nn.LayerNorm(2), BF16, "cpu", Lowering.INPUT),  # CPU kernels take 16-bit input with FP32 affine params
        (nn.LayerNorm(2), BF16, "cuda", Lowering.PARAMS),  # CUDA LayerNorm needs matching dtypes
        (nn.BatchNorm1d(2), FP16, "cuda", Lowering.INPUT),  # never downcast BN statistics
        (nn.Embedding(3, 2), BF16, "cpu", Lowering.OUTPUT),
        (nn.GELU(), BF16, "cpu", Lowering.INPUT),
        (nn.Flatten(), BF16, "cpu", Lowering.NONE),
        (_Scale(), BF16, "cpu", Lowering.PARAMS),
    ],
)
def test_lowering_for(module: nn.Module, precision: ComputePrecision, device: str, expected: Lowering | None) -> None:
    assert lowering_for(module, precision, device) is expected


@pytest.mark.parametrize("module_type", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("precision", [BF16, FP16])
def test_recurrent_operators_lower_the_way_that_runs_on_this_device(module_type: type[nn.RNNBase],
                                                                    precision: ComputePrecision) -> None:
    """Recurrent lowering is probed, not assumed: whichever way is chosen runs here and computes in the dtype."""
    module = module_type(4, 4, batch_first=True)
    lowering = lowering_for(module, precision, "cpu")
    assert lowering in (Lowering.AUTOCAST, Lowering.PARAMS)
    x = torch.randn(2, 3, 4)
    if lowering is Lowering.AUTOCAST:
        with torch.autocast("cpu", dtype=precision.dtype):
            out = module(x)[0]
    else:
        copies = {n: p.to(precision.dtype) for n, p in module.named_parameters()}
        out = torch.func.functional_call(module, copies, (x.to(precision.dtype),))[0]
    assert out.dtype == precision.dtype
    if module_type is nn.GRU:  # on no CPU autocast list: autocast would compute it in fp32
        assert lowering is Lowering.PARAMS


def test_recurrent_lowering_falls_back_to_parameter_copies_where_autocast_cannot_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As on an AVX2-only CPU, where CPU autocast's BF16 LSTM raises a oneDNN error (pytorch/pytorch#88136)."""
    from lightning_comp.devices import kernel_probes

    real_run = kernel_probes._run

    def autocast_fails(module: nn.RNNBase, route: str, dtype: torch.dtype, device: torch.device) -> Any:
        if route == "autocast":
            raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")
        return real_run(module, route, dtype, device)

    monkeypatch.setattr(kernel_probes, "_run", autocast_fails)
    kernel_probes.probe_recurrent.cache_clear()  # type: ignore[attr-defined]
    try:
        assert lowering_for(nn.LSTM(2, 2), BF16, "cpu") is Lowering.PARAMS
        probe = kernel_probes.probe_recurrent(nn.LSTM(2, 2), BF16, "cpu")
        assert probe.route == "params" and probe.failures == (
            ("autocast", "RuntimeError: could not create a primitive descriptor for the LSTM forward propagation"
                         " primitive"),)
        monkeypatch.setattr(kernel_probes, "_run", lambda *a: (_ for _ in ()).throw(RuntimeError("no kernel")))
        kernel_probes.probe_recurrent.cache_clear()  # type: ignore[attr-defined]
        assert lowering_for(nn.LSTM(2, 2, num_layers=2), BF16, "cpu") is None
    finally:
        kernel_probes.probe_recurrent.cache_clear()  # type: ignore[attr-defined]


def test_names_and_types_hold_through_wrappers() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from lightning_comp.operators.discovery import operator_name
    from lightning_comp.plan.fingerprint import OperatorFingerprint

    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    wrapped = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, nn.Linear))
    assert "0._checkpoint_wrapped_module" in dict(wrapped.named_modules())
    assert [n for n, _ in iter_operators(wrapped)] == ["0", "1", "2"]
    assert OperatorFingerprint.of(wrapped) == OperatorFingerprint.of(plain)
    assert operator_name("blocks.0._fsdp_wrapped_module._checkpoint_wrapped_module.attn") == "blocks.0.attn"


def test_an_fsdp2_policy_follows_the_plan_of_the_parameters_its_unit_manages() -> None:
    import torch

    from lightning_comp.distributed import fsdp2_policy

    block = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.LayerNorm(4))
    assert fsdp2_policy({"type:Linear": "bf16"}, block, "blocks.0").param_dtype is None  # the LayerNorm is fp32
    uniform = fsdp2_policy({"type:Linear": "bf16", "type:LayerNorm": "bf16"}, block, "blocks.0")
    assert (uniform.param_dtype, uniform.reduce_dtype, uniform.cast_forward_inputs) == (torch.bfloat16,
                                                                                        torch.float32, False)
    assert fsdp2_policy({"blocks.0.0": "fp16", "blocks.0.2": "fp16", "blocks.0.3": "fp16"}, block,
                        "blocks.0").param_dtype is torch.float16  # names are the model's, prefix included
    assert fsdp2_policy({"type:Linear": "bf16"}, nn.Sequential(nn.Linear(4, 4)), "").param_dtype is torch.bfloat16
    # an fp8 Linear beside bf16 operators: its weight is gathered in bf16 too (scaled to float8 at each call)
    assert fsdp2_policy({"blocks.0.0": "fp8", "blocks.0.2": "fp8-rowwise", "type:LayerNorm": "bf16"}, block,
                        "blocks.0").param_dtype is torch.bfloat16
