"""Memory levers taken cheapest bytes first, within the time allowed, until the budget is met."""

from __future__ import annotations

import math

import pytest

from lightning_comp.search.decisions.cheapest_bytes import Lever, LeverOption, levers_past, take_cheapest

MiB = 2**20


def _lever(label: str, *options: tuple[str, float, float], forced: bool = False) -> Lever:
    return Lever(label, tuple(LeverOption(v, b * MiB, ms) for v, b, ms in options), forced=forced)


def test_the_cheapest_bytes_per_ms_come_first_and_the_bound_stops_the_dear_ones() -> None:
    levers = [
        _lever("state:fc1", ("8bit", 30, 3.0)),  # 10 MiB/ms
        _lever("saved:act", ("recompute", 20, 0.5)),  # 40 MiB/ms
        _lever("saved:fc2", ("fp8", 40, 20.0)),  # 2 MiB/ms
    ]
    picked = take_cheapest(levers, step_bytes=200 * MiB, step_ms=100.0, max_ms=105.0)
    assert list(picked.chosen) == ["saved:act", "state:fc1"]
    assert "saved:fc2" in picked.skipped and "past the 105.000 ms allowed" in picked.skipped["saved:fc2"]
    steps = [(p.step_bytes / MiB, p.step_ms) for p in picked.frontier]
    assert steps == [(200, 100.0), (180, 100.5), (150, 103.5)]
    assert "time allowed is spent" in picked.stopped


def test_a_budget_stops_as_soon_as_it_is_met_and_says_when_it_cannot_be() -> None:
    levers = [_lever("a", ("x", 10, 1.0)), _lever("b", ("x", 10, 2.0)), _lever("c", ("x", 10, 4.0))]
    met = take_cheapest(levers, 100 * MiB, 10.0, math.inf, target_bytes=85 * MiB)
    assert list(met.chosen) == ["a", "b"] and met.met and "budget is met" in met.stopped
    short = take_cheapest(levers, 100 * MiB, 10.0, math.inf, target_bytes=50 * MiB)
    assert list(short.chosen) == ["a", "b", "c"] and not short.met and "not met" in short.stopped


def test_options_of_one_lever_are_climbed_along_their_hull() -> None:
    # bf16 state: 16 MiB for 1 ms (16/ms); 8bit: 24 MiB for 1.8 ms -> the step bf16 -> 8bit is 8 MiB for 0.8 ms
    state = _lever("state:w", ("bf16", 16, 1.0), ("8bit", 24, 1.8))
    other = _lever("saved:y", ("fp8", 10, 0.8))  # 12.5 MiB/ms: between the two state steps (16/ms, 10/ms)
    picked = take_cheapest([state, other], 100 * MiB, 10.0, math.inf)
    assert [(p.lever, p.value) for p in picked.frontier[1:]] == [("state:w", "bf16"), ("saved:y", "fp8"),
                                                                  ("state:w", "8bit")]
    assert picked.chosen["state:w"].value == "8bit"
    # an option freeing fewer bytes per ms than a larger one is skipped: straight to the larger
    skip = _lever("state:v", ("bf16", 4, 1.0), ("8bit", 24, 1.5))
    assert [o.value for o, _, _ in skip.increments()] == ["8bit"]


def test_free_levers_come_first_and_a_forced_lever_is_taken_whatever_it_costs() -> None:
    levers = [_lever("slow", ("fp8", 50, 30.0), forced=True), _lever("free", ("recompute", 5, -0.1)),
              _lever("dear", ("8bit", 10, 5.0))]
    picked = take_cheapest(levers, 100 * MiB, 10.0, max_ms=42.0)
    assert picked.frontier[1].lever == "slow" and math.isnan(picked.frontier[1].bytes_per_ms)
    assert picked.frontier[2].lever == "free" and math.isinf(picked.frontier[2].bytes_per_ms)
    assert "dear" in picked.skipped  # 40 ms + 5 ms is past 42
    assert picked.frontier[-1].step_ms == pytest.approx(39.9)


def test_a_step_already_past_the_bound_still_takes_what_costs_no_time() -> None:
    """The base plan can end just past the allowance (measured once more, with the update added): a lever that adds
    no time cannot carry it further past, so it is taken; one that adds time is not."""
    levers = [_lever("state:fc", ("bf16", 12, 0.0), ("8bit", 18, 3.0)), _lever("saved:act", ("recompute", 20, 1.0)),
              _lever("state:head", ("bf16", 1, -0.2))]
    picked = take_cheapest(levers, 100 * MiB, step_ms=232.0, max_ms=231.5)
    assert {label: option.value for label, option in picked.chosen.items()} == {"state:fc": "bf16",
                                                                                "state:head": "bf16"}
    assert picked.frontier[-1].step_bytes == 87 * MiB and picked.frontier[-1].step_ms == pytest.approx(231.8)
    assert "saved:act" in picked.skipped and "state:fc" in picked.skipped  # its 8-bit increment adds 3 ms
    assert not any(point.past_bound for point in picked.frontier[1:])  # the levers did not carry it past
    # timed whole it runs past the bound, as its base did: what adds no time is not given back
    assert levers_past(picked, start_ms=232.0, max_ms=231.5, measured_ms=233.0) == {}


