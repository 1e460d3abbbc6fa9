"""The memory and balanced objectives bound their slowdown against the fastest fixed policy measured (the pace),
not against FP32: the numbers are the issue's (AMP's step about half FP32's where bf16 pays)."""

from __future__ import annotations

import pytest

from lightning_comp import CoMPSearch
from lightning_comp.errors import SearchConfigError
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.decisions.levers_base import base_for_the_levers
from lightning_comp.search.decisions.objectives import policy_for
from lightning_comp.search.decisions.parameters import StepBudget, judge_lowering
from lightning_comp.search.decisions.whole_step import ComparedPlan, Pace, PlanStep, StepComparison
from lightning_comp.search.measurement.estimates import RatioEstimate, Verdict
from lightning_comp.search.stages.memory_stage import bound_step, on_pace_scale

FP32, CANDIDATES, AMP = ComparedPlan.FP32, ComparedPlan.CANDIDATES, ComparedPlan.AMP
COMPUTE, ALL_LOW, AUTOCAST = ComparedPlan.COMPUTE, ComparedPlan.ALL_LOW, ComparedPlan.AUTOCAST


def _steps(ms: dict[ComparedPlan, float], rounds: int = 6) -> StepComparison:
    """Steady rounds (within 0.2 % of each other) around each plan's step."""
    wiggle = [1.0, 1.002, 0.999, 1.001, 0.998, 1.0][:rounds]
    return StepComparison({plan: [v * w for w in wiggle] for plan, v in ms.items()})


NO_LEVERS = {"saved": "off", "state": "off", "master": "off"}


def _policy(objective: str, levers: bool = False, **settings: float) -> object:
    """The policy of ``objective``; without ``levers`` the memory dimensions are off (the plan's bytes are the whole
    step's: the leanest within the bound wins), with them on (the plan is chosen for the levers' room)."""
    precisions = {} if levers else {"precisions": NO_LEVERS}
    return policy_for(SearchConfig(objective=objective, **precisions, **settings))  # type: ignore[arg-type]


def test_the_pace_is_the_fastest_fixed_policy_never_the_candidates_or_all_low() -> None:
    steps = _steps({FP32: 100, CANDIDATES: 40, AMP: 55, ALL_LOW: 30, COMPUTE: 52, AUTOCAST: 50})
    assert steps.pace() == Pace(AUTOCAST, pytest.approx(0.5, rel=1e-3))
    assert _steps({FP32: 100, CANDIDATES: 40, ALL_LOW: 30}).pace().plan is FP32  # emulated bf16: only fp32 timed
    # a tie goes to the policy timed first of PACE_PLANS (fp32 before AMP's plan)
    assert _steps({FP32: 100, AMP: 100}).pace().plan is FP32


def test_memory_rejects_candidates_within_the_old_fp32_bound_but_past_the_fastest_policy() -> None:
    # the gpt: AMP at 0.5 of fp32; the lean candidates at 0.68 of fp32 (x1.36 of AMP), within 1.5x fp32
    policy = _policy("memory")
    steps = _steps({FP32: 100, CANDIDATES: 68, AMP: 50, AUTOCAST: 49})
    policy.set_pace(steps.pace())  # type: ignore[attr-defined]
    assert policy.candidates_pay(steps) is Verdict.ABOVE  # type: ignore[attr-defined]
    saved = {FP32: 100.0, CANDIDATES: 40.0, AMP: 60.0, AUTOCAST: 60.0}
    # AMP's plan is within the bound (x1.02 of autocast) and is chosen instead: never slower and fatter than AMP's
    assert policy.winner(steps, saved, [AMP], True) is AMP  # type: ignore[attr-defined]
    # the old bound, against fp32, would have kept the candidates
    old = _policy("memory", max_slowdown_vs_fastest=1.5)
    old.set_pace(Pace())  # type: ignore[attr-defined]
    assert old.candidates_pay(steps) is Verdict.BELOW  # type: ignore[attr-defined]


