"""PlanExecutor: per-operator precision through hooks, cast boundaries, calibration, robustness.

These tests drive the executor directly (no Trainer); ``test_plugin.py`` repeats the key checks on the Trainer path.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections import namedtuple
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from lightning_comp import PlanError, PlanMismatchError, PrecisionPlan
from lightning_comp.common.nested import cast_floating
from lightning_comp.devices.lowering import Lowering, lowering_for
from lightning_comp.execution import PlanExecutor, StepKind
from lightning_comp.numerics import ComputePrecision
from lightning_comp.operators.kinds import register_atomic

BF16, FP32 = torch.bfloat16, torch.float32


def _apply(model: nn.Module, mapping: dict[str, Any] | None = None, default: str = "fp32") -> PlanExecutor:
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict(mapping or {}, default=default))
    return executor


def _train_step(executor: PlanExecutor, model: nn.Module, *inputs: Any, kind: StepKind = StepKind.TRAIN) -> Any:
    """One step of ``kind``: forward inside the step context, loss inside too (as in a LightningModule)."""
    with executor.step(kind):
        out = model(*inputs)
        loss = out.float().square().mean() if isinstance(out, torch.Tensor) else None
    return out, loss


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# ------------------------------------------------------------------------------------------- cast boundaries
def test_low_run_stays_low_and_only_the_last_output_returns_to_fp32(dtype_recorder: Any) -> None:
    model = _mlp()
    executor = _apply(model, default="bf16")
    dtype_recorder.attach(model)
    x = torch.randn(3, 4)
    _, loss = _train_step(executor, model, x)  # calibration step: every output cast back, compute already bf16
    assert [c.outputs for c in dtype_recorder.calls] == [[FP32], [FP32], [FP32]]
    assert all(r.inputs == [BF16, BF16, BF16] for r in dtype_recorder.ops if r.op == "addmm")
    assert executor.chained_operators(StepKind.TRAIN) == frozenset({"0", "1"})
    dtype_recorder.clear()
    with executor.step(StepKind.TRAIN), dtype_recorder:
        out = model(x)
        loss = nn.functional.mse_loss(out, torch.zeros_like(out))
    calls = {c.module: c for c in dtype_recorder.calls}
    assert calls["0"].inputs == [FP32] and calls["0"].outputs == [BF16]
    assert calls["1"].inputs == [BF16] and calls["1"].outputs == [BF16]  # the middle tensors are bf16
    assert calls["2"].inputs == [BF16] and calls["2"].outputs == [FP32]  # only the last output returns to fp32
    assert out.dtype == FP32 and loss.dtype == FP32  # the loss sees fp32
    mse = [r for r in dtype_recorder.ops if r.op == "mse_loss"]
    assert mse and mse[0].inputs == [FP32, FP32]
    casts = [r for r in dtype_recorder.ops if r.op == "_to_copy" and r.inputs == [BF16]]
    assert [r.module for r in casts] == ["2"]  # exactly one cast back, at the end of the run
    loss.backward()
    assert all(p.dtype == FP32 and p.grad is not None and p.grad.dtype == FP32 for p in model.parameters())


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.d = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = self.b(h) + h  # residual add: a functional op outside any operator
        h = self.c(h).view(-1, 16)  # .view on c's output: only re-views it for d
        return self.d(h) + h.sum()  # ... and a functional op outside any operator reads the view


class _Heads(nn.Module):
    """A projection whose output is split into heads and permuted before an operator of its precision consumes it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.mix = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.proj(x).view(-1, 4, 2).permute(1, 0, 2).unbind(0)
        return self.mix(heads[0]).transpose(0, 1)


class _GatedMLP(nn.Module):
    """litgpt's ``LLaMAMLP``: a gated product computed in the model's own code between three projections."""

    def __init__(self, act: Any = nn.functional.silu, down: bool = True) -> None:
        super().__init__()
        self.act, self.down = act, down
        self.fc_1 = nn.Linear(4, 8)
        self.fc_2 = nn.Linear(4, 8)
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc_1(x)) * self.fc_2(x)
        return self.proj(h) if self.down else h


def test_a_gated_product_between_operators_of_one_precision_computes_low_as_under_autocast(
        dtype_recorder: Any) -> None:
    torch.manual_seed(0)
    model = _GatedMLP()
    plain = copy.deepcopy(model)
    executor = _apply(model, default="bf16")
    x = torch.randn(3, 4)
    _train_step(executor, model, x)
    # silu and the product only carry fc_1's and fc_2's outputs on to proj, an operator of their precision
    assert executor.chained_operators(StepKind.TRAIN) == frozenset({"fc_1", "fc_2"})
    dtype_recorder.attach(model)
    with executor.step(StepKind.TRAIN), dtype_recorder:
        out = model(x)
    between = [r for r in dtype_recorder.ops if r.module is None and r.op in ("silu", "mul")]
    assert [r.op for r in between] == ["silu", "mul"]
    assert all(r.inputs == [BF16] * len(r.inputs) and r.outputs == [BF16] for r in between)
    assert not [r for r in dtype_recorder.ops if r.op == "_to_copy" and r.module is None]  # no cast between them
    assert out.dtype == FP32  # proj's output is read outside: fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = plain(x)  # AMP: the same dtypes op by op
    torch.testing.assert_close(out, reference.float(), rtol=0, atol=0)
    out.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == FP32 for p in model.parameters())