def test_nothing_to_take_keeps_the_step_as_it_is() -> None:
    picked = take_cheapest([_lever("none", ("fp8", 0, 1.0))], 100 * MiB, 10.0, 20.0)
    assert picked.chosen == {} and len(picked.frontier) == 1 and "every lever" in picked.stopped


def test_a_budget_goes_past_the_bound_only_when_asked_and_marks_those_points() -> None:
    levers = [_lever("a", ("x", 10, 1.0)), _lever("b", ("x", 10, 2.0)), _lever("c", ("x", 10, 4.0))]
    held = take_cheapest(levers, 100 * MiB, 10.0, max_ms=13.5, target_bytes=75 * MiB)
    assert list(held.chosen) == ["a", "b"] and not held.met and "time allowed is spent" in held.stopped
    past = take_cheapest(levers, 100 * MiB, 10.0, max_ms=13.5, target_bytes=75 * MiB, past_bound=True)
    assert list(past.chosen) == ["a", "b", "c"] and past.met and past.skipped == {}
    assert [p.past_bound for p in past.frontier] == [False, False, False, True]
    assert "past the 13.500 ms allowed" in past.stopped
    # met within the bound: nothing past it
    assert take_cheapest(levers, 100 * MiB, 10.0, 13.5, 85 * MiB, past_bound=True).frontier[-1].past_bound is False


def test_a_forecast_too_kind_gives_back_the_increments_past_the_shrunk_allowance() -> None:
    state = _lever("state:w", ("bf16", 16, 1.0), ("8bit", 24, 1.8))
    saved = _lever("saved:y", ("fp8", 10, 0.8))
    forced = _lever("saved:z", ("fp8", 5, 3.0), forced=True)
    picked = take_cheapest([state, saved, forced], 100 * MiB, 10.0, max_ms=16.0)
    # forced 3.0, then w=bf16 (+1.0), y (+0.8), w=8bit (+0.8): forecast 15.6 ms
    assert picked.frontier[-1].step_ms == pytest.approx(15.6)
    assert levers_past(picked, 10.0, 16.0, measured_ms=15.9) == {}  # within as measured
    # measured 17.0: the levers added 7.0 ms against 5.6 forecast (x1.25), so 6 ms allowed shrink to 4.8: the
    # increments past 4.8 ms go back: w's 8bit step (5.6 ms) falls back to bf16; y (4.8 ms) just stays
    assert levers_past(picked, 10.0, 16.0, measured_ms=17.0) == {"state:w": "bf16"}
    # far slower: everything but the forced lever goes back
    assert levers_past(picked, 10.0, 16.0, measured_ms=40.0) == {"state:w": None, "saved:y": None}


def test_a_whole_step_within_its_rounds_doubt_of_the_bound_keeps_the_forecast() -> None:
    """The levers fill the room up to the bound, so the median of a few whole-step rounds reads past it about every
    other search: only a step past the bound at the rounds' fast end shows the forecast too kind (the default
    example gave back 20 MiB for a step read 0.65 % past: 1146.5 against 1139.0 ms)."""
    state = _lever("state:w", ("bf16", 16, 1.0), ("8bit", 24, 1.8))
    saved = _lever("saved:y", ("fp8", 10, 0.8))
    picked = take_cheapest([state, saved], 100 * MiB, 10.0, max_ms=13.0)
    assert picked.frontier[-1].step_ms == pytest.approx(12.6)
    # the median past the bound, the fast end not: within the rounds' doubt, nothing given back
    assert levers_past(picked, 10.0, 13.0, measured_ms=13.4, measured_fast_ms=12.9) == {}
    # past it at the fast end too: the median's error shrinks the allowance, as without the interval
    past = levers_past(picked, 10.0, 13.0, measured_ms=13.4, measured_fast_ms=13.1)
    assert past == levers_past(picked, 10.0, 13.0, measured_ms=13.4) == {"state:w": "bf16"}