def test_memory_keeps_lean_candidates_within_the_bound_and_the_leanest_alternative_otherwise() -> None:
    policy = _policy("memory")  # 1.15 by default
    steps = _steps({FP32: 100, CANDIDATES: 56, AMP: 50, COMPUTE: 52, ALL_LOW: 70})
    policy.set_pace(steps.pace())  # type: ignore[attr-defined]
    assert policy.pace.plan is AMP  # type: ignore[attr-defined]
    saved = {FP32: 100.0, CANDIDATES: 40.0, AMP: 60.0, COMPUTE: 62.0, ALL_LOW: 20.0}
    assert policy.candidates_pay(steps) is Verdict.BELOW  # type: ignore[attr-defined]  # x1.12 of AMP's
    # all-low is leaner but x1.4 of AMP's step: past the bound
    assert policy.winner(steps, saved, [AMP, COMPUTE, ALL_LOW], True) is None  # type: ignore[attr-defined]
    # nothing within the bound but the pace: the fastest alternative beats slow candidates
    slow = _steps({FP32: 100, CANDIDATES: 90, AMP: 50, ALL_LOW: 70})
    policy.set_pace(slow.pace())  # type: ignore[attr-defined]
    assert policy.winner(slow, saved, [AMP, ALL_LOW], True) is AMP  # type: ignore[attr-defined]


def test_past_the_bound_a_plan_faster_only_within_the_noise_does_not_displace_a_leaner_one() -> None:
    # a small model where one global autocast region (a reference, never trialled) is the pace and every plan is
    # past the bound: the compute-only plan, 1 % faster than the candidates by the median, saves 2.8x their bytes
    policy = _policy("memory")
    noisy = StepComparison({FP32: [100, 101, 99, 100, 102, 98], CANDIDATES: [87, 84, 89, 86, 88, 85],
                            COMPUTE: [86, 88, 84, 87, 85, 86], AUTOCAST: [65, 66, 64, 65, 65, 66]})
    policy.set_pace(noisy.pace())  # type: ignore[attr-defined]
    assert policy.pace.plan is AUTOCAST  # type: ignore[attr-defined]
    saved = {FP32: 1.1, CANDIDATES: 0.57, COMPUTE: 1.6, AUTOCAST: 0.97}
    assert policy.winner(noisy, saved, [COMPUTE], True) is None  # type: ignore[attr-defined]
    # tied on speed and leaner than the candidates: the alternative
    assert policy.winner(noisy, {**saved, COMPUTE: 0.4}, [COMPUTE], True) is COMPUTE  # type: ignore[attr-defined]
    # faster beyond the margin: the fastest wins, whatever it saves (nothing is within the bound; speed first)
    fast = StepComparison({**noisy.ms, COMPUTE: [78, 79, 77, 78, 80, 78]})  # x1.2 of the pace: past it too
    policy.set_pace(fast.pace())  # type: ignore[attr-defined]
    assert policy.winner(fast, saved, [COMPUTE], True) is COMPUTE  # type: ignore[attr-defined]


def test_with_levers_memory_builds_on_the_fastest_plan_not_the_leanest_within_the_bound() -> None:
    # the default example's seed-1 run: all-low leanest (x1.11 of the pace, within 1.15), the compute-only plan and
    # the candidates fastest; the levers would have 14 ms left on all-low, 40 ms on the candidates
    policy = _policy("memory", levers=True)
    assert policy.spends_levers  # type: ignore[attr-defined]
    steps = _steps({FP32: 316, CANDIDATES: 201, AMP: 220, ALL_LOW: 219, COMPUTE: 198})
    policy.set_pace(steps.pace())  # type: ignore[attr-defined]
    assert policy.pace.plan is COMPUTE  # type: ignore[attr-defined]
    saved = {FP32: 140.0, CANDIDATES: 98.0, AMP: 81.0, ALL_LOW: 72.0, COMPUTE: 119.0}
    # the candidates are within 1.5 % of the fastest (not beaten by the margin): the leaner of the two is built on
    assert policy.winner(steps, saved, [AMP, ALL_LOW, COMPUTE], True) is None  # type: ignore[attr-defined]
    # where the compute-only plan is the leaner of the two fastest, it is the base
    assert policy.winner(steps, {**saved, COMPUTE: 90.0}, [AMP, ALL_LOW, COMPUTE], True) is COMPUTE  # type: ignore[attr-defined]
    # the rule without levers: the leanest within the bound (all-low)
    plain = _policy("memory")
    plain.set_pace(steps.pace())  # type: ignore[attr-defined]
    assert plain.winner(steps, saved, [AMP, ALL_LOW, COMPUTE], True) is ALL_LOW  # type: ignore[attr-defined]


