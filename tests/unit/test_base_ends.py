"""Where the levers' base rule chooses an alternative to the candidates, the levers are spent on both and the better
end is kept: which plans are measured beside each other, and which end is better (memory and balanced objectives)."""

from __future__ import annotations

import math

from lightning_comp.search.config import Objective, SearchConfig
from lightning_comp.search.decisions.cheapest_bytes import LeverOption, MemorySpending, OtherBase, Selection
from lightning_comp.search.decisions.levers_base import better_end, measured_beside
from lightning_comp.search.decisions.objectives import ObjectivePolicy, policy_for
from lightning_comp.search.decisions.whole_step import ComparedPlan, StepComparison
from lightning_comp.search.record.text import _spending_section

FP32, CANDIDATES, AMP = ComparedPlan.FP32, ComparedPlan.CANDIDATES, ComparedPlan.AMP
COMPUTE, ALL_LOW = ComparedPlan.COMPUTE, ComparedPlan.ALL_LOW
MiB = 2**20
MEMORY, BALANCED = Objective.MEMORY, Objective.BALANCED


def _policy(objective: str, levers: bool = True, **settings: float) -> ObjectivePolicy:
    precisions = {} if levers else {"precisions": {"saved": "off", "state": "off", "master": "off"}}
    return policy_for(SearchConfig(objective=objective, **precisions, **settings))  # type: ignore[arg-type]


def _steps(ms: dict[ComparedPlan, float]) -> StepComparison:
    wiggle = [1.0, 1.002, 0.999, 1.001, 0.998, 1.0]
    return StepComparison({plan: [v * w for w in wiggle] for plan, v in ms.items()})


def _end(start_mib: float, final_mib: float, start_ms: float, extra_ms: float, max_ms: float = 110.0,
         target_mib: float | None = None, met: bool = True) -> MemorySpending:
    """A spending from ``start_mib`` to ``final_mib`` whose levers add ``extra_ms`` to ``start_ms``."""
    option = LeverOption("recompute", (start_mib - final_mib) * MiB, extra_ms)
    return MemorySpending(start_bytes=start_mib * MiB, start_ms=start_ms, max_ms=max_ms,
                          target_bytes=None if target_mib is None else target_mib * MiB, amp_step_bytes=None,
                          selection=Selection(chosen={"saved:x": option}, met=met), final_bytes=final_mib * MiB)


# the default example's run b (2026-12-08): all-low 25 MiB leaner than the candidates, x1.04 of their step
STEPS = {FP32: 234.3, CANDIDATES: 102.7, AMP: 106.2, ALL_LOW: 106.9, COMPUTE: 95.8}
SAVED = {FP32: 134.3, CANDIDATES: 93.3, AMP: 77.3, ALL_LOW: 68.3, COMPUTE: 113.3}


def test_an_alternative_base_is_measured_beside_the_candidates_only_where_levers_are_spent() -> None:
    steps = _steps(STEPS)
    policy = _policy("memory")
    policy.set_pace(steps.pace())
    labels = [AMP, ALL_LOW, COMPUTE]
    base = policy.winner(steps, SAVED, labels, True)
    assert base is ALL_LOW  # the rule's guess: the time it loses priced at the candidates' own bytes per ms
    assert measured_beside(policy, steps, SAVED, labels, True, base) is ALL_LOW
    assert measured_beside(policy, steps, SAVED, labels, False, base) is None  # no candidates
    plain = _policy("memory", levers=False)  # no levers: the plan's bytes are its end
    plain.set_pace(steps.pace())
    assert measured_beside(plain, steps, SAVED, labels, True, plain.winner(steps, SAVED, labels, True)) is None
    assert measured_beside(_policy("throughput"), steps, SAVED, labels, True, AMP) is None


def test_where_the_candidates_win_by_less_than_the_margin_the_runner_up_is_measured_beside() -> None:
    # litgpt, balanced, seed 1 (2026-12-08): the candidates and the compute-only plan (the pace) 1 MiB apart and
    # x1.03 of each other's step; the rule kept the candidates by 0.3 % of cost
    steps = _steps({FP32: 44.0, CANDIDATES: 28.8, AMP: 41.5, ALL_LOW: 38.8, COMPUTE: 29.8})
    saved = {FP32: 43.2, CANDIDATES: 32.7, AMP: 28.7, ALL_LOW: 27.7, COMPUTE: 31.7}
    policy = _policy("balanced")
    policy.set_pace(steps.pace())
    assert policy.winner(steps, saved, [AMP, ALL_LOW, COMPUTE], True) is None
    assert measured_beside(policy, steps, saved, [AMP, ALL_LOW, COMPUTE], True, None) is COMPUTE
    # a runner-up the rule tells apart (its cost 20 % past the candidates') is not measured
    fat = {**saved, COMPUTE: 45.0}
    assert policy.winner(steps, fat, [AMP, ALL_LOW, COMPUTE], True) is None
    assert measured_beside(policy, steps, fat, [AMP, ALL_LOW, COMPUTE], True, None) is None