def test_levers_of_repeated_blocks_pool_per_dimension_and_keep_other_dimensions_apart() -> None:
    from types import SimpleNamespace

    from torch import nn

    from lightning_comp.plan.dimensions import Dimension
    from lightning_comp.search.stages.memory_lever_options import LeverBuilder, LeverChange

    modules = {f"blocks.{i}.fc": nn.Linear(4, 4) for i in range(3)} | {"head": nn.Linear(4, 2)}
    builder = LeverBuilder(SimpleNamespace(modules=modules, config=None))  # type: ignore[arg-type]
    levers, changes, firsts = [], {}, {}
    for name in modules:
        for dimension, value, nbytes, ms in (("saved", "bf16", 10, 1.0), ("state", "8bit", 30, 2.0)):
            label = f"{dimension}:{name}"
            levers.append(_lever(label, (value, nbytes, ms)))
            changes[label] = {value: LeverChange({name: {Dimension(dimension): value}})}
            firsts[label] = name
    pooled, writes = builder._pooled(levers, changes, firsts)
    by_label = {lever.label: lever for lever in pooled}
    assert set(by_label) == {"saved:blocks.*.fc (x3)", "state:blocks.*.fc (x3)", "saved:head", "state:head"}
    saved, state = by_label["saved:blocks.*.fc (x3)"], by_label["state:blocks.*.fc (x3)"]
    assert [(o.value, o.bytes_saved / MiB, o.extra_ms) for o in saved.options] == [("bf16", 30, 3.0)]
    assert [(o.value, o.bytes_saved / MiB, o.extra_ms) for o in state.options] == [("8bit", 90, 6.0)]
    assert writes["saved:blocks.*.fc (x3)"]["bf16"].values == {
        f"blocks.{i}.fc": {Dimension.SAVED: "bf16"} for i in range(3)}
    assert set(writes) == set(by_label)


def test_a_recompute_unit_is_priced_over_every_operator_it_timed_and_not_pooled_again() -> None:
    from types import SimpleNamespace

    from torch import nn

    from lightning_comp.operators.kinds import OperatorKind
    from lightning_comp.plan.plan import PrecisionPlan
    from lightning_comp.search.config import SearchConfig
    from lightning_comp.search.decisions.operators import OperatorDecision
    from lightning_comp.search.decisions.saved import SavedDecision
    from lightning_comp.search.measurement.profiling import OperatorMeasurement
    from lightning_comp.search.stages.memory_lever_options import LeverBuilder

    names = ["blocks.0.fc", "blocks.0.act", "blocks.1.fc", "blocks.1.act"]
    modules = {n: nn.Linear(4, 4) if n.endswith("fc") else nn.ReLU() for n in names}
    builder = LeverBuilder(SimpleNamespace(modules=modules, config=SearchConfig(objective="memory")))  # type: ignore[arg-type]
    decisions = {n: OperatorDecision(type(m).__name__, OperatorKind.COMPUTE if n.endswith("fc") else OperatorKind.OTHER,
                                     16, fp32=OperatorMeasurement(forward_ms=1.0, compute_ms=1.0, backward_ms=1.0))
                 for n, m in modules.items()}
    # two units, each an activation timed with the Linear that consumes (and recomputes) it, judged apart
    for block, ratio in (("0", 1.1), ("1", 3.0)):
        act = f"blocks.{block}.act"
        decisions[act].saved = SavedDecision(bytes={"fp32": 4 * MiB, "recompute": 0},
                                             time_ratios={"recompute": [ratio, ratio, ratio]},
                                             unit=act, timed=(act, f"blocks.{block}.fc"))
    levers, _ = builder.build(PrecisionPlan(), decisions)
    by_label = {lever.label: lever for lever in levers}
    assert set(by_label) == {"saved:blocks.0.act", "saved:blocks.1.act"}  # not one pooled lever
    # 4 ms of forward and backward timed (2 ms each, the activation and its consumer): x1.1 -> 0.4 ms, x3.0 -> 8 ms
    # (priced over the activation alone, they would read 0.2 and 4 ms)
    assert by_label["saved:blocks.0.act"].options[0].extra_ms == pytest.approx(0.4)
    assert by_label["saved:blocks.1.act"].options[0].extra_ms == pytest.approx(8.0)


def test_weighing_time_takes_only_what_makes_the_step_better_in_time_x_memory() -> None:
    """The balanced objective: a lever is taken where the share of the step's bytes it frees exceeds the share of
    time it adds; a free one always; a dear one is left out though the bound would allow it."""
    levers = [
        _lever("state:fc", ("bf16", 20, 0.0)),  # free
        _lever("saved:act", ("recompute", 18, 5.0)),  # 10 % of the bytes left for 5 % more time: better
        _lever("saved:attn", ("fp8", 4, 20.0)),  # 2.5 % of the bytes for 19 % more time: worse
    ]
    picked = take_cheapest(levers, 200 * MiB, 100.0, math.inf, weigh_time=True)
    assert list(picked.chosen) == ["state:fc", "saved:act"]
    assert "not better in time x memory" in picked.skipped["saved:attn"]
    assert picked.stopped == "every lever left costs more time than it frees bytes (time x memory)"
    # without weighing time (the memory objective) the bound alone decides
    assert list(take_cheapest(levers, 200 * MiB, 100.0, math.inf).chosen) == ["state:fc", "saved:act", "saved:attn"]
    # within a bound that stops the dear one first, the bound is what the record says stopped it
    bounded = take_cheapest(levers, 200 * MiB, 100.0, 106.0, weigh_time=True)
    assert list(bounded.chosen) == ["state:fc", "saved:act"] and "time allowed is spent" in bounded.stopped