@pytest.mark.parametrize(("case", "mapping"), [
    ("an fp32 projection feeds the product", {"fc_2": "fp32"}),
    ("the product is the model's output", {}),
    ("an in-place activation", {}),
    ("an activation autocast runs in fp32", {}),
])
def test_a_gated_product_consumes_its_inputs_where_it_cannot_compute_low(dtype_recorder: Any, case: str,
                                                                        mapping: dict[str, str]) -> None:
    act = {"an in-place activation": lambda t: nn.functional.silu(t, inplace=True),
           "an activation autocast runs in fp32": torch.exp}.get(case, nn.functional.silu)
    model = _GatedMLP(act, down=case != "the product is the model's output")
    executor = _apply(model, mapping, default="bf16")
    x = torch.randn(3, 4)
    _train_step(executor, model, x)
    assert not executor.chained_operators(StepKind.TRAIN) & {"fc_1", "fc_2"}, case
    dtype_recorder.attach(model)
    with executor.step(StepKind.TRAIN), dtype_recorder:
        out = model(x)
    assert [r for r in dtype_recorder.ops if r.module is None and r.op == "mul"][0].inputs == [FP32, FP32], case
    assert out.dtype == FP32


def test_escapes_through_functional_ops_return_to_fp32(dtype_recorder: Any) -> None:
    model = _Residual()
    executor = _apply(model, default="bf16")
    x = torch.randn(8, 4)
    _train_step(executor, model, x)
    assert executor.chained_operators(StepKind.TRAIN) == frozenset()  # every output meets a functional op
    dtype_recorder.attach(model)
    with executor.step(StepKind.TRAIN), dtype_recorder:
        out = model(x)
    assert all(c.outputs == [FP32] for c in dtype_recorder.calls)
    adds = [r for r in dtype_recorder.ops if r.op == "add" and r.module is None]
    views = [r for r in dtype_recorder.ops if r.op == "view" and r.module is None]
    assert adds and adds[0].inputs == [FP32, FP32]
    assert views and views[0].inputs == [FP32]  # the view is read outside: c's output returned to fp32 before it
    assert out.dtype == FP32


def test_views_between_two_operators_of_one_precision_keep_the_output_low(dtype_recorder: Any) -> None:
    model = _Heads()
    executor = _apply(model, default="bf16")
    x = torch.randn(3, 4)
    _train_step(executor, model, x)
    # view, permute, unbind and indexing only re-view proj's output: it stays bf16 into mix
    assert executor.chained_operators(StepKind.TRAIN) == frozenset({"proj"})
    dtype_recorder.attach(model)
    with executor.step(StepKind.TRAIN), dtype_recorder:
        out = model(x)
    assert dtype_recorder.ops_of("mix", "mm", "addmm")[0].inputs[:2] == [BF16, BF16]
    assert not [r for r in dtype_recorder.ops if r.op == "_to_copy" and r.module is None]  # no cast between them
    assert out.dtype == FP32  # mix's output is read outside (transpose, then returned): fp32