def test_with_levers_a_faster_base_must_buy_back_the_bytes_it_keeps() -> None:
    # the default example's run at 2026-12-06 13:45: the compute-only plan ran x0.945 of the candidates' step and
    # keeps 20 MiB more for backward; the levers buy bytes at about the candidates' own bytes per millisecond, so
    # its 12 ms buy back ~5 MiB, not 20: the candidates stay (the rule before took the fastest, 22 MiB fatter at the
    # end)
    policy = _policy("memory", levers=True)
    steps = _steps({FP32: 323.3, CANDIDATES: 228.1, AMP: 244.2, ALL_LOW: 257.4, COMPUTE: 215.5})
    policy.set_pace(steps.pace())  # type: ignore[attr-defined]
    saved = {FP32: 134.3, CANDIDATES: 93.3, AMP: 77.3, ALL_LOW: 68.3, COMPUTE: 113.3}
    assert policy.winner(steps, saved, [AMP, ALL_LOW, COMPUTE], True) is None  # type: ignore[attr-defined]
    # at x0.75 of the candidates' step its 57 ms would buy more than the 20 MiB it keeps: it is the base
    fast = _steps({FP32: 323.3, CANDIDATES: 228.1, AMP: 244.2, ALL_LOW: 257.4, COMPUTE: 171.0})
    policy.set_pace(fast.pace())  # type: ignore[attr-defined]
    assert policy.winner(fast, saved, [AMP, ALL_LOW, COMPUTE], True) is COMPUTE  # type: ignore[attr-defined]
    # a leaner plan slower by more than the margin is no base, however lean (all-low at x1.13)
    assert policy.winner(steps, {**saved, ALL_LOW: 10.0}, [AMP, ALL_LOW], True) is None  # type: ignore[attr-defined]
    # within the margin, a leaner plan is (AMP's at x1.04 of the candidates', 16 MiB leaner)
    near = _steps({FP32: 323.3, CANDIDATES: 228.1, AMP: 237.2, ALL_LOW: 257.4, COMPUTE: 215.5})
    policy.set_pace(near.pace())  # type: ignore[attr-defined]
    assert policy.winner(near, saved, [AMP, ALL_LOW, COMPUTE], True) is AMP  # type: ignore[attr-defined]


def test_with_levers_a_load_spike_does_not_tie_a_slow_lean_plan_with_the_fastest() -> None:
    # the default example's second run: load spikes stretched the plans' intervals (one to x2.6 of its median); by
    # their intervals nothing was beaten beyond doubt and the leanest, all-low at x1.12 of the candidates' median, was
    # built on; by the median the candidates lead it (and AMP's plan, within the margin of them and leaner, wins)
    policy = _policy("memory", levers=True)
    fp32 = [295.0, 296.0, 294.0, 297.0, 295.0, 296.0]
    steps = StepComparison({FP32: fp32, CANDIDATES: [183.0, 185.0, 520.0, 186.0, 610.0, 183.0],
                            AMP: [191.0, 193.0, 192.0, 194.0, 190.0, 192.0],
                            ALL_LOW: [206.0, 207.0, 205.0, 207.0, 206.0, 206.0]})
    policy.set_pace(steps.pace())  # type: ignore[attr-defined]
    saved = {FP32: 134.0, CANDIDATES: 93.0, AMP: 77.0, ALL_LOW: 68.0}
    assert steps.faster(CANDIDATES, ALL_LOW, 0.05) is not Verdict.BELOW  # not beyond doubt
    assert policy.winner(steps, saved, [AMP, ALL_LOW], True) is AMP  # type: ignore[attr-defined]  # x1.04: tied, leaner


def test_with_levers_a_plan_past_the_bound_is_no_base_and_noise_buys_rounds() -> None:
    policy = _policy("memory", levers=True)
    # the candidates are past the bound beyond doubt (a global autocast region is the pace): AMP's plan, within it,
    # is the base
    steps = _steps({FP32: 100, CANDIDATES: 70, AMP: 56, AUTOCAST: 50})  # AMP's plan at x1.12 of the pace
    policy.set_pace(steps.pace())  # type: ignore[attr-defined]
    assert policy.candidates_pay(steps) is Verdict.ABOVE  # type: ignore[attr-defined]
    assert policy.winner(steps, {FP32: 100.0, CANDIDATES: 40.0, AMP: 60.0, AUTOCAST: 60.0}, [AMP], True) is AMP  # type: ignore[attr-defined]
    # which of two plans is faster cannot be told: the median decides, no round is added for it (only the bound's)
    noisy = StepComparison({FP32: [100.0] * 6, AMP: [50.0] * 6, ALL_LOW: [80.0] * 6,
                            CANDIDATES: [46.0, 53.0, 47.0, 52.0, 48.0, 51.0]})
    policy.set_pace(noisy.pace())  # type: ignore[attr-defined]
    assert policy.undecided(noisy, [AMP, ALL_LOW]) == frozenset()  # type: ignore[attr-defined]