def test_the_base_plans_step_is_on_the_scale_of_the_pace_it_was_judged_against() -> None:
    from lightning_comp.search.decisions.whole_step import ComparedPlan, PlanStep
    from lightning_comp.search.measurement.estimates import RatioEstimate
    from lightning_comp.search.stages.memory_stage import on_pace_scale

    fp32, amp, low = ComparedPlan.FP32, ComparedPlan.AMP, ComparedPlan.ALL_LOW
    steps = {fp32: PlanStep(ms=304.6, wall_ms=304.6),
             # its fastest round (224.76) against FP32's, 0.738, is not the median of its paired ratios (0.7174)
             low: PlanStep(ms=224.76, wall_ms=224.76, ratio=RatioEstimate(0.7174, 0.6605, 0.7472, 4, 0.875)),
             amp: PlanStep(ms=220.4, wall_ms=220.4)}
    assert on_pace_scale(steps, low) == pytest.approx(304.6 * 0.7174)
    assert on_pace_scale(steps, amp) == 220.4  # no paired ratio: its own round
    assert on_pace_scale(steps, ComparedPlan.COMPUTE) == 304.6  # not timed: FP32's


def test_a_recompute_unit_and_its_consumers_codec_are_one_lever_of_exclusive_options() -> None:
    """Recomputed, the GELU's output is a recipe wherever it is saved, so the next Linear's fp8 copy of it frees
    nothing more; as two levers both were taken in a run of the default example, and the accounting counted the
    8 MiB twice. As one lever, the codec and the recomputation are alternatives: the hull climbs from one to the
    other, and what is written is one of them."""
    from types import SimpleNamespace

    from torch import nn

    from lightning_comp.operators.kinds import OperatorKind
    from lightning_comp.plan.dimensions import Dimension
    from lightning_comp.plan.plan import PrecisionPlan
    from lightning_comp.search.config import SearchConfig
    from lightning_comp.search.decisions.operators import OperatorDecision
    from lightning_comp.search.decisions.saved import SavedDecision
    from lightning_comp.search.measurement.profiling import OperatorMeasurement
    from lightning_comp.search.stages.memory_lever_options import LeverBuilder

    modules = {"fc": nn.Linear(4, 16), "act": nn.GELU(), "proj": nn.Linear(16, 4), "norm": nn.LayerNorm(4)}
    ctx = SimpleNamespace(modules=modules, config=SearchConfig(objective="memory"))
    decisions = {n: OperatorDecision(type(m).__name__, OperatorKind.COMPUTE, 16,
                                     fp32=OperatorMeasurement(forward_ms=1.0, compute_ms=1.0, backward_ms=1.0))
                 for n, m in modules.items()}
    decisions["act"].saved = SavedDecision(bytes={"fp32": 16 * MiB, "recompute": 8 * MiB},
                                           time_ratios={"recompute": [1.5, 1.4, 1.6]}, unit="act",
                                           timed=("act", "proj"))
    decisions["proj"].saved = SavedDecision(bytes={"fp32": 8 * MiB, "fp8": 4 * MiB},
                                            time_ratios={"fp8": [1.2, 1.1, 1.3]})
    decisions["norm"].saved = SavedDecision(bytes={"fp32": 4 * MiB, "fp8": 1 * MiB},
                                            time_ratios={"fp8": [1.1, 1.0, 1.2]})
    levers, changes = LeverBuilder(ctx).build(PrecisionPlan(), decisions)  # type: ignore[arg-type]
    by_label = {lever.label: lever for lever in levers}
    assert set(by_label) == {"saved:act / proj", "saved:norm"}  # the norm's codec feeds no unit: apart
    both = by_label["saved:act / proj"]
    assert [(o.value, o.bytes_saved / MiB, o.extra_ms) for o in both.options] == [
        ("fp8", 4.0, pytest.approx(0.4)), ("recompute", 8.0, pytest.approx(2.0))]
    assert changes["saved:act / proj"]["recompute"].values == {"act": {Dimension.SAVED: "recompute"}}
    assert changes["saved:act / proj"]["fp8"].values == {"proj": {Dimension.SAVED: "fp8"}}
    # with no bound, the recomputation is taken through the codec (never both): 8 MiB freed, not 12
    picked = take_cheapest([both], 100 * MiB, 10.0, math.inf)
    assert picked.chosen["saved:act / proj"].value == "recompute"
    assert picked.frontier[-1].step_bytes == pytest.approx(92 * MiB)