def test_fp32_operator_computes_in_fp32_when_its_input_arrives_low(dtype_recorder: Any) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    executor = _apply(model, {"0": "bf16"})  # 1 and 2 stay fp32
    dtype_recorder.attach(model)
    x_low = torch.randn(3, 4, dtype=BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            dtype_recorder.clear()
            with executor.step(StepKind.TRAIN), dtype_recorder:
                out = model(x_low)  # user hands in bf16: the bf16 operator takes it, the fp32 ones must not
    assert [r.inputs for r in dtype_recorder.ops_of("0", "addmm")] == [[BF16, BF16, BF16]]
    assert dtype_recorder.ops_of("1", "native_layer_norm")[0].inputs == [FP32, FP32, FP32]
    assert dtype_recorder.ops_of("2", "addmm")[0].inputs == [FP32, FP32, FP32]
    assert out.dtype == FP32
    # The same fp32 operator fed directly with bf16 (no low operator upstream) upcasts too.
    head = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    executor2 = _apply(head, {"0": "bf16"})
    with executor2.step(StepKind.TRAIN):
        assert head[1](torch.randn(2, 4, dtype=BF16)).dtype == FP32


def test_fp32_operators_that_change_nothing_carry_no_hooks_after_the_calibrating_step(dtype_recorder: Any) -> None:
    """Hooks cost every module call its fast path: an fp32 operator keeps them only where they do something."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.ReLU()  # fp32 after a bf16 Linear: it receives fp32 (the Linear's output returns)
            self.flat = nn.Flatten()  # shape-only: kept, lowered outputs stay low through it
            self.side = nn.Linear(4, 4)  # fp32, fed the user's own bf16 tensor: keeps its input cast
            self.head = nn.Linear(4, 2)  # fp32: changes nothing

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.flat(self.act(self.fc(x)))) + self.side(x.bfloat16()).sum()

    model = Net()
    executor = _apply(model, {"fc": "bf16"})
    assert executor.hooked_operators() == {"fc", "act", "flat", "side", "head"}  # until a step calibrates
    x = torch.randn(3, 4)
    first, _ = _train_step(executor, model, x)  # the first step traces and calibrates
    assert executor.hooked_operators() == {"fc", "flat", "side"} and executor.num_hooks == 6
    dtype_recorder.attach(model)
    with executor.step(StepKind.TRAIN), dtype_recorder:
        second = model(x)
    assert torch.equal(first, second)  # the same numbers with fewer hooks
    assert dtype_recorder.ops_of("side", "addmm")[0].inputs == [FP32, FP32, FP32]  # still cast back to fp32
    assert dtype_recorder.ops_of("fc", "addmm")[0].inputs == [BF16, BF16, BF16]
    # a kind of step not calibrated yet runs with every operator hooked, then prunes again
    with executor.step(StepKind.VALIDATION):
        assert executor.hooked_operators() == {"fc", "act", "flat", "side", "head"}
        model(x)
    assert executor.hooked_operators() == {"fc", "flat", "side"}
    # re-applying the plan keeps the calibration: pruned at once
    executor.apply(model, executor.plan)
    assert executor.hooked_operators() == {"fc", "flat", "side"}


def test_transparent_shape_operator_passes_low_tensors_on(dtype_recorder: Any) -> None:
    model = nn.Sequential(nn.Conv1d(2, 2, 1), nn.Flatten(), nn.Linear(8, 2))
    executor = _apply(model, {"0": "bf16", "2": "bf16"})  # the Flatten is fp32 by default: no arithmetic anyway
    x = torch.randn(3, 2, 4)
    _train_step(executor, model, x)
    assert executor.chained_operators(StepKind.TRAIN) == frozenset({"0"})
    dtype_recorder.attach(model)
    with executor.step(StepKind.TRAIN), dtype_recorder:
        model(x).sum()
    calls = {c.module: c for c in dtype_recorder.calls}
    assert calls["1"].inputs == [BF16] and calls["1"].outputs == [BF16]
    assert calls["2"].outputs == [FP32]


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.act(self.lin(x)))  # the same operator twice per step


def test_operator_called_twice_per_step_returns_fp32_when_one_call_leaves_the_step() -> None:
    model = _Shared()
    executor = _apply(model, default="bf16")
    x = torch.randn(2, 4)
    for kind in (StepKind.PREDICT, StepKind.TRAIN):
        for _ in range(3):
            with executor.step(kind):
                out = model(x)  # returned as is (predict_step style): nothing consumes it inside the step
            assert out.dtype == FP32
        assert "lin" not in executor.chained_operators(kind)
        assert "act" in executor.chained_operators(kind)  # act feeds lin: may stay bf16
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    assert hooks == executor.num_hooks == 4  # one pre/post pair per operator, however often it is called
    out.float().sum().backward()
    assert model.lin.weight.grad is not None and model.lin.weight.grad.dtype == FP32


def test_predict_style_output_of_a_chained_run_is_fp32() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    executor = _apply(model, default="bf16")
    for _ in range(3):
        with torch.inference_mode(), executor.step(StepKind.PREDICT):
            out = model(torch.randn(2, 4))
        assert out.dtype == FP32


def test_calibration_is_per_step_kind_and_outside_steps_everything_returns_fp32() -> None:
    model = _mlp()
    executor = _apply(model, default="bf16")
    x = torch.randn(2, 4)
    _train_step(executor, model, x)
    assert executor.chained_operators(StepKind.VALIDATION) == frozenset()
    with torch.no_grad():
        _train_step(executor, model, x, kind=StepKind.VALIDATION)
    assert executor.chained_operators(StepKind.VALIDATION) == frozenset({"0", "1"})
    # Outside any step (a user calling the model in a callback) nothing is chained: all outputs come back fp32.
    out = model[1](model[0](x))
    assert out.dtype == FP32


def test_calibration_step_does_not_keep_activations_alive() -> None:
    # The first step of each kind traces which operator consumes which output; it must not hold those outputs
    # until the step ends (that raised the first step's peak by 150-200 MiB on the benchmark GPT and CNN).
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))
    executor = _apply(model, default="bf16")
    refs: list[Any] = []
    for layer in list(model)[:-1]:
        layer.register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out)))
    with torch.no_grad(), executor.step(StepKind.VALIDATION):
        out = model(torch.randn(8, 64))
        assert len(refs) == 5 and all(ref() is None for ref in refs)  # consumed, no grad graph: freed at once
    assert out.dtype == FP32
    assert executor.chained_operators(StepKind.VALIDATION) == frozenset(str(i) for i in range(5))


# ---------------------------------------------------------------------------------------- operator families
def test_lstm_tuple_output_with_fp32_state_and_low_input(dtype_recorder: Any) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.lstm = nn.LSTM(4, 6, batch_first=True)
            self.head = nn.Linear(6, 2)

        def forward(self, tokens: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            out, (h, c) = self.lstm(self.emb(tokens), state)
            return self.head(out[:, -1]) + h[-1].sum()

    model = Net()
    executor = _apply(model, {"emb": "bf16", "lstm": "bf16"})
    tokens = torch.randint(0, 10, (3, 5))
    state = (torch.zeros(1, 3, 6), torch.zeros(1, 3, 6))  # fp32 state next to a bf16 input
    _train_step(executor, model, tokens, state)
    assert executor.chained_operators(StepKind.TRAIN) == frozenset({"emb"})
    dtype_recorder.attach(model)
    with executor.step(StepKind.TRAIN), dtype_recorder:
        out = model(tokens, state)
        out.sum().backward()
    rnn = dtype_recorder.ops_of("lstm", "mkldnn_rnn_layer", "mm", "addmm")  # autocast, or bf16 parameter copies
    assert rnn and all(d == BF16 for d in rnn[0].inputs)
    lstm_call = dtype_recorder.calls_of("lstm")[0]
    # autocast takes the fp32 state as it is; parameter copies (where CPU autocast has no bf16 LSTM) cast it too
    state_dtype = FP32 if lowering_for(model.lstm, ComputePrecision.BF16, "cpu") is Lowering.AUTOCAST else BF16
    assert lstm_call.inputs == [BF16, state_dtype, state_dtype]
    assert lstm_call.outputs == [FP32, FP32, FP32]  # (out, (h, c)) handed on in fp32
    assert dtype_recorder.ops_of("head", "addmm")[0].inputs == [FP32, FP32, FP32]
    assert all(p.grad is not None and p.grad.dtype == FP32 for p in model.parameters())


def test_gru_runs_with_low_precision_parameter_copies(dtype_recorder: Any) -> None:
    reference = nn.GRU(4, 5, batch_first=True)
    model = nn.Sequential(nn.GRU(4, 5, batch_first=True))
    model[0].load_state_dict(reference.state_dict())
    params_before = {n: p for n, p in model.named_parameters()}
    executor = _apply(model, default="bf16")
    x = torch.randn(2, 3, 4)
    dtype_recorder.attach(model)
    with executor.step(StepKind.TRAIN), dtype_recorder:
        out, h = model(x)
    matmuls = [r for r in dtype_recorder.ops_of("0") if r.op in ("mm", "addmm")]
    assert matmuls and all(d == BF16 for r in matmuls for d in r.inputs)
    assert out.dtype == FP32 and h.dtype == FP32
    # The FP32 master parameters are untouched objects, get FP32 gradients, and are back in place after the call.
    assert {n: p for n, p in model.named_parameters()} == params_before
    assert all(p.dtype == FP32 for p in model.parameters())
    out.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == FP32 for p in model.parameters())
    ref_out, _ = reference(x)
    rel = (out - ref_out).norm() / ref_out.norm()
    assert 0 < rel < 0.05  # bf16 numerics, not fp32, and not garbage


def test_batchnorm_low_input_keeps_fp32_statistics_in_train_and_eval() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    executor = _apply(model, default="bf16")
    x = torch.randn(16, 4) * 3 + 1
    for _ in range(2):
        _train_step(executor, model, x)
    bn = model[1]
    assert bn.running_mean.dtype == FP32 and bn.running_var.dtype == FP32 and bn.weight.dtype == FP32
    assert int(bn.num_batches_tracked) == 2 and bn.running_mean.abs().sum() > 0
    model.eval()
    before = bn.running_mean.clone()
    with torch.no_grad():
        for _ in range(2):
            out, _ = _train_step(executor, model, x, kind=StepKind.VALIDATION)
    assert out.dtype == FP32 and torch.isfinite(out).all()
    assert torch.equal(bn.running_mean, before)  # eval mode does not update the statistics


class _Boom(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in forward")


class _BoomParams(nn.Module):  # a PARAMS-lowered leaf whose forward fails
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight.dtype == BF16
        raise RuntimeError("boom with swapped params")


@pytest.mark.parametrize("bad", [_Boom(4, 4), _BoomParams()])
def test_exception_inside_hooked_forward_restores_state(bad: nn.Module) -> None:
    model = nn.Sequential(nn.Linear(4, 4), bad)
    weight = bad.weight
    executor = _apply(model, default="bf16")
    for _ in range(2):  # once during calibration, once after
        with pytest.raises(RuntimeError, match="boom"), executor.step(StepKind.TRAIN):
            model(torch.randn(2, 4))
        assert not torch.is_autocast_enabled("cpu")  # the autocast region was exited
        assert bad.weight is weight and bad.weight.dtype == FP32  # parameter copies were swapped back
        assert executor._step_state.tracer is None  # no calibration is left running
    model[1] = nn.Identity()  # the model is still usable
    executor.apply(model, PrecisionPlan.from_dict({"0": "bf16"}))
    out, _ = _train_step(executor, model, torch.randn(2, 4))
    assert out.dtype == FP32


class _KwargsLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, flag: bool = False) -> torch.Tensor:
        assert x.dtype == scale.dtype == self.weight.dtype == BF16
        return x * self.weight * scale


def test_operators_called_with_keyword_arguments() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(4, 2, batch_first=True)
            self.leaf = _KwargsLeaf()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.mha(query=x, key=x, value=x, need_weights=False)[0]
            return self.leaf(y, scale=torch.full((4,), 2.0), flag=True)

    model = Net()
    executor = _apply(model, default="bf16")
    for _ in range(2):
        out, loss = _train_step(executor, model, torch.randn(2, 3, 4))
        assert out.dtype == FP32
    assert executor.chained_operators(StepKind.TRAIN) == frozenset({"mha"})
    loss.backward()
    assert model.leaf.weight.grad is not None and model.leaf.weight.grad.dtype == FP32


# ---------------------------------------------------------------------------------------------- lifecycle
def test_apply_is_idempotent_and_remove_restores_the_model(hook_count: Any) -> None:
    model = _mlp()
    executor = PlanExecutor()
    plan = PrecisionPlan.from_dict({"type:Linear": "bf16"})
    for _ in range(3):
        bound = executor.apply(model, plan)
        assert hook_count(model) == executor.num_hooks == 6
    assert bound.fingerprint is not None and executor.plan == bound and executor.model is model
    assert executor.precisions() == {"0": ComputePrecision.BF16, "1": ComputePrecision.FP32, "2": ComputePrecision.BF16}
    executor.remove()
    assert hook_count(model) == 0 and executor.plan is None
    x = torch.randn(2, 4)
    assert model(x).dtype == FP32


def test_all_fp32_plan_registers_no_hooks_and_is_bit_exact(hook_count: Any) -> None:
    model = _mlp()
    x = torch.randn(5, 4)
    expected = model(x)
    executor = _apply(model)
    assert hook_count(model) == 0 and executor.num_hooks == 0
    with executor.step(StepKind.TRAIN):
        assert torch.equal(model(x), expected)


def test_plan_for_another_model_is_rejected() -> None:
    plan = PrecisionPlan.for_model(_mlp(), {"type:Linear": "bf16"})
    with pytest.raises(PlanMismatchError, match="different model"):
        PlanExecutor().apply(nn.Sequential(nn.Linear(4, 2)), plan)
    with pytest.raises(PlanMismatchError, match="match no operator|matches no operator"):
        PlanExecutor().apply(_mlp(), PrecisionPlan.from_dict({"9": "bf16"}))


def test_operators_without_a_kernel_on_the_device_fail_before_any_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no way of lowering a recurrent operator runs (autocast and parameter copies both fail on a tiny copy),
    applying the plan fails at once, naming each operator, its precision, the device, what each way raised (the
    underlying exception is kept, not turned into a bare "no kernel") and what to do."""
    from lightning_comp.devices import kernel_probes

    def no_kernel(module: nn.RNNBase, route: str, *args: Any) -> Any:
        if route == "autocast":
            raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")
        raise NotImplementedError(f"'{route}' route: no kernel for Half")

    monkeypatch.setattr(kernel_probes, "_run", no_kernel)
    kernel_probes.probe_recurrent.cache_clear()  # type: ignore[attr-defined]
    try:
        model = nn.Sequential(nn.LSTM(2, 2), nn.GRU(2, 2), nn.Linear(2, 2))
        why = (r"autocast: RuntimeError: could not create a primitive descriptor for the LSTM forward propagation"
               r" primitive; params: NotImplementedError: 'params' route: no kernel for Half")
        pattern = (rf"2 operator\(s\) have no kernel .* on cpu \[cpu .*\]: 0 \(LSTM, fp16: {why}\);"
                   rf" 1 \(GRU, fp16: {why}\).*'fp32'")
        with pytest.raises(PlanError, match=pattern):
            PlanExecutor().apply(model, PrecisionPlan.from_dict({}, default="fp16"), "cpu")
        assert not any(m._forward_pre_hooks for m in model.modules())  # nothing was hooked
    finally:
        kernel_probes.probe_recurrent.cache_clear()  # type: ignore[attr-defined]


def test_ineffective_entries_warn_once() -> None:
    class Upcast(nn.Module):  # a leaf that computes in fp32 whatever it is given
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.float() * 2

    model = nn.Sequential(nn.Linear(2, 2), Upcast())
    executor = _apply(model, default="bf16")
    with pytest.warns(UserWarning, match=r"no effect: 1 \(Upcast\)"):
        _train_step(executor, model, torch.randn(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_step(executor, model, torch.randn(2, 2), kind=StepKind.VALIDATION)


def test_an_operator_whose_last_op_returns_fp32_after_low_work_is_not_reported_ineffective() -> None:
    """Under CUDA autocast a region ending in an op of CUDA's fp32 list (layer_norm, softmax) returns fp32 after its
    matmuls ran in 16 bits: its entry had an effect. An upcast at the end stands for that op on any device."""

    class ProjectThenUpcast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x).float()

    register_atomic(ProjectThenUpcast)
    model = nn.Sequential(ProjectThenUpcast(), nn.Linear(2, 2))
    executor = _apply(model, default="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_step(executor, model, torch.randn(2, 2))


def test_cast_floating_walks_nested_structures() -> None:
    Pair = namedtuple("Pair", "a b")
    obj = {"x": [torch.ones(1), (torch.ones(1, dtype=torch.long), Pair(torch.ones(1, dtype=BF16), 3))], "y": None}
    out = cast_floating(obj, torch.float16)
    assert out["x"][0].dtype == torch.float16
    assert out["x"][1][0].dtype == torch.long
    assert isinstance(out["x"][1][1], Pair) and out["x"][1][1].a.dtype == torch.float16 and out["x"][1][1].b == 3
    only = cast_floating(obj, FP32, only=(BF16,))
    assert only["x"][0] is obj["x"][0] and only["x"][1][1].a.dtype == FP32


def test_a_second_executor_displaces_the_first(hook_count: Any, dtype_recorder: Any) -> None:
    model = _mlp()
    first = _apply(model, default="bf16")
    second = _apply(model, {"1": "bf16"})  # e.g. a new CoMPPrecision for the same model in a second Trainer
    assert hook_count(model) == second.num_hooks == 6 and first.num_hooks == 0 and first.plan is None
    dtype_recorder.attach(model)
    with second.step(StepKind.TRAIN), dtype_recorder:
        model(torch.randn(2, 4))
    assert all(r.inputs == [FP32, FP32, FP32] for r in dtype_recorder.ops if r.op == "addmm")  # not the old plan
    first.apply(model, PrecisionPlan())  # taking the model back with an all-fp32 plan leaves no hook at all
    assert hook_count(model) - len(dtype_recorder._handles) == 0 and second.num_hooks == 0


# ------------------------------------------------------------------------------------ weight copies for backward
class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 3)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).transpose(1, 2)
        return self.lin(self.gru(h)[0])


def _weight_copies_after_forward(recast: bool) -> tuple[list[bool], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _ConvNet()
    executor = PlanExecutor(recast_weights_in_backward=recast)
    executor.apply(model, PrecisionPlan.from_dict({}, default="bf16"), "cpu")
    refs: list[Any] = []
    for module in (model.conv, model.lin, model.gru):  # registered after the executor's: sees the low copies
        module.register_forward_pre_hook(lambda m, a: refs.extend(
            weakref.ref(p) for p in m._parameters.values() if p is not None and p.dtype == BF16))
    x = torch.randn(4, 3, 12)
    grads = []
    for _ in range(2):  # the calibration step and a calibrated one
        refs.clear()
        with executor.step(StepKind.TRAIN):
            loss = model(x).float().square().mean()
        alive = [ref() is not None for ref in refs]
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    assert refs, "the executor made no low-precision weight copies"
    return alive, grads


def test_low_weight_copies_are_recast_in_backward_not_kept_and_grads_are_bit_identical() -> None:
    alive_recast, grads_recast = _weight_copies_after_forward(recast=True)
    alive_kept, grads_kept = _weight_copies_after_forward(recast=False)
    assert not any(alive_recast)  # Linear and Conv (autocast) and GRU (parameter copies): freed after forward
    assert any(alive_kept)  # without the recipes autograd keeps them until backward
    assert all(torch.equal(a, b) for a, b in zip(grads_recast, grads_kept))
    assert all(g.dtype == FP32 for g in grads_recast)


def test_weight_changed_between_forward_and_backward_is_an_error_naming_it() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    executor = _apply(model, default="bf16")
    with executor.step(StepKind.TRAIN):
        loss = model(torch.randn(3, 4)).float().sum()
    with torch.no_grad():
        model[1].weight.add_(1.0)
    with pytest.raises(RuntimeError, match=r"'1\.weight' was modified in place between forward and backward"):
        loss.backward()


def test_weight_copies_outside_steps_and_under_no_grad_are_plain() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    executor = _apply(model, default="bf16")
    out = model(torch.randn(3, 4))  # outside a step: autocast alone, nothing recorded
    out.float().sum().backward()
    with torch.no_grad(), executor.step(StepKind.VALIDATION):
        assert model(torch.randn(3, 4)).dtype == FP32
    assert not executor._weight_casts.active and not executor._weight_casts._copies


def test_saved_tensor_hooks_around_the_step_still_see_every_other_tensor() -> None:
    # e.g. torch.autograd.graph.save_on_cpu() or a memory probe around training: only the innermost hooks run, so
    # the executor's hooks must hand every tensor that is not a weight copy on to them.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    executor = _apply(model, default="bf16")
    x = torch.randn(8, 16)
    seen: list[tuple[torch.dtype, tuple[int, ...]]] = []
    unpacked = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append((t.dtype, tuple(t.shape)))
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked.append(1)
        return t

    grads = []
    for outer in (False, True):
        seen.clear()
        probe = torch.autograd.graph.saved_tensors_hooks(pack, unpack) if outer else nullcontext()
        with probe, executor.step(StepKind.TRAIN):
            loss = model(x).float().square().mean()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    assert seen and unpacked  # the activations reached the outer hooks, and backward unpacked them through them
    assert (BF16, (8, 16)) in seen and (BF16, (8, 32)) in seen  # the Linears' bf16 inputs
    assert (BF16, (32, 4)) not in seen  # the second Linear's weight copy (saved transposed) stayed a recipe
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    # control: without recipes the same probe does see that weight copy
    model.zero_grad(set_to_none=True)
    executor.remove()
    keeping = PlanExecutor(recast_weights_in_backward=False)
    keeping.apply(model, PrecisionPlan.from_dict({}, default="bf16"))
    seen.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), keeping.step(StepKind.TRAIN):
        model(x).float().sum()
    assert (BF16, (32, 4)) in seen


def _fp32_step_with_bf16_masters(recast: bool) -> tuple[list[tuple[torch.dtype, tuple[int, ...]]], list[Any]]:
    """Two training steps (the calibrating one and a calibrated one) of FP32 operators whose parameters a bf16 master
    holds, under an outer saved-tensor probe; the probe's last record and each step's output and gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    masters = {str(index): {"master": "bf16"} for index in range(4)}  # the GELU (1) has no parameters to copy
    for index in (0, 2, 3):  # what CoMPPrecision's optimizer states do for a master entry
        for p in model[index].parameters():
            p.data = p.data.bfloat16()
    executor = PlanExecutor(recast_weights_in_backward=recast)
    executor.apply(model, PrecisionPlan.from_dict(masters), "cpu")
    x = torch.randn(8, 16)
    seen: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append((t.dtype, tuple(t.shape)))
        return t

    steps = []
    for _ in range(2):
        seen.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), executor.step(StepKind.TRAIN):
            out = model(x)
        out.square().mean().backward()
        steps.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    # calibration keeps them hooked (they swap parameters in); the GELU, with nothing to swap, is not
    assert executor.hooked_operators() == {"0", "2", "3"}
    return seen, [x, model, steps]


@pytest.mark.parametrize("recast", [True, False])
def test_fp32_operators_with_bf16_masters_compute_with_fp32_copies_and_give_bf16_gradients(recast: bool) -> None:
    """A bf16 master of an operator computing in FP32: its forward is exactly FP32's with the bf16 values, its
    gradients are FP32's rounded to bf16, and (with recipes) no FP32 copy of a weight is held for backward."""
    seen, (x, model, steps) = _fp32_step_with_bf16_masters(recast)
    reference = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    expected = reference(x)
    expected.square().mean().backward()
    for out, grads in steps:
        assert out.dtype == FP32 and torch.equal(out, expected)
        for (name, ref), grad in zip(reference.named_parameters(), grads):
            assert grad.dtype == (FP32 if name.startswith("1.") else BF16), name
            assert torch.equal(grad, ref.grad.to(grad.dtype)), name
    weight_copies = {(FP32, (32, 4)), (FP32, (4, 32)), (FP32, (32, 16)), (FP32, (16, 32))}
    if recast:
        assert not weight_copies & set(seen), seen  # the Linears' FP32 copies were saved as recipes
    else:
        assert weight_copies & set(seen)  # control: kept for backward without the recipes


def test_an_fp32_operator_with_a_bf16_master_recomputes_exactly() -> None:
    """A recomputed FP32 operator whose parameters a bf16 master holds makes its FP32 copies again in backward's
    re-run: output and gradients as FP32's with the bf16 values, bit for bit."""
    def net() -> nn.Sequential:
        return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))

    torch.manual_seed(0)
    model = net()
    for index in (0, 1, 3):
        for p in model[index].parameters():
            p.data = p.data.bfloat16()
    executor = PlanExecutor()
    plan = {"0": {"master": "bf16"}, "1": {"master": "bf16", "saved": "recompute"}, "2": {"saved": "recompute"},
            "3": {"master": "bf16"}}
    executor.apply(model, PrecisionPlan.from_dict(plan), "cpu")
    reference = net()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    x = torch.randn(8, 16)
    expected = reference(x)
    expected.square().mean().backward()
    for _ in range(2):  # the calibrating step and a calibrated one
        with executor.step(StepKind.TRAIN):
            out = model(x)
        with executor.recomputing():
            out.square().mean().backward()
        assert torch.equal(out, expected)
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            assert p.grad.dtype == BF16 and torch.equal(p.grad, ref.grad.bfloat16()), name
        model.zero_grad(set_to_none=True)