def test_balanced_holds_its_score_to_the_bound_too() -> None:
    policy = _policy("balanced")  # 1.05
    steps = _steps({FP32: 100, CANDIDATES: 50, COMPUTE: 55, ALL_LOW: 60})
    policy.set_pace(steps.pace())  # type: ignore[attr-defined]
    saved = {FP32: 100.0, CANDIDATES: 90.0, COMPUTE: 100.0, ALL_LOW: 50.0}
    # all_low has the best score (0.55 vs 0.67) but is x1.09 of the compute-only plan's step: past 1.05
    assert policy.winner(steps, saved, [COMPUTE, ALL_LOW], True) is None  # type: ignore[attr-defined]
    loose = _policy("balanced", max_slowdown_vs_fastest=1.2)
    loose.set_pace(steps.pace())  # type: ignore[attr-defined]
    assert loose.winner(steps, saved, [COMPUTE, ALL_LOW], True) is ALL_LOW  # type: ignore[attr-defined]


def test_a_bound_no_plan_reaches_holds_back_no_plan() -> None:
    # the cnn seed-0 run: one global autocast region (a reference, never trialled) ran x0.93 of AMP's plan's step,
    # so every plan was past 1.05x of it; balanced then trialled FP32 (0.53x AMP's throughput, 1.95x its peak). Here
    # past memory's 1.15x too
    steps = _steps({FP32: 226, CANDIDATES: 136, AMP: 125, COMPUTE: 170, AUTOCAST: 100})
    saved = {FP32: 134.0, CANDIDATES: 130.0, AMP: 74.0, COMPUTE: 144.0, AUTOCAST: 74.0}
    for objective in ("balanced", "memory"):
        for levers in (False, True):
            policy = _policy(objective, levers=levers)
            policy.set_pace(steps.pace())  # type: ignore[attr-defined]
            assert policy.pace.plan is AUTOCAST  # type: ignore[attr-defined]
            assert steps.within(AMP, policy.pace, policy.slowdown) is Verdict.ABOVE  # type: ignore[attr-defined]
            assert policy.bound_holds(steps, AMP) is Verdict.BELOW  # type: ignore[attr-defined]
            # AMP's plan, fastest and leanest (and best in time x memory), is trialled instead of the candidates
            assert policy.winner(steps, saved, [AMP, COMPUTE], True) is AMP  # type: ignore[attr-defined]
            # with no alternative the candidates are kept, not dropped for FP32 (past the bound the most)
            alone = _steps({FP32: 226, CANDIDATES: 136, AUTOCAST: 100})
            assert policy.candidates_pay(alone) is not Verdict.ABOVE  # type: ignore[attr-defined]
    # where one plan is within the bound, it holds for the others
    near = _steps({FP32: 226, CANDIDATES: 136, AMP: 120, AUTOCAST: 116})
    policy = _policy("balanced")
    policy.set_pace(near.pace())  # type: ignore[attr-defined]
    assert policy.bound_holds(near, CANDIDATES) is Verdict.ABOVE  # type: ignore[attr-defined]


def test_undecided_names_the_plans_that_straddle_the_bound_with_the_pace() -> None:
    policy = _policy("memory")
    noisy = StepComparison({FP32: [100.0] * 6, AMP: [50.0] * 6,
                            CANDIDATES: [54.0, 62.0, 55.0, 61.0, 56.0, 60.0]})  # x1.08-1.24 of AMP's
    assert policy.undecided(noisy, [AMP]) == {CANDIDATES, AMP}  # type: ignore[attr-defined]
    clear = _steps({FP32: 100, AMP: 50, CANDIDATES: 52})
    assert policy.undecided(clear, [AMP]) == frozenset()  # type: ignore[attr-defined]


