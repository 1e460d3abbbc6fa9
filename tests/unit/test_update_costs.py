"""The update's cost model: what a managed optimizer update adds, fitted over every operator, prices the state and
master levers, so operators of one shape get one price however noisy each one's few rounds were."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from torch import nn

from lightning_comp.operators.kinds import OperatorKind
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.parameters import ParameterDecision
from lightning_comp.search.decisions.update_costs import UpdateSample, fit_update_cost
from lightning_comp.search.measurement.optimizer_timing import UpdateVariant
from lightning_comp.search.stages.memory_lever_options import LeverBuilder

# the default example's parameter groups: (tensors, elements), its four blocks' matmuls and the embeddings and head
SHAPES = [(1, 65536), (1, 32768)] + [(2, 197376), (2, 65792), (2, 263168), (2, 262400)] * 4 + [(2, 65792)]


def _samples(per_tensor_ms: float, per_element_ms: float, noise: float, seed: int) -> list[UpdateSample]:
    rng = random.Random(seed)
    return [UpdateSample(t, e, (per_tensor_ms * t + per_element_ms * e) * rng.uniform(1 - noise, 1 + noise))
            for t, e in SHAPES]


@pytest.mark.parametrize("seed", range(5))
def test_the_fit_recovers_a_fixed_and_a_per_element_cost_through_per_operator_noise(seed: int) -> None:
    # 8-bit state on the default example: ~0.15 ms per tensor (a compiled call) and ~3 ns per element; each
    # operator's measurement off by up to +-30 %, as its few rounds on a shared CPU are
    model = fit_update_cost(_samples(0.15, 3e-6, 0.3, seed))
    assert model is not None and model.samples == len(SHAPES)
    assert model.per_element_ms == pytest.approx(3e-6, rel=0.2)
    assert model.per_tensor_ms == pytest.approx(0.15, abs=0.1)
    # priced from the model, operators are off their true cost by 8 % on average, where their own measurements are off
    # by 15 % (uniform within +-30 %); the matmuls (16 of 19) by at most 15 %
    errors = [abs(model.extra_ms(t, e) / (0.15 * t + 3e-6 * e) - 1) for t, e in SHAPES]
    assert sum(errors) / len(errors) < 0.08
    assert max(error for error, (t, _) in zip(errors, SHAPES) if t == 2) < 0.15


def test_the_fit_never_prices_below_zero_and_needs_three_operators() -> None:
    # a variant that adds nothing (bf16 state: its update as fast as FP32's, within noise either way)
    flat = fit_update_cost([UpdateSample(t, e, -0.01 if i % 2 else 0.005) for i, (t, e) in enumerate(SHAPES)])
    assert flat is not None and flat.per_tensor_ms >= 0 and flat.per_element_ms >= 0
    assert all(flat.extra_ms(t, e) < 0.01 for t, e in SHAPES)
    # a fixed cost alone: a negative per-element slope is dropped, not priced
    fixed = fit_update_cost([UpdateSample(1, 1000, 0.2), UpdateSample(2, 1000, 0.4), UpdateSample(1, 100000, 0.19)])
    assert fixed is not None and fixed.per_element_ms == 0.0 and fixed.per_tensor_ms == pytest.approx(0.197, abs=0.01)
    assert fit_update_cost(_samples(0.15, 3e-6, 0.0, 0)[:2]) is None


def _decision(tensors: int, elements: int, fp32_ms: float, ratio: float) -> OperatorDecision:
    decision = OperatorDecision("Linear", OperatorKind.COMPUTE, elements)
    decision.parameters = ParameterDecision(
        params=elements, tensors=tensors, update_ms={UpdateVariant.FP32: fp32_ms, UpdateVariant.INT8: fp32_ms * ratio},
        time_ratios={UpdateVariant.INT8: [ratio, ratio * 0.9, ratio * 1.1]},
        bytes={UpdateVariant.FP32: 8 * elements, UpdateVariant.INT8: 2 * elements})
    return decision


def test_operators_of_one_shape_get_one_price_whatever_their_own_rounds_said() -> None:
    # four matmuls of one shape whose FP32 updates measured 0.36-0.67 ms (one search of the default example), and
    # two of another: priced from their own rounds, one group's 8-bit lever came before the other's in one run and
    # after it in the next
    names = ["a.fc", "b.fc", "c.fc", "d.fc", "a.proj", "b.proj"]
    modules = {n: nn.Linear(4, 4) for n in names}
    decisions = {n: _decision(2, 263168 if n.endswith("fc") else 65792, ms, ratio)
                 for n, ms, ratio in zip(names, [0.36, 0.67, 0.48, 0.52, 0.21, 0.24], [2.6, 2.3, 2.9, 2.5, 2.2, 2.4])}
    ctx = SimpleNamespace(modules=modules, config=SearchConfig(objective="memory", precisions={"state": "8bit"}))
    builder = LeverBuilder(ctx)  # type: ignore[arg-type]
    levers, _ = builder.build(PrecisionPlan(), decisions)
    prices = {lever.label: lever.options[0].extra_ms for lever in levers}
    fc = {prices[f"state:{n}"] for n in names if n.endswith("fc")}
    assert len(fc) == 1 and len({prices["state:a.proj"], prices["state:b.proj"]}) == 1  # one price per shape
    assert prices["state:a.fc"] > prices["state:a.proj"] > 0  # and larger parameters cost more
    assert UpdateVariant.INT8 in builder.update_costs
    # with too few operators to spread the noise over, each keeps its own measurement
    few = {n: decisions[n] for n in ("a.fc", "b.fc")}
    own = {lever.label: lever.options[0].extra_ms for lever in LeverBuilder(ctx).build(PrecisionPlan(), few)[0]}  # type: ignore[arg-type]
    assert own["state:a.fc"] == pytest.approx(0.36 * 1.6) and own["state:b.fc"] == pytest.approx(0.67 * 1.3)