def test_an_fp32_operator_reading_a_tied_bf16_master_computes_with_an_fp32_copy_of_it() -> None:
    """Tied embeddings (Hugging Face GPT-2's ``lm_head`` reads ``wte.weight``): the master entry of the owner holds the
    one parameter in bf16, and the other FP32 operator reading it must copy it too (it raised a dtype error in F.linear
    before)."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.norm = nn.LayerNorm(16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.emb(tokens)))

    torch.manual_seed(0)
    model = Tied()
    model.emb.weight.data = model.emb.weight.data.bfloat16()
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict({"emb": {"master": "bf16"}}), "cpu")  # the owner's entry only
    reference = Tied()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    tokens = torch.randint(0, 50, (4, 7))
    expected = reference(tokens)
    expected.square().mean().backward()
    for _ in range(2):  # the calibrating step and a calibrated one
        with executor.step(StepKind.TRAIN):
            out = model(tokens)
        out.square().mean().backward()
        assert torch.equal(out, expected)
        grad = model.emb.weight.grad
        # two bf16 gradients summed (the embedding's and the head's), against FP32's sum: within bf16's rounding of
        # the larger terms (they cancel in places, so not elementwise-relative)
        ref = reference.emb.weight.grad
        assert grad.dtype == BF16 and float((grad.float() - ref).abs().max()) <= 2**-7 * float(ref.abs().max())
        model.zero_grad(set_to_none=True)
    assert executor.hooked_operators() == {"emb", "head"}


def test_a_16bit_plan_that_lowers_no_operator_warns_once_at_apply() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Flatten())
    with pytest.warns(UserWarning, match=r"assigns bf16 but no operator of Sequential computes in it"):
        executor = _apply(model, {"1": "bf16"})  # only the shape-only Flatten
    assert executor.num_hooks == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _apply(model, {"0": "bf16"})  # a real 16-bit operator: no warning
        _apply(model, {})  # all fp32: nothing to say


class _Scale(nn.Module):
    """A leaf with a weight of its own that no autocast list covers: lowered through 16-bit parameter copies."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