def test_parameter_levers_are_bounded_through_the_pace() -> None:
    config = SearchConfig(objective="memory")
    # the update of 8-bit state adds 6 ms (slow end) to a 55 ms step whose pace is 50 ms: x1.22 > 1.15
    budget = StepBudget(step_ms=55.0, pace_step_ms=50.0, step_bytes=1e8)
    estimate = RatioEstimate(2.0, 1.9, 3.0, 6, 0.9)
    ok, why, _ = judge_lowering(config, budget, 8_000_000, 2_000_000, 3.0, estimate)
    assert not ok and "past max_slowdown_vs_fastest 1.15" in why
    ok, _, _ = judge_lowering(config, budget, 8_000_000, 2_000_000, 1.0, estimate)  # +2 ms: x1.14
    assert ok


def test_the_old_setting_names_its_replacement() -> None:
    # a config file or command line naming the old setting (SearchConfig.of) is told what replaced it
    with pytest.raises(SearchConfigError, match=r"max_memory_slowdown=1.5.*max_slowdown_vs_fastest.*not against FP32"):
        SearchConfig.of({"objective": "memory", "max_memory_slowdown": 1.5})
    with pytest.raises(TypeError, match="max_memory_slowdown"):
        CoMPSearch(objective="memory", max_memory_slowdown=1.5)  # type: ignore[call-arg]
    with pytest.raises(SearchConfigError, match=r"max_slowdown_vs_fastest.*0.9.*>= 1"):
        CoMPSearch(objective="memory", max_slowdown_vs_fastest=0.9)
    assert SearchConfig(objective="memory").slowdown_vs_fastest == 1.15
    assert SearchConfig(objective="balanced").slowdown_vs_fastest == 1.05
    assert SearchConfig(objective="memory", max_slowdown_vs_fastest=2).slowdown_vs_fastest == 2.0


def test_memory_never_keeps_candidates_that_amp_beats_on_both_speed_and_bytes() -> None:
    policy = _policy("memory")
    steps = _steps({FP32: 100, CANDIDATES: 55, AMP: 50})
    policy.set_pace(steps.pace())  # type: ignore[attr-defined]
    # AMP's plan saves as little as the candidates (not leaner by the margin) and is faster: it wins
    assert policy.winner(steps, {FP32: 100.0, CANDIDATES: 60.0, AMP: 59.0}, [AMP], True) is AMP  # type: ignore[attr-defined]
    # the candidates are leaner by more than the margin: they stay, though slower (within the bound)
    assert policy.winner(steps, {FP32: 100.0, CANDIDATES: 40.0, AMP: 59.0}, [AMP], True) is None  # type: ignore[attr-defined]


def test_a_bound_the_rounds_cannot_tell_does_not_drop_the_candidates_for_fp32_surely_past_it() -> None:
    # the default example's balanced search (compare, seed 0): the candidates at x0.68 [0.64, 0.73] of FP32's step,
    # the pace the compute-only plan at x0.64, so the 1.05x bound was undecided for them; they were dropped for FP32
    # (x1.0: past the bound beyond doubt, and 1.9x AMP's saved bytes)
    wiggle = [0.93, 1.07, 0.95, 1.05, 0.97, 1.03]
    rounds = {FP32: [270.5] * 6, COMPUTE: [173.2] * 6, AMP: [182.8] * 6, CANDIDATES: [182.0 * w for w in wiggle]}
    steps = StepComparison(rounds)
    for policy in (_policy("balanced"), _policy("memory", max_slowdown_vs_fastest=1.05)):
        policy.set_pace(steps.pace())  # type: ignore[attr-defined]
        assert policy.bound_holds(steps, CANDIDATES) is Verdict.UNDECIDED  # type: ignore[attr-defined]
        assert policy.candidates_pay(steps) is Verdict.BELOW  # type: ignore[attr-defined]
    # where FP32 itself is within the bound (bf16 does not pay), an undecided bound still decides nothing
    slow_low = StepComparison({FP32: [100.0] * 6, AMP: [104.0] * 6, CANDIDATES: [98.0 * w for w in wiggle]})
    policy = _policy("balanced")
    policy.set_pace(slow_low.pace())  # type: ignore[attr-defined]
    assert policy.candidates_pay(slow_low) is not Verdict.BELOW  # type: ignore[attr-defined]


