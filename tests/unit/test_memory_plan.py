"""The plan's optimizer-state, master-weight and recompute dimensions, and the judgement of parameter lowerings."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_comp import PrecisionPlan
from lightning_comp.errors import PlanError, PlanMismatchError
from lightning_comp.numerics import MasterPrecision, SavedPrecision, StatePrecision
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.decisions.parameters import StepBudget, judge_lowering
from lightning_comp.search.measurement.estimates import RatioEstimate


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def test_every_dimension_round_trips_through_the_plan_file(tmp_path: object) -> None:
    plan = PrecisionPlan.from_dict({"0": {"compute": "bf16", "state": "8bit", "master": "bf16"},
                                    "1": {"saved": "recompute"}}, default={"state": "bf16"}).bind(_model())
    assert plan.of("state", "0") is StatePrecision.INT8 and plan.of("state", "2") is StatePrecision.BF16
    assert plan.of("master", "0") is MasterPrecision.BF16 and plan.of("master", "2") is MasterPrecision.FP32
    assert plan.of("saved", "1") is SavedPrecision.RECOMPUTE and plan.recomputes and plan.manages_parameters
    document = plan.to_dict()
    assert document["state"] == {"0": "8bit"} and document["state_default"] == "bf16"
    assert document["master"] == {"0": "bf16"}
    assert PrecisionPlan.from_dict(document) == plan
    summary = plan.summary(_model())
    assert "state" in summary and "master" in summary and "keep bf16 master weights" in summary


def test_documents_without_the_new_dimensions_read_as_fp32() -> None:
    document = PrecisionPlan.from_dict({"0": "bf16"}).to_dict()
    for key in ("state", "state_default", "master", "master_default"):
        del document[key]
    plan = PrecisionPlan.from_dict(document)
    assert not plan.manages_parameters and plan["state"].default is StatePrecision.FP32


def test_bad_values_and_unknown_operators_are_named() -> None:
    with pytest.raises(PlanError, match=r"Plan entry '0'.*optimizer-state precision '4bit'.*'8bit'"):
        PrecisionPlan.from_dict({"0": {"state": "4bit"}})
    with pytest.raises(PlanError, match=r"master-weight precision 'fp16'"):
        PrecisionPlan.from_dict({"0": {"master": "fp16"}})
    with pytest.raises(PlanError, match=r"'compute'.*'saved'.*'state'.*'master'.*not \['optimizer'\]"):
        PrecisionPlan.from_dict({"0": {"optimizer": "8bit"}})
    with pytest.raises(PlanMismatchError, match="optimizer-state plan entr.*'nope'"):
        PrecisionPlan.from_dict({"nope": {"state": "8bit"}}).validate(_model())


def _estimate(ratio: float, spread: float = 0.05) -> RatioEstimate:
    return RatioEstimate(ratio, ratio - spread, ratio + spread, 6, 0.9)


def test_memory_accepts_what_saves_bytes_within_the_slowdown() -> None:
    config = SearchConfig(objective="memory", max_slowdown_vs_fastest=1.5)
    budget = StepBudget(step_ms=100.0, pace_step_ms=100.0, step_bytes=1e8)
    ok, why, benefit = judge_lowering(config, budget, 8_000_000, 2_000_000, 2.0, _estimate(3.0))
    # 4.1 ms more (slow end) per 100 ms
    assert ok and benefit == 6_000_000 and "x1.04 of the fastest fixed policy's" in why
    ok, why, _ = judge_lowering(config, budget, 8_000_000, 2_000_000, 30.0, _estimate(3.0))
    assert not ok and "past max_slowdown_vs_fastest 1.5" in why  # 61.5 ms more
    ok, why, _ = judge_lowering(config, budget, 8_000_000, 7_900_000, 2.0, _estimate(1.0))
    assert not ok and "saves too little" in why


def test_balanced_accepts_what_improves_time_times_memory() -> None:
    config = SearchConfig(objective="balanced")
    budget = StepBudget(step_ms=100.0, pace_step_ms=100.0, step_bytes=1e8)
    ok, _, benefit = judge_lowering(config, budget, 8_000_000, 2_000_000, 2.0, _estimate(2.0))
    assert ok and benefit == pytest.approx(1 - (1 + 2.1 / 100) * (1 - 0.06), rel=1e-6)
    ok, why, _ = judge_lowering(config, budget, 8_000_000, 2_000_000, 10.0, _estimate(2.0))
    assert not ok and "no better" in why  # +10.5 % time for -6 % memory