def test_candidates_past_the_bound_beyond_doubt_are_not_measured_beside() -> None:
    # gpt balanced, seed 0 (2026-12-08): the candidates x1.15 of the pace, the bound 1.05x
    steps = _steps({FP32: 231.4, CANDIDATES: 105.0 * 1.05, AMP: 105.4, ALL_LOW: 106.4, COMPUTE: 95.9})
    policy = _policy("balanced")
    policy.set_pace(steps.pace())
    for base in (COMPUTE, None):
        assert measured_beside(policy, steps, SAVED, [AMP, ALL_LOW, COMPUTE], True, base) is None


def test_the_memory_objective_keeps_the_leaner_end_and_a_tie_keeps_the_candidates() -> None:
    candidates = _end(119.0, 52.5, 100.0, 9.0)
    alternative = _end(94.0, 87.5, 108.0, 1.8)  # leaner to start, with little room left
    assert better_end(MEMORY, candidates, alternative) is None
    assert better_end(MEMORY, alternative, candidates) == "leaner (52.5 against 87.5 MiB)"
    assert better_end(MEMORY, candidates, _end(119.0, 52.5, 90.0, 5.0)) is None  # as lean, faster: a tie in bytes
    assert better_end(MEMORY, candidates, _end(94.0, 50.0, 108.0, 1.8)) == "leaner (50.0 against 52.5 MiB)"


def test_an_end_within_its_bound_beats_one_past_it_and_a_met_budget_beats_a_missed_one() -> None:
    past = _end(119.0, 40.0, 105.0, 9.0, max_ms=110.0)  # 114 ms against 110 allowed
    within = _end(119.0, 60.0, 100.0, 9.0, max_ms=110.0)
    assert not past.within_bound and within.within_bound
    assert better_end(MEMORY, past, within) == "within its bound where the other is not"
    assert better_end(MEMORY, within, past) is None
    # with a budget: meeting it wins, then the faster of two that meet it
    met = _end(119.0, 60.0, 100.0, 9.0, target_mib=64.0)
    missed = _end(119.0, 66.0, 95.0, 2.0, target_mib=64.0, met=False)
    assert better_end(MEMORY, missed, met) == "meets the budget where the other does not"
    assert better_end(MEMORY, met, missed) is None
    faster = _end(110.0, 63.0, 96.0, 4.0, target_mib=64.0)
    assert better_end(MEMORY, met, faster) == "meets the budget faster (100.00 against 109.00 ms)"


def test_the_balanced_objective_keeps_the_end_of_the_better_score() -> None:
    lean_slow = _end(119.0, 60.0, 100.0, 9.0)  # 60 MiB at 109 ms: 6540
    fat_fast = _end(119.0, 70.0, 90.0, 4.0)  # 70 MiB at 94 ms: 6580
    assert better_end(BALANCED, fat_fast, lean_slow) == ("better in time x memory (60.0 MiB at 109.00 ms against 70.0"
                                                      " MiB at 94.00 ms)")
    assert better_end(BALANCED, lean_slow, fat_fast) is None


def test_the_record_says_where_the_levers_were_also_spent() -> None:
    from types import SimpleNamespace

    from lightning_comp.search.record.spending import spending_record

    kept = _end(119.0, 52.5, 100.0, 9.0)
    kept.other_base = OtherBase(base="all-low's plan", start_bytes=94.0 * MiB, final_bytes=87.5 * MiB, end_ms=109.8,
                                max_ms=math.inf, met=True, why="leaner (52.5 against 87.5 MiB)")
    record = spending_record(SimpleNamespace(memory_spending=kept))  # type: ignore[arg-type]
    assert record is not None
    assert record["other_base"] == {"base": "all-low's plan", "start_mib": 94.0, "final_mib": 87.5, "end_ms": 109.8,
                                    "max_ms": None, "met": True, "why": "leaner (52.5 against 87.5 MiB)"}
    text = "\n".join(_spending_section(record))
    assert ("The levers were also spent on all-low's plan: from 94.0 MiB to 87.5 MiB at 109.80 ms; this base's end is"
            " leaner (52.5 against 87.5 MiB).") in text
    kept.other_base = None
    assert spending_record(SimpleNamespace(memory_spending=kept))["other_base"] is None  # type: ignore[arg-type,index]


def test_the_other_base_is_not_part_of_the_checkpointed_state() -> None:
    from lightning_comp.common.typed_plain import from_plain, to_plain

    end = _end(119.0, 52.5, 100.0, 9.0)
    end.other_base = OtherBase("x", 1.0, 1.0, 1.0, 1.0, True, "y")
    plain = to_plain(end)
    assert "other_base" not in plain  # the state's format is unchanged (version-5 checkpoints load)
    assert from_plain(MemorySpending, plain).other_base is None
