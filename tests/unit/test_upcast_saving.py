"""FP32 copies a post-hook makes of lowered outputs are saved for backward as the outputs themselves (half the bytes,
cast again in backward: bit-identical), by consumers and by recompute recipes alike, under plans made for memory."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

from lightning_comp import PrecisionPlan
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.execution.upcast_saving import UpcastSaver
from tests.unit.test_recompute import Probe, assert_same, flat_batch, mlp, train


def _without_upcast_saving(monkeypatch: pytest.MonkeyPatch) -> None:
    """UpcastSaver.recording replaced by a no-op: every FP32 copy is saved as it is."""
    monkeypatch.setattr(UpcastSaver, "recording", lambda self: contextlib.nullcontext())


# fc1 in bf16 hands the fp32 GELU an fp32 copy of its output; the GELU saves it (its input)
_GELU_INPUT = 32 * 64


@pytest.mark.parametrize(("plan", "halved"), [
    # a plan made for memory (fc2 stores what it saves in fp8): the GELU's saved input is stored as fc1's bf16 output
    ({"0": "bf16", "2": {"saved": "fp8"}}, _GELU_INPUT * 2),
    # the GELU recomputed: its recipe holds its input as fc1's bf16 output too (and the GELU saves nothing else)
    ({"0": "bf16", "1": {"saved": "recompute"}}, _GELU_INPUT * 2),
], ids=["saved-by-consumer", "held-by-recipe"])
def test_an_fp32_copy_of_a_bf16_output_is_saved_as_the_output_and_training_is_bit_identical(
        plan: dict[str, Any], halved: int, monkeypatch: pytest.MonkeyPatch) -> None:
    stored = train(mlp(), plan, flat_batch())
    with monkeypatch.context() as patch:
        _without_upcast_saving(patch)
        copies = train(mlp(), plan, flat_batch())
    assert_same(stored, copies)
    for s, c in zip(stored.probes, copies.probes):  # the first, calibrating, step too
        assert c.nbytes - s.nbytes == halved
        assert (torch.bfloat16, (32, 64)) in s.dtypes


def test_a_plan_without_saved_entries_runs_without_the_hooks() -> None:
    torch.manual_seed(0)
    model = mlp()()
    ex = PlanExecutor()
    ex.apply(model, PrecisionPlan.from_dict({"0": "bf16"}))
    probe = Probe()
    for _ in range(2):
        with probe.hooks(), ex.step(StepKind.TRAIN):
            model(torch.randn(32, 16)).sum().backward()
    assert (torch.float32, (32, 64)) in probe.dtypes  # the GELU keeps its fp32 input, as autocast would


def test_a_copy_modified_in_place_after_the_cast_is_saved_as_it_is() -> None:
    class AddOne(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.add_(1.0)  # the fp32 copy fc1's post-hook handed on, changed before the GELU saves it
            return x

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 64), AddOne(), nn.GELU(), nn.Linear(64, 4))

    plan = {"0": "bf16", "3": {"saved": "fp8"}}
    stored = train(make, plan, flat_batch())
    with pytest.MonkeyPatch.context() as patch:
        _without_upcast_saving(patch)
        copies = train(make, plan, flat_batch())
    assert_same(stored, copies)  # the GELU's gradient uses x + 1, not fc1's output
    assert all((torch.float32, (32, 64)) in p.dtypes for p in stored.probes)


def test_the_saver_keeps_nothing_once_the_step_is_over() -> None:
    saver = UpcastSaver()
    low = torch.randn(4, 8).bfloat16()
    with saver.recording():
        copy = low.float()
        saver.note(low, copy)
        assert saver.source(copy) is low
        assert torch.equal(saver.source(copy[1:3]), low[1:3])  # a view of the copy: the same view of its source
        assert saver.source(copy.clone()) is None
    assert saver.source(copy) is None  # the step's notes are forgotten
