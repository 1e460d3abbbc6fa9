"""The saved codecs' cost model: what bf16 and fp8 storage add, fitted over every operator, prices the codec levers,
so operators saving tensors of one size get one price however noisy each one's few rounds were."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from torch import nn

from lightning_comp.numerics.precision import SavedPrecision
from lightning_comp.operators.kinds import OperatorKind
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.decisions.codec_costs import CodecSample, fit_codec_cost
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.saved import SavedDecision
from lightning_comp.search.measurement.profiling import OperatorMeasurement
from lightning_comp.search.stages.memory_lever_options import LeverBuilder

MiB = 2**20
# the default example's fp8 samples: (operators timed, bytes saved as computed) of its four blocks' qkv, attention
# group (attention and out-projection), MLP input and MLP out-projection, and the head
SHAPES = [(1, MiB), (2, 10 * MiB), (1, MiB), (1, 4 * MiB)] * 4 + [(1, MiB)]


def _samples(per_operator_ms: float, per_mib_ms: float, noise: float, seed: int) -> list[CodecSample]:
    rng = random.Random(seed)
    return [CodecSample(n, b, (per_operator_ms * n + per_mib_ms * b / MiB) * rng.uniform(1 - noise, 1 + noise))
            for n, b in SHAPES]


@pytest.mark.parametrize("seed", range(5))
def test_the_fit_recovers_a_cost_per_operator_and_per_byte_through_per_operator_noise(seed: int) -> None:
    # fp8 on the default example (AVX512-BF16, emulated): ~0.4-0.6 ms per operator and ~0.4 ms per MiB saved as
    # computed; each operator's measurement off by up to +-30 %
    model = fit_codec_cost(_samples(0.5, 0.4, 0.3, seed))
    assert model is not None and model.samples == len(SHAPES)
    assert model.per_byte_ms * MiB == pytest.approx(0.4, rel=0.3)
    assert model.per_operator_ms == pytest.approx(0.5, abs=0.25)
    truth = [0.5 * n + 0.4 * b / MiB for n, b in SHAPES]
    errors = [abs(model.extra_ms(n, b) / t - 1) for (n, b), t in zip(SHAPES, truth)]
    assert sum(errors) / len(errors) < 0.1  # own rounds: 15 % on average (uniform within +-30 %)
    assert fit_codec_cost(_samples(0.5, 0.4, 0.0, 0)[:2]) is None  # too few to spread one's noise


def _decision(kind: OperatorKind, ms: float) -> OperatorDecision:
    return OperatorDecision("Linear", kind, 16, fp32=OperatorMeasurement(forward_ms=ms / 2, compute_ms=ms / 2,
                                                                          backward_ms=ms / 2))


def test_codec_levers_of_one_size_get_one_price_whatever_their_own_rounds_said() -> None:
    # four blocks' MLP out-projections (4 MiB saved as computed, bf16: fp8 frees half) whose fp8 measured x1.19-x1.47
    # of their 6 ms (one search of the default example), and four attention inputs of 10 MiB (fp32: fp8 frees 3/4)
    rng = random.Random(0)
    modules: dict[str, nn.Module] = {}
    decisions: dict[str, OperatorDecision] = {}
    for block, ratio in zip(range(4), (1.19, 1.47, 1.28, 1.21)):
        for part, own, ms, value in (("proj", 4 * MiB, 6.0, ratio), ("qkv", 10 * MiB, 8.0, 1.3 + 0.1 * rng.random())):
            name = f"blocks.{block}.{part}"
            modules[name] = nn.Linear(4, 4)
            decisions[name] = _decision(OperatorKind.COMPUTE, ms)
            fp8 = own // 2 if part == "proj" else own // 4
            decisions[name].saved = SavedDecision(bytes={"fp32": own, "fp8": fp8},
                                                  time_ratios={"fp8": [value, value * 0.95, value * 1.05]})
    # one block's proj apart from the others: not pooled (a different type in that block), priced alone
    modules["blocks.3.proj"] = nn.Linear(4, 5)
    ctx = SimpleNamespace(modules=modules, config=SearchConfig(objective="memory"))
    builder = LeverBuilder(ctx)  # type: ignore[arg-type]
    levers, _ = builder.build(PrecisionPlan(), decisions)
    model = builder.codec_costs[next(iter(builder.codec_costs))]
    assert model.samples == 8
    prices = {lever.label: lever.options[0].extra_ms for lever in levers}
    # each lever's price is the model's, not its own rounds' (blocks.1.proj measured 2.82 ms)
    for label, price in prices.items():
        members = int(label.split("(x")[1].rstrip(")")) if "(x" in label else 1
        own = 10 * MiB if "qkv" in label else 4 * MiB
        assert price == pytest.approx(members * model.extra_ms(1, own))
    assert set(prices) == {"saved:blocks.*.qkv (x4)", "saved:blocks.*.proj (x3)", "saved:blocks.3.proj"}
    assert prices["saved:blocks.3.proj"] == pytest.approx(prices["saved:blocks.*.proj (x3)"] / 3)  # one size
    assert prices["saved:blocks.*.qkv (x4)"] / 4 > prices["saved:blocks.3.proj"] > 0  # more bytes cost more


def test_a_codec_timed_directly_is_priced_by_its_casts_and_the_model_by_the_rest() -> None:
    # the default example: the model over every group priced four attentions' fp8 at 23.7-34.4 ms in three searches
    # while their casts, timed directly, took 36.0-40.8 ms (9-10 ms each): groups differ by more than their bytes
    modules: dict[str, nn.Module] = {}
    decisions: dict[str, OperatorDecision] = {}
    for block in range(4):
        for part, own, ms, ratio in (("proj", 4 * MiB, 6.0, 1.3), ("attn", 10 * MiB, 8.0, 1.3)):
            name = f"blocks.{block}.{part}"
            modules[name] = nn.Linear(4, 4) if part == "proj" else nn.Linear(4, 6)
            decisions[name] = _decision(OperatorKind.COMPUTE, ms)
            decisions[name].saved = SavedDecision(bytes={"fp32": own, "fp8": own // 4},
                                                  time_ratios={"fp8": [ratio, ratio * 0.95, ratio * 1.05]})
            if part == "attn":
                decisions[name].saved.direct_ms = {"fp8": 9.0 + 0.25 * block}
    ctx = SimpleNamespace(modules=modules, config=SearchConfig(objective="memory"))
    builder = LeverBuilder(ctx)  # type: ignore[arg-type]
    levers, _ = builder.build(PrecisionPlan(), decisions)
    prices = {lever.label: lever.options[0].extra_ms for lever in levers}
    assert prices["saved:blocks.*.attn (x4)"] == pytest.approx(9.0 + 9.25 + 9.5 + 9.75)  # their casts' own times
    model = builder.codec_costs[SavedPrecision.FP8]
    assert model.samples == 4  # fitted over the projections alone, which were judged by their ratios
    assert prices["saved:blocks.*.proj (x4)"] == pytest.approx(4 * model.extra_ms(1, 4 * MiB))


def test_the_record_says_how_the_codecs_were_priced() -> None:
    from lightning_comp.search.decisions.cheapest_bytes import MemorySpending, Selection
    from lightning_comp.search.decisions.codec_costs import CodecCost
    from lightning_comp.search.record.spending import spending_record

    spending = MemorySpending(start_bytes=100 * MiB, start_ms=10.0, max_ms=11.5, target_bytes=None,
                              amp_step_bytes=None, selection=Selection(),
                              codec_costs={"fp8": CodecCost(0.5, 0.4 / MiB, 17)})
    record = spending_record(SimpleNamespace(memory_spending=spending))  # type: ignore[arg-type]
    assert record is not None
    assert record["codec_costs"] == {"fp8": {"per_operator_ms": 0.5, "per_mib_ms": 0.4, "operators": 17}}


def test_a_codec_of_a_tensor_another_operator_holds_is_not_a_lever() -> None:
    # cnn (seed 1): the conv after a BatchNorm-ReLU unit saves the ReLU's output, which the ReLU saves too; its fp8
    # option was merged with the unit's recomputation as an alternative, taken alone when the unit was given back,
    # and the step saved 4 MiB more, not less (the ReLU kept its output as computed beside the conv's fp8 copy)
    modules: dict[str, nn.Module] = {"relu": nn.ReLU(), "conv": nn.Conv2d(4, 4, 3), "norm": nn.LayerNorm(4)}
    decisions = {n: _decision(OperatorKind.COMPUTE, 4.0) for n in modules}
    decisions["relu"].saved = SavedDecision(bytes={"fp32": 8 * MiB, "recompute": 0},
                                            time_ratios={"recompute": [1.3, 1.2, 1.4]}, unit="relu",
                                            timed=("relu", "conv"))
    decisions["conv"].saved = SavedDecision(bytes={"fp32": 8 * MiB, "fp8": 4 * MiB},
                                            time_ratios={"fp8": [1.2, 1.1, 1.3]}, held_by=("relu",))
    decisions["norm"].saved = SavedDecision(bytes={"fp32": 4 * MiB, "fp8": 1 * MiB},
                                            time_ratios={"fp8": [1.1, 1.0, 1.2]})
    ctx = SimpleNamespace(modules=modules, config=SearchConfig(objective="memory"))
    levers, _ = LeverBuilder(ctx).build(PrecisionPlan(), decisions)  # type: ignore[arg-type]
    options = {lever.label: [o.value for o in lever.options] for lever in levers}
    assert options == {"saved:relu": ["recompute"], "saved:norm": ["fp8"]}  # the recomputation alone frees it
