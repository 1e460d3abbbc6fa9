"""Decisions by structure: operators playing the same part in repeated blocks are one group, decided once; operators
are charged forward and backward; leaves running compute kernels are compute operators; no-arithmetic ones are no
decision."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from lightning_comp.devices.lowering import Lowering, lowering_for
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.operators.kinds import OperatorKind, classify, does_no_arithmetic, judged_as_compute
from lightning_comp.operators.owned_work import WorkRecorder
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.decisions.groups import OperatorGroup, abstract_path, group_operators, pooled_series
from lightning_comp.search.decisions.objectives import policy_for
from lightning_comp.search.decisions.operators import Choice, decide_operators
from lightning_comp.search.decisions.trial_plans import compute_candidates
from lightning_comp.search.decisions.whole_step import ProfiledPlan
from lightning_comp.search.measurement.estimates import Verdict, paired_ratio
from lightning_comp.search.measurement.profiling import OperatorMeasurement, ProfileResult
from lightning_comp.search.record.text import format_record
from lightning_comp.zoo import CharGPT
from lightning_comp.zoo.layers import ScaledDotProductAttention

BF16 = ComputePrecision.BF16


def _traced(model: nn.Module, tokens: torch.Tensor) -> dict[str, nn.Module]:
    with WorkRecorder(model):
        model(tokens).float().sum().backward()
    return dict(iter_operators(model))


def _gpt() -> tuple[nn.Module, dict[str, nn.Module]]:
    torch.manual_seed(0)
    model = CharGPT(width=32, depth=4, heads=2, block_size=16)
    return model, _traced(model, torch.randint(0, 255, (2, 16)))


def _litgpt() -> tuple[nn.Module, dict[str, nn.Module]]:
    pytest.importorskip("litgpt")
    from lightning_comp.zoo.third_party import LitGPT

    torch.manual_seed(0)
    model = LitGPT(width=32, depth=4, heads=2, query_groups=1, block_size=16)
    return model, _traced(model, torch.randint(0, 255, (2, 16)))


def test_a_path_is_abstracted_at_its_numeric_parts() -> None:
    assert abstract_path("blocks.3.attn.qkv") == "blocks.*.attn.qkv"
    assert abstract_path("encoder.layers.10.linear1") == "encoder.layers.*.linear1"
    assert abstract_path("head") == "head"
    assert pooled_series([[1.0, 2.0], [3.0, 4.0]]) == [4.0, 6.0]


@pytest.mark.parametrize("build", [_gpt, _litgpt], ids=["zoo-gpt", "litgpt"])
def test_repeated_blocks_form_one_group_per_part_named_by_an_exact_glob(build) -> None:  # type: ignore[no-untyped-def]
    _, modules = build()
    groups = {g.pattern: g for g in group_operators(list(modules), modules)}
    repeated = [g for g in groups.values() if g.size > 1]
    assert repeated and all(g.size == 4 and g.exact_glob and "*" in g.pattern for g in repeated)
    assert all(len(g.selectors) == 1 for g in repeated)
    qkv = next(g for g in repeated if g.pattern.endswith("attn.qkv"))
    assert qkv.members == tuple(qkv.pattern.replace("*", str(i)) for i in range(4))
    # every operator is in exactly one group; the head is a group of one
    members = [m for g in groups.values() for m in g.members]
    assert sorted(members) == sorted(modules)
    head = next(g for g in groups.values() if g.pattern.endswith("head"))
    assert head.size == 1 and head.selectors == head.members


def test_operators_of_different_shape_or_with_a_glob_that_overreaches_are_not_one_selector() -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 16)])
    modules = dict(iter_operators(model))
    groups = group_operators(list(modules), modules)
    assert [g.members for g in groups] == [("blocks.0", "blocks.1"), ("blocks.2",)]
    # their glob blocks.* also names blocks.2: the plan names the two members instead
    assert not groups[0].exact_glob and groups[0].selectors == ("blocks.0", "blocks.1")


def _measured(forward: float, backward: float) -> OperatorMeasurement:
    return OperatorMeasurement(forward_ms=forward, compute_ms=forward, backward_ms=backward, calls=1)


def _profiles(names: list[str], fp32_ms: dict[str, float], low_ms: dict[str, float], noise: float, rounds: int = 4,
              seed: int = 0) -> dict[ProfiledPlan, ProfileResult]:
    """FP32 and low profiles of ``names`` with independent per-operator noise (forward and backward each half)."""
    rng = random.Random(seed)
    out = {}
    for label, table in ((ProfiledPlan.FP32, fp32_ms), (ProfiledPlan.LOW, low_ms)):
        per_round = [{n: _measured(*(table[n] / 2 * (1 + rng.uniform(-noise, noise)) for _ in range(2)))
                      for n in names} for _ in range(rounds)]
        best = {n: min((r[n] for r in per_round), key=lambda m: m.total_ms) for n in names}
        out[label] = ProfileResult(operators=best, order=list(names), rounds=per_round)
    return out


@pytest.mark.parametrize("build", [_gpt, _litgpt], ids=["zoo-gpt", "litgpt"])
@pytest.mark.parametrize("seed", range(4))
def test_identical_blocks_get_identical_decisions_whatever_each_members_noise(build, seed: int) -> None:  # type: ignore[no-untyped-def]
    """Each member draws its own noise (x0.9-1.1 per round), around a true ratio close to the margin (x0.93 for
    matmuls, x1.04 for the rest): alone, members would fall on different sides in some runs; as a group they are
    decided once, so every block gets the same decision."""
    _, modules = build()
    names = [n for n, m in modules.items() if classify(m) is not OperatorKind.SHAPE and not n.startswith("val")]
    fp32 = {n: 1.0 for n in names}
    low = {n: (0.93 if judged_as_compute(modules[n]) else 1.04) for n in names}
    profiles = _profiles(names, fp32, low, noise=0.1, seed=seed)
    decisions = decide_operators(SearchConfig(), policy_for(SearchConfig()), BF16, modules, names, profiles)
    for group in group_operators(names, modules):
        verdicts = {(decisions[m].decision, decisions[m].reason, decisions[m].time) for m in group.members}
        assert len(verdicts) == 1, (group.pattern, verdicts)
        if group.size > 1:
            assert all(decisions[m].group == group.pattern and decisions[m].group_size == group.size
                       for m in group.members)
            assert f"decided with its group {group.pattern} (x{group.size})" in decisions[group.members[0]].reason


def test_a_groups_rounds_are_pooled_before_it_is_judged() -> None:
    """Four members, each at x0.9 with heavy noise of its own: alone, not one interval clears the 5 % margin; their
    pooled rounds do."""
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    modules = dict(iter_operators(model))
    names = list(modules)
    rounds = 6
    # per member: three rounds at x0.7 and three at x1.1, in a different order each: every interval straddles
    pattern = [[0.7, 1.1, 0.7, 1.1, 0.7, 1.1], [1.1, 0.7, 1.1, 0.7, 1.1, 0.7],
               [0.7, 0.7, 1.1, 1.1, 0.7, 1.1], [1.1, 1.1, 0.7, 0.7, 1.1, 0.7]]
    fp32 = ProfileResult(operators={n: _measured(0.5, 0.5) for n in names}, order=names,
                         rounds=[{n: _measured(0.5, 0.5) for n in names} for _ in range(rounds)])
    low_rounds = [{n: _measured(pattern[i][r] / 2, pattern[i][r] / 2) for i, n in enumerate(names)}
                  for r in range(rounds)]
    low = ProfileResult(operators={n: _measured(0.35, 0.35) for n in names}, order=names, rounds=low_rounds)
    alone = [paired_ratio(fp32.series(n), low.series(n)) for n in names]
    assert all(r.against(0.95) is Verdict.UNDECIDED for r in alone)
    decisions = decide_operators(SearchConfig(), policy_for(SearchConfig()), BF16, modules, names,
                                 {ProfiledPlan.FP32: fp32, ProfiledPlan.LOW: low})
    assert {decisions[n].group_size for n in names} == {4}  # Sequential's "0".."3": the same part, repeated
    assert {d.decision for d in decisions.values()} == {Choice.CANDIDATE}
    assert [d.time.ratio for d in decisions.values() if d.time is not None] == pytest.approx([0.9] * 4)


def test_a_cheap_operator_is_charged_its_backward_too_and_its_reason_reads_fp32_first() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    modules = dict(iter_operators(model))
    names = list(modules)
    # the GELU's forward is faster in bf16, its backward three times slower
    fp32 = {n: (0.5, 0.5) for n in names}
    low = {"0": (0.2, 0.2), "1": (0.4, 1.5), "2": (0.2, 0.2)}
    results = {}
    for label, table in ((ProfiledPlan.FP32, fp32), (ProfiledPlan.LOW, low)):
        rounds = [{n: _measured(*table[n]) for n in names} for _ in range(4)]
        results[label] = ProfileResult(operators=rounds[0], order=names, rounds=rounds)
    decisions = decide_operators(SearchConfig(), policy_for(SearchConfig()), BF16, modules, names, results)
    act = decisions["1"]
    assert act.decision is Choice.FP32 and not act.heavy
    assert "1.0000 ms in fp32 -> 1.9000 ms in bf16" in act.reason and "slow end" in act.reason


def test_a_leaf_running_attention_kernels_is_a_compute_operator_whatever_its_class() -> None:
    attention = ScaledDotProductAttention()
    assert classify(attention) is OperatorKind.ELEMENTWISE
    assert not judged_as_compute(nn.ReLU())
    _, modules = _gpt()
    leaf = modules["blocks.0.attn.attn"]
    assert isinstance(leaf, ScaledDotProductAttention) and judged_as_compute(leaf)
    assert not judged_as_compute(modules["blocks.0.mlp.act"])


def test_an_operator_that_does_no_arithmetic_is_not_a_decision() -> None:
    for module in (nn.Dropout(0.0), nn.Dropout2d(p=0.0), nn.Identity(), nn.Flatten()):
        assert does_no_arithmetic(module) and classify(module) is OperatorKind.SHAPE
        assert lowering_for(module, BF16, "cpu") is Lowering.NONE
    assert classify(nn.Dropout(0.1)) is OperatorKind.ELEMENTWISE
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0), nn.Linear(8, 8))
    modules = dict(iter_operators(model))
    names = list(modules)
    rounds = [{n: _measured(0.5, 0.5) for n in names} for _ in range(4)]
    profile = ProfileResult(operators=rounds[0], order=names, rounds=rounds)
    decisions = decide_operators(SearchConfig(), policy_for(SearchConfig()), BF16, modules, ["0", "2"],
                                 {ProfiledPlan.FP32: profile, ProfiledPlan.LOW: profile})
    assert decisions["1"].decision is Choice.FP32 and "no arithmetic" in decisions["1"].reason


def test_a_fully_lowered_group_is_one_candidate_and_a_split_one_its_members() -> None:
    whole = OperatorGroup(("b.0.fc", "b.1.fc"), "b.*.fc", exact_glob=True)
    split = OperatorGroup(("b.0.act", "b.1.act"), "b.*.act", exact_glob=True)
    lowered = ["b.0.fc", "b.0.act", "b.1.fc"]
    assert compute_candidates(lowered, [whole, split]) == [Candidate("b.*.fc"), Candidate("b.0.act")]


def test_the_batch_stage_table_shows_a_group_as_one_row_with_its_member_count() -> None:
    op = {"type": "Linear", "fp32": {"total_ms": 1.0, "saved_bytes": 8}, "low": {"total_ms": 0.5, "saved_bytes": 4},
          "time_ratio": 0.5, "time_spread": [0.45, 0.55], "decision": "candidate", "reason": "pays",
          "group": "blocks.*.fc", "group_size": 2}
    record = {"operators": {"blocks.0.fc": op, "blocks.1.fc": dict(op), "head": {**op, "group": None}},
              "lowered_operators": ["blocks.*.fc"], "lowered_operator_count": 2, "num_operators": 3,
              "trialled_plan": {"from": "candidates", "refined": True, "step_ms": 1.5, "ratio_to_fp32": 0.5,
                                "fastest_measured": "candidates", "fastest_ms": 1.6},
              "refinements": [{"group": "blocks.*.act", "members": ["blocks.0.act", "blocks.1.act"], "to": "low",
                               "expected_gain_ms": 0.2, "kept": True, "step_ms": 1.5,
                               "ratio": {"ratio": 0.94, "low": 0.92, "high": 0.96, "rounds": 4}}]}
    text = format_record(record)
    assert "blocks.*.fc (x2)" in text and text.count("blocks.0.fc") == 0
    assert "2 of 3 operators" in text and "1 plan entries: blocks.*.fc" in text
    assert "refinement: blocks.*.act (x2) to low" in text and "kept" in text


def test_a_group_that_fails_whole_is_split_into_its_members_by_the_epoch_stage() -> None:
    from lightning_comp.search.decisions.group_search import GroupSearch

    glob, head = Candidate("blocks.*.fc"), Candidate("head")
    members = tuple(Candidate(f"blocks.{i}.fc") for i in range(4))
    search = GroupSearch((glob, head), benefits={glob: 8.0, head: 1.0}, max_trials=16, members={glob: members})
    unsafe = {"blocks.2.fc"}  # only one block is unsafe in low precision

    def converges(group: tuple[Candidate, ...]) -> bool:
        lowered = {m.operator for c in group for m in (search.members.get(c) or (c,))}
        return not lowered & unsafe

    tried = []
    while not search.done:
        group = search.next_group()
        assert group is not None
        tried.append(group)
        search.report(group, converges(group))
        search = GroupSearch.from_state(search.state_dict())  # the split survives a checkpoint
    assert tried[0] == (glob, head)  # the group is trialled once, whole, with the rest
    assert {c.operator for c in search.result or ()} == {"head", "blocks.0.fc", "blocks.1.fc", "blocks.3.fc"}
    assert Candidate("blocks.2.fc") in search.unsafe and glob not in search.unsafe


def test_refinement_tries_the_flips_expected_to_pay_largest_first_and_keeps_one_only_beyond_doubt() -> None:
    from lightning_comp.search.decisions.operators import OperatorDecision
    from lightning_comp.search.decisions.refinement import flip_order, keeps_flip

    def decision(fp32_ms: float, low_ms: float, group: str, forced: bool = False) -> OperatorDecision:
        return OperatorDecision("Linear", OperatorKind.COMPUTE, 0, fp32=_measured(fp32_ms / 2, fp32_ms / 2),
                                low=_measured(low_ms / 2, low_ms / 2), group=group, forced=forced)

    decisions = {"a.0": decision(1.0, 0.5, "a.*"), "a.1": decision(1.0, 0.5, "a.*"),  # fp32 now: -1 ms if lowered
                 "b.0": decision(1.0, 1.6, "b.*"), "b.1": decision(1.0, 1.6, "b.*"),  # low now: -1.2 ms if fp32
                 "c": decision(1.0, 0.2, "c"),  # low now, and faster so: nothing to gain
                 "d": decision(1.0, 0.1, "d", forced=True),  # forced: never flipped
                 "e.0": decision(1.0, 0.5, "e.*"), "e.1": decision(1.0, 0.5, "e.*")}  # split across the plan
    groups = [OperatorGroup(("a.0", "a.1"), "a.*", True), OperatorGroup(("b.0", "b.1"), "b.*", True),
              OperatorGroup(("c",), "c"), OperatorGroup(("d",), "d"), OperatorGroup(("e.0", "e.1"), "e.*", True)]
    flips = flip_order(groups, decisions, lowered={"b.0", "b.1", "c", "e.0"})
    assert [(f.group.pattern, f.to_low) for f in flips] == [("b.*", False), ("a.*", True)]
    assert [f.expected_gain_ms for f in flips] == pytest.approx([1.2, 1.0])
    assert keeps_flip(paired_ratio([10.0] * 6, [9.0, 9.1, 8.9, 9.0, 9.2, 8.8]), 0.0) is Verdict.BELOW
    assert keeps_flip(paired_ratio([10.0] * 6, [9.0, 10.1, 8.9, 10.2, 9.2, 8.8]), 0.0) is Verdict.UNDECIDED
    assert keeps_flip(paired_ratio([10.0] * 6, [9.0, 9.1, 8.9, 9.0, 9.2, 8.8]), 0.15) is Verdict.ABOVE


def test_the_forecast_adds_the_optimizer_and_loop_time_training_measured_to_the_batch_stages_step() -> None:
    from lightning_comp.search.decisions.batch_result import BatchStageResult, SavedStageResult
    from lightning_comp.search.decisions.whole_step import ComparedPlan, Pace, PlanStep, TrialledPlan
    from lightning_comp.search.record.forecast import forecast_check
    from lightning_comp.search.state import TrialRecord

    fp32, autocast, candidates = ComparedPlan.FP32, ComparedPlan.AUTOCAST, ComparedPlan.CANDIDATES
    batch = BatchStageResult(
        decisions={}, candidates=(Candidate("x"),), benefits={}, runs=[], saved=SavedStageResult(), order=[],
        steps={fp32: PlanStep(ms=10.0, wall_ms=10.0), autocast: PlanStep(ms=8.0, wall_ms=8.0)}, memory={},
        trialled=TrialledPlan(candidates, False, 5.0, 0.5, candidates, 5.0, Pace()))
    assert forecast_check(batch, []) is None  # no trial has measured anything yet
    reference = TrialRecord("fp32 reference", None, {}, 0, 0, median_step_ms=14.0)
    trial = TrialRecord("all candidates", (Candidate("x"),), {}, 0, 0, median_step_ms=9.5)
    check = forecast_check(batch, [reference, trial])
    assert check is not None and check["comparable"]
    # 4 ms outside the measured step: forecast (5 + 4) / 14, trained 9.5 / 14
    assert check["outside_ms"] == pytest.approx(4.0)
    assert check["forecast_ratio"] == pytest.approx(9 / 14, abs=1e-4)
    assert check["training_ratio"] == pytest.approx(9.5 / 14, abs=1e-4)
    assert check["gap"] == pytest.approx(9.5 / 9 - 1, abs=1e-3)
    assert check["autocast_forecast_speedup"] == pytest.approx(12 / 9, abs=1e-4)
    saved = TrialRecord("all candidates", (Candidate("x"), Candidate.saved("x")), {}, 0, 0, median_step_ms=9.0)
    assert not forecast_check(batch, [reference, saved])["comparable"]  # type: ignore[index]


def test_a_refinement_from_fp32_that_gains_less_than_the_margin_is_not_trialled() -> None:
    from lightning_comp.search.decisions.refinement import GroupFlip
    from lightning_comp.search.decisions.trialled import accept_refinement

    flip = GroupFlip("b.*.fc", ("b.0.fc", "b.1.fc"), True, 1.0, paired_ratio([10.0] * 4, [9.8, 9.7, 9.8, 9.7]),
                     kept=True, step_ms=9.7)
    lowered, flips = accept_refinement(set(), {"b.0.fc", "b.1.fc"}, [flip], 1.0, 0.05)  # x0.975: not by 5 %
    assert lowered == set() and [f.kept for f in flips] == [False]
    lowered, flips = accept_refinement(set(), {"b.0.fc", "b.1.fc"}, [flip], 1.0, 0.02)
    assert lowered == {"b.0.fc", "b.1.fc"} and flips == [flip]