def test_with_levers_balanced_builds_on_a_plan_as_fast_and_leaner_than_the_candidates() -> None:
    # the cnn seed-0 compare at b47979b: the candidates (125.3 ms, 77.8 MiB saved) and AMP's plan (125.5 ms, 73.8 MiB)
    # tie on time; by score alone (no doubt-free win) the candidates stayed, the levers had 2.4 ms of room and ended
    # 1.02x AMP's step bytes at x1.04 of its step: worse than AMP's plan on both
    steps = _steps({FP32: 226.4, CANDIDATES: 125.3, AMP: 125.5, COMPUTE: 171.4, AUTOCAST: 123.2})
    saved = {FP32: 133.6, CANDIDATES: 77.8, AMP: 73.8, COMPUTE: 143.8, AUTOCAST: 74.3}
    levers = _policy("balanced", levers=True)
    assert levers.spends_levers  # type: ignore[attr-defined]
    levers.set_pace(steps.pace())  # type: ignore[attr-defined]
    assert levers.winner(steps, saved, [AMP, COMPUTE], True) is AMP  # type: ignore[attr-defined]
    # where the candidates are the leaner of the two, they stay
    assert levers.winner(steps, {**saved, CANDIDATES: 70.0}, [AMP, COMPUTE], True) is None  # type: ignore[attr-defined]
    # a plan past the bound is no base, however lean (the compute-only plan at x1.39 of the pace)
    assert levers.winner(steps, {**saved, COMPUTE: 10.0}, [COMPUTE], True) is None  # type: ignore[attr-defined]
    # without levers the score rule keeps the candidates: AMP's plan is not better beyond doubt by the margin
    plain = _policy("balanced")
    assert not plain.spends_levers  # type: ignore[attr-defined]
    plain.set_pace(steps.pace())  # type: ignore[attr-defined]
    assert plain.winner(steps, saved, [AMP, COMPUTE], True) is None  # type: ignore[attr-defined]


def test_candidates_dropped_by_the_bound_say_so_not_that_fp32_ties() -> None:
    # the message said "cannot be told apart from fp32 as a whole step" where it was the bound the rounds decided
    from types import SimpleNamespace

    from lightning_comp.numerics.precision import ComputePrecision
    from lightning_comp.operators.kinds import OperatorKind
    from lightning_comp.search.decisions.operators import OperatorDecision
    from lightning_comp.search.stages.batch_stage import BatchStage

    stage = BatchStage(SearchConfig(objective="memory"), ComputePrecision.BF16, None)  # type: ignore[arg-type]
    steps = _steps({FP32: 100, CANDIDATES: 68, AMP: 50, AUTOCAST: 49})  # the candidates x1.39 of the pace
    for objective, levers in (("memory", False), ("balanced", True)):
        policy = _policy(objective, levers=levers)
        policy.set_pace(steps.pace())  # type: ignore[attr-defined]
        ctx = SimpleNamespace(policy=policy, agree=lambda value: value)
        decisions = {"fc": OperatorDecision("Linear", OperatorKind.COMPUTE, 16)}
        assert stage._check_candidates(ctx, steps, ["fc"], decisions) == []  # type: ignore[arg-type]
        reason = decisions["fc"].reason
        assert "past" in reason and "of the fastest fixed policy's step" in reason and "x0.49" in reason, reason
    # where FP32 decides (balanced: the candidates no faster than FP32 by the margin), it says that
    policy = _policy("balanced")
    slow = _steps({FP32: 100, CANDIDATES: 99, AMP: 101})
    policy.set_pace(slow.pace())  # type: ignore[attr-defined]
    decisions = {"fc": OperatorDecision("Linear", OperatorKind.COMPUTE, 16)}
    stage._check_candidates(SimpleNamespace(policy=policy, agree=lambda value: value), slow, ["fc"], decisions)  # type: ignore[arg-type]
    assert "not better than fp32" in decisions["fc"].reason


def _noisy(ms: dict[ComparedPlan, float], wiggles: dict[ComparedPlan, list[float]]) -> StepComparison:
    return StepComparison({plan: [v * w for w in wiggles[plan]] for plan, v in ms.items()})


