"""fp8 compute of ``nn.Linear`` operators: what runs (scaled matmuls with float8 operands), what stays FP32 (masters,
gradients, every other operator), the numerics (SQNR against FP32), and the errors of plans fp8 cannot serve.

On a CPU ``torch._scaled_mm`` emulates fp8: these tests check what is computed, never how fast.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_comp import PlanError, PrecisionPlan
from lightning_comp.devices.lowering import Lowering, fp8_refusal, lowering_for
from lightning_comp.execution import PlanExecutor, StepKind
from lightning_comp.numerics import ComputePrecision
from tests.helpers.recording import DtypeRecorder, ScaledMatmulRecorder, sqnr

FP8_DTYPE = torch.float8_e4m3fn
FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.LayerNorm(48), nn.Linear(48, 16))


def _steps(model: nn.Module, plan: dict[str, Any], x: torch.Tensor, steps: int = 2,
           recorder: DtypeRecorder | None = None) -> tuple[PlanExecutor, torch.Tensor]:
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict(plan))
    if recorder is not None:
        recorder.attach(model)
    out = torch.empty(0)
    for step in range(steps):
        model.zero_grad()
        last = step == steps - 1
        with executor.step(StepKind.TRAIN), (recorder if recorder is not None and last else _nothing()):
            out = model(x)
            out.float().square().mean().backward()
    return executor, out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def test_spellings_and_what_an_fp8_precision_means() -> None:
    assert ComputePrecision.parse("float8") is ComputePrecision.FP8
    assert ComputePrecision.parse("FP8-Tensorwise") is ComputePrecision.FP8
    assert ComputePrecision.parse("fp8_rowwise") is ComputePrecision.FP8_ROWWISE
    assert ComputePrecision.parse(torch.bfloat16) is ComputePrecision.BF16  # bf16 activations do not make it fp8
    for precision, recipe in ((ComputePrecision.FP8, "tensorwise"), (ComputePrecision.FP8_ROWWISE, "rowwise")):
        assert precision.is_fp8 and precision.is_low and precision.fp8_recipe == recipe
        assert precision.dtype is torch.bfloat16 and precision.operand_dtype is FP8_DTYPE
    with pytest.raises(PlanError, match=r"'bf16' is not an fp8 precision"):
        _ = ComputePrecision.BF16.fp8_recipe
    with pytest.raises(PlanError, match=r"Unknown precision 'fp4'.*'fp8' \(nn.Linear only, per-tensor scales\)"):
        ComputePrecision.parse("fp4")


@pytest.mark.parametrize("recipe", ["fp8", "fp8-rowwise"])
def test_fp8_linears_run_scaled_matmuls_with_float8_operands_and_everything_else_never_sees_fp8(
        recipe: str, dtype_recorder: DtypeRecorder) -> None:
    model = _model()
    x = torch.randn(8, 32)
    with ScaledMatmulRecorder(dtype_recorder) as scaled:
        executor, _ = _steps(model, {"type:Linear": recipe, "2": "fp32"}, x, recorder=dtype_recorder)
    assert executor.precisions()["0"] is ComputePrecision.parse(recipe)
    last = scaled.calls[len(scaled.calls) // 2:]  # the recorded (second) step's
    # forward: one per fp8 Linear (attributed to it); backward: input and weight gradient of each (outside modules)
    assert sorted(c.module for c in last if c.module) == ["0", "4"]
    assert len([c for c in last if c.module is None]) == 4
    assert all(c.operands == (FP8_DTYPE, FP8_DTYPE) for c in last if c.module)  # forward: e4m3 input and weight
    assert all(set(c.operands) <= FLOAT8 for c in last)  # backward: the recipe's (tensorwise: e5m2 gradients)
    assert all(c.out_dtype is torch.bfloat16 for c in last)  # the bf16 activations
    assert all(c.scale_dtypes == (torch.float32, torch.float32) for c in last)
    # the FP32 Linear and the norm compute FP32 (never a float8 tensor, which would report bf16 here)
    for name in ("2", "3"):
        assert all(set(r.inputs + r.outputs) == {torch.float32} for r in dtype_recorder.ops_of(name)), name
    calls = {c.module: c for c in dtype_recorder.calls}
    assert calls["0"].inputs == [torch.float32] and calls["4"].outputs == [torch.float32]  # the step's boundaries
    # masters and gradients stay FP32
    assert all(p.dtype is torch.float32 and p.grad is not None and p.grad.dtype is torch.float32
               for p in model.parameters())


def test_rowwise_scales_per_row_and_tensorwise_per_tensor() -> None:
    shapes = {}
    for recipe in ("fp8", "fp8-rowwise"):
        with ScaledMatmulRecorder() as scaled:
            _steps(nn.Sequential(nn.Linear(32, 64)), {"0": recipe}, torch.randn(8, 32), steps=1)
        shapes[recipe] = [c.scales for c in scaled.calls]
    assert len(shapes["fp8"]) == len(shapes["fp8-rowwise"]) == 3  # forward, input gradient, weight gradient
    assert all(a in ((), (1,), (1, 1)) and b in ((), (1,), (1, 1)) for a, b in shapes["fp8"])
    assert shapes["fp8-rowwise"][0] == ((8, 1), (1, 64))  # (8 x 32) @ (32 x 64): a scale per row of each operand
    # backward: torchao's tensorwise kernel with unit scales, the rows' scales applied to its output
    assert all(a in ((), (1,), (1, 1)) and b in ((), (1,), (1, 1)) for a, b in shapes["fp8-rowwise"][1:])


@pytest.mark.parametrize("recipe", ["fp8", "fp8-rowwise"])
def test_fp8_numerics_against_fp32(recipe: str) -> None:
    """Signal to noise of the output and of every gradient against the same model in FP32 (e4m3 operands: ~30 dB)."""
    reference, lowered = _model(), _model()
    x = torch.randn(64, 32)
    _, expected = _steps(reference, {}, x, steps=1)
    _, got = _steps(lowered, {"type:Linear": recipe}, x, steps=1)
    assert sqnr(expected, got) > 22
    for (name, p), q in zip(reference.named_parameters(), lowered.parameters(), strict=True):
        assert sqnr(p.grad, q.grad) > 18, name  # type: ignore[arg-type]


def test_operators_fp8_cannot_serve_are_refused_naming_the_operator_and_why() -> None:
    assert lowering_for(nn.Linear(32, 64), ComputePrecision.FP8, "cpu") is Lowering.FLOAT8
    assert lowering_for(nn.Linear(32, 64), ComputePrecision.FP32, "cpu") is Lowering.NONE
    assert "64 in, 10 out" in str(fp8_refusal(nn.Linear(64, 10)))
    assert "a Conv1d is not one" in str(fp8_refusal(nn.Conv1d(16, 16, 3)))
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    with pytest.raises(PlanError, match=r"2 \(Linear, fp8: fp8 matmul kernels need in and out features that are"
                                        r" multiples of 16, and this Linear has 64 in, 10 out; assign it 'bf16'\)"):
        PlanExecutor().apply(model, PrecisionPlan.from_dict({"type:Linear": "fp8"}))
    with pytest.raises(PlanError, match=r"1 \(ReLU, fp8: fp8 computes nn.Linear operators"):
        PlanExecutor().apply(model, PrecisionPlan.from_dict({"1": "fp8"}))
    executor = PlanExecutor()  # the head in bf16, as the message advises: accepted
    executor.apply(model, PrecisionPlan.from_dict({"type:Linear": "fp8", "2": "bf16"}))
    assert executor.precisions()["2"] is ComputePrecision.BF16


def test_a_linear_whose_forward_makes_no_linear_call_with_its_weight_is_an_error_not_a_silent_matmul() -> None:
    class Transposed(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.t() + self.bias

    model = nn.Sequential(Transposed(32, 32))
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict({"0": "fp8"}))
    with pytest.raises(PlanError, match=r"Operator '0' is planned in fp8, but its forward made no F.linear call"), \
            executor.step(StepKind.TRAIN):
        model(torch.randn(4, 32))


def test_an_fp8_linear_between_bf16_operators_hands_on_bf16_without_casts_to_fp32(
        dtype_recorder: DtypeRecorder) -> None:
    model = _model()
    _steps(model, {"0": "fp8", "1": "bf16", "2": "fp8-rowwise"}, torch.randn(8, 32), recorder=dtype_recorder)
    calls = {c.module: c for c in dtype_recorder.calls}
    assert calls["0"].outputs == [torch.bfloat16] and calls["1"].outputs == [torch.bfloat16]  # chained in bf16
    assert calls["2"].outputs == [torch.float32]  # its consumer (the norm) is FP32


def test_a_plan_file_with_fp8_entries_round_trips(tmp_path: Any) -> None:
    plan = PrecisionPlan.from_dict({"type:Linear": "fp8", "head": "fp8-rowwise", "norm": "bf16"})
    loaded = PrecisionPlan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.same_assignments(plan)
    assert loaded.of("compute", "head", nn.Linear) is ComputePrecision.FP8_ROWWISE
    assert loaded.of("compute", "blocks.0.fc", nn.Linear) is ComputePrecision.FP8
    assert loaded.uses("fp8") and loaded.uses("fp8-rowwise")
    assert '"fp8-rowwise"' in (tmp_path / "plan.json").read_text()


def test_hugging_faces_conv1d_computes_in_fp8_through_its_addmm(dtype_recorder: DtypeRecorder) -> None:
    """GPT-2's ``Conv1D`` is a Linear with its weight transposed (``torch.addmm(bias, x, weight)``): the same fp8
    matmuls, its gradient in its own layout."""
    pytest.importorskip("transformers", reason="transformers is not installed (the [hf] extra)")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    reference, lowered = nn.Sequential(Conv1D(64, 32)), nn.Sequential(Conv1D(64, 32))
    lowered.load_state_dict(reference.state_dict())
    x = torch.randn(2, 9, 32)
    _, expected = _steps(reference, {}, x, steps=1)
    with ScaledMatmulRecorder(dtype_recorder) as scaled:
        _, got = _steps(lowered, {"0": "fp8"}, x, steps=1, recorder=dtype_recorder)
    assert [c.module for c in scaled.calls].count("0") == 1 and len(scaled.calls) == 3
    assert sqnr(expected, got) > 22
    assert lowered[0].weight.grad is not None and lowered[0].weight.grad.shape == (32, 64)
    assert sqnr(reference[0].weight.grad, lowered[0].weight.grad) > 18  # type: ignore[arg-type]
    assert "has 32 in, 10 out" in str(fp8_refusal(Conv1D(10, 32)))