@pytest.mark.parametrize("recast", [True, False])
def test_parameters_replaced_after_the_plan_is_applied_are_the_ones_computed_with_and_trained(recast: bool) -> None:
    """``load_state_dict(assign=True)`` (or a sharded strategy around every forward) puts new Parameter objects on
    the same modules. The hooks must compute with those and give them gradients: they used to keep the Parameters
    of the moment the plan was applied, so zeroed weights still gave a non-zero output and no gradient."""
    model = nn.Sequential(nn.Linear(4, 4), _Scale(4), nn.Linear(4, 2))
    executor = PlanExecutor(recast_weights_in_backward=recast)
    executor.apply(model, PrecisionPlan.from_dict({}, default="bf16"))
    x = torch.randn(3, 4)
    _train_step(executor, model, x)  # calibrated with the first parameters
    zeroed = {name: torch.zeros_like(value) for name, value in model.state_dict().items()}
    model.load_state_dict(zeroed, assign=True)
    for step in range(2):  # the calibrating step already ran: both a chained and a fresh step
        out, loss = _train_step(executor, model, x)
        assert torch.count_nonzero(out) == 0, (step, out)  # every weight and bias is zero now
        (out.float().sum() + loss).backward()
        for name, param in model.named_parameters():
            assert param.grad is not None, (step, name)  # the new parameters are the ones trained
        assert float(model[2].bias.grad.abs().sum()) > 0  # d(sum)/d(bias) is 3 per output, whatever the weights
        model.zero_grad(set_to_none=True)