def _plan_steps(comparison: StepComparison) -> dict[ComparedPlan, PlanStep]:
    ratios = comparison.ratios()
    return {plan: PlanStep(ms=min(ms), wall_ms=min(ms), ratio=ratios.get(plan)) for plan, ms in comparison.ms.items()}


def test_the_levers_bound_is_of_the_base_where_the_rounds_cannot_tell_it_from_the_pace() -> None:
    # the default example's third search: candidates x0.708 [0.663, 0.726] of FP32, the compute-only plan (the pace)
    # x0.682 [0.650, 0.707]: a base 4 % slower by the medians, within the rounds' noise; bounded against the pace the
    # levers got 25.7 ms of room where the first search (base x1.006 of its pace) got 27.5 and the second (x0.984) 38.1
    wiggles = {FP32: [1.0, 1.0, 1.0, 1.0], CANDIDATES: [1.0, 0.94, 1.03, 0.97], COMPUTE: [0.96, 1.0, 0.95, 1.03]}
    comparison = _noisy({FP32: 323.0, CANDIDATES: 228.7, COMPUTE: 220.3}, wiggles)
    pace = comparison.pace()
    assert pace.plan is COMPUTE
    steps = _plan_steps(comparison)
    assert comparison.ratio(CANDIDATES, COMPUTE).against(1.0) is Verdict.UNDECIDED
    bound_ms, words = bound_step(comparison, steps, CANDIDATES, pace, ComputePrecision.BF16)
    assert bound_ms == pytest.approx(on_pace_scale(steps, CANDIDATES))  # the base's own step, on the pace's scale
    assert bound_ms > 323.0 * pace.ratio_to_fp32  # (here slower than the pace's by the medians)
    assert "could not tell from the pace" in words and "x1.0" in words


def test_the_levers_bound_stays_the_paces_where_the_base_is_surely_slower_or_is_the_pace() -> None:
    steady = _steps({FP32: 300.0, CANDIDATES: 230.0, COMPUTE: 200.0})
    steps = _plan_steps(steady)
    assert steady.ratio(CANDIDATES, COMPUTE).against(1.0) is Verdict.ABOVE
    bound_ms, words = bound_step(steady, steps, CANDIDATES, steady.pace(), ComputePrecision.BF16)
    assert bound_ms is None and words.startswith("the pace")
    assert bound_step(steady, steps, COMPUTE, steady.pace(), ComputePrecision.BF16)[0] is None  # the pace itself
    assert bound_step(None, steps, CANDIDATES, steady.pace(), ComputePrecision.BF16)[0] is None  # no rounds kept


def test_with_levers_a_plan_at_the_bound_by_its_median_is_no_base_however_lean() -> None:
    # the default example's run b of the seventh pass: all-low's plan 24 MiB leaner than the candidates and within the
    # margin of their step, at x1.153 of the pace by the median (1.15 allowed) with an interval straddling it: it
    # displaced the candidates, and the levers, whose room is taken by the medians, had 0.3 ms (118 MiB at the end,
    # 79 MiB in the run that built on the candidates)
    policy = _policy("memory", levers=True)
    steps = StepComparison({FP32: [300.0] * 6, COMPUTE: [190.0] * 6, CANDIDATES: [212.0] * 6,
                            ALL_LOW: [205.0, 235.0, 210.0, 229.0, 200.0, 240.0]})
    policy.set_pace(steps.pace())  # type: ignore[attr-defined]
    assert policy.pace.plan is COMPUTE  # type: ignore[attr-defined]
    assert policy.bound_holds(steps, ALL_LOW) is Verdict.UNDECIDED  # type: ignore[attr-defined]
    assert not policy.leaves_room(steps, ALL_LOW) and policy.leaves_room(steps, CANDIDATES)  # type: ignore[attr-defined]
    saved = {FP32: 134.3, CANDIDATES: 93.3, ALL_LOW: 68.3, COMPUTE: 113.3}
    assert policy.winner(steps, saved, [ALL_LOW, COMPUTE], True) is None  # type: ignore[attr-defined]
    # inside the bound by its median (x1.12), the same lean plan is the base
    inside = StepComparison({FP32: [300.0] * 6, COMPUTE: [190.0] * 6, CANDIDATES: [212.0] * 6,
                             ALL_LOW: [200.0, 230.0, 205.0, 221.0, 195.0, 235.0]})
    policy.set_pace(inside.pace())  # type: ignore[attr-defined]
    assert policy.leaves_room(inside, ALL_LOW)  # type: ignore[attr-defined]
    assert policy.winner(inside, saved, [ALL_LOW, COMPUTE], True) is ALL_LOW  # type: ignore[attr-defined]
    # where no plan but it is in the contest it stays the base (something must be built on)
    assert base_for_the_levers(policy, steps, saved, [ALL_LOW], False) is ALL_LOW  # type: ignore[arg-type]


def test_with_levers_where_no_plan_leaves_room_every_plan_is_in_the_contest() -> None:
    # cnn, balanced, seed 1 of the sixteenth pass: the pace one autocast region (x0.520 of FP32), the candidates at
    # x1.06 of it by their median and 4 MiB fatter than AMP's plan, AMP's plan at the bound too (x1.06): the room rule
    # filtered AMP's plan and never the candidates, so they stayed alone in the contest, their levers had no room, and
    # the plan ended 1.03x AMP's step peak at 0.97x its throughput
    policy = _policy("balanced", levers=True)
    wiggle = [1.0, 0.96, 1.04, 1.0, 0.97, 1.03]  # every plan's rounds straddle the bound: none is past it for sure
    steps = StepComparison({FP32: [125.8] * 6, AUTOCAST: [65.4] * 6, CANDIDATES: [69.3 * w for w in wiggle],
                            AMP: [69.1 * w for w in reversed(wiggle)], COMPUTE: [91.2] * 6})
    policy.set_pace(steps.pace())  # type: ignore[attr-defined]
    assert policy.pace.plan is AUTOCAST  # type: ignore[attr-defined]
    assert not policy.leaves_room(steps, CANDIDATES) and not policy.leaves_room(steps, AMP)  # type: ignore[attr-defined]
    saved = {FP32: 140.1, CANDIDATES: 81.6, AMP: 77.4, COMPUTE: 150.8, AUTOCAST: 78.0}
    # no plan leaves room: none is filtered out, and AMP's plan, leaner and no slower, is the base
    assert policy.winner(steps, saved, [AMP, COMPUTE], True) is AMP  # type: ignore[attr-defined]
    # the candidates inside the bound keep the base where they cost less, as before
    fatter = {**saved, AMP: 88.0}
    inside = StepComparison({FP32: [125.8] * 6, AUTOCAST: [65.4] * 6, CANDIDATES: [67.0 * w for w in wiggle],
                             AMP: [66.0 * w for w in reversed(wiggle)], COMPUTE: [91.2] * 6})
    policy.set_pace(inside.pace())  # type: ignore[attr-defined]
    assert policy.winner(inside, fatter, [AMP, COMPUTE], True) is None  # type: ignore[attr-defined]


def test_with_levers_candidates_past_the_bound_stay_against_a_fatter_pace() -> None:
    # gpt, balanced, seed 1 of the sixteenth pass at 5d8aa24: the pace the plan of compute operators only (x0.434 of
    # FP32, 113.3 MiB saved), the candidates x1.10 of it (72.7 MiB), AMP's and all-low's plans past the bound too;
    # holding the candidates to the room rule left the pace alone in the contest, and the plan ended 0.98x AMP's step
    # peak where the candidates' plans end near 0.6x
    policy = _policy("balanced", levers=True)
    wiggle = [1.0, 0.94, 1.06, 1.0, 0.95, 1.05]  # their rounds straddle the bound: none past it beyond doubt
    steps = StepComparison({FP32: [246.0] * 6, COMPUTE: [106.8] * 6, CANDIDATES: [117.1 * w for w in wiggle],
                            AMP: [115.0 * w for w in reversed(wiggle)], ALL_LOW: [115.8 * w for w in wiggle],
                            AUTOCAST: [112.3] * 6})
    policy.set_pace(steps.pace())  # type: ignore[attr-defined]
    assert policy.pace.plan is COMPUTE  # type: ignore[attr-defined]
    assert policy.leaves_room(steps, COMPUTE) and not policy.leaves_room(steps, CANDIDATES)  # type: ignore[attr-defined]
    saved = {FP32: 134.3, CANDIDATES: 69.3, AMP: 77.3, ALL_LOW: 68.3, COMPUTE: 113.3, AUTOCAST: 83.4}
    assert policy.winner(steps, saved, [AMP, ALL_LOW, COMPUTE], True) is None  # type: ignore[attr-defined]
