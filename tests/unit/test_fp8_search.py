"""The fp8 level of the search, by its parts: how fp8 is resolved per device, how an fp8 candidate is judged from
recorded timings, spelled in checkpoints, split apart from the 16-bit lowerings in group testing, and written into a
trial's plan. (The Trainer path is ``tests/integration/test_search_fp8.py``.)"""

from __future__ import annotations

import pytest

from lightning_comp.devices.device_classes import DeviceClass
from lightning_comp.errors import SearchConfigError
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.decisions.fp8 import judge_fp8
from lightning_comp.search.decisions.group_search import GroupSearch, dimensions_of, split
from lightning_comp.search.decisions.trial_plans import plan_for
from lightning_comp.search.measurement.estimates import RatioEstimate

BF16, FP8, ROWWISE = ComputePrecision.BF16, ComputePrecision.FP8, ComputePrecision.FP8_ROWWISE
CPU = DeviceClass("cpu", capability="AVX512", native=frozenset({BF16}),
                  emulated=frozenset({ComputePrecision.FP16, FP8, ROWWISE}))
H100 = DeviceClass("cuda", capability="sm90", native=frozenset({BF16, ComputePrecision.FP16, FP8, ROWWISE}))
A100 = DeviceClass("cuda", capability="sm80", native=frozenset({BF16, ComputePrecision.FP16}))


@pytest.mark.parametrize(("fp8", "device", "low", "expected"), [
    ("auto", H100, BF16, FP8),  # native: searched
    ("auto", CPU, BF16, None),  # emulated: not searched by default
    ("fp8", CPU, BF16, FP8),  # asked for: measured even where emulated
    ("fp8-rowwise", H100, BF16, ROWWISE),
    ("fp8", A100, BF16, None),  # no fp8 matmul at all
    ("auto", H100, ComputePrecision.FP16, None),  # only on top of bf16
    ("off", H100, BF16, None),
])
def test_what_fp8_the_search_tries_on_each_device(fp8: str, device: DeviceClass, low: ComputePrecision,
                                                   expected: ComputePrecision | None) -> None:
    assert SearchConfig(fp8=fp8).resolve_fp8(device, low) is expected


def _ratio(ratio: float, low: float, high: float) -> RatioEstimate:
    return RatioEstimate(ratio, low, high, rounds=8, confidence=0.93)


def test_an_fp8_candidate_is_judged_against_its_16_bit_lowering_from_recorded_timings() -> None:
    config = SearchConfig(measurement={"speed_margin": 0.05, "min_gain_ms": 0.01})
    faster = judge_fp8(config, FP8, BF16, _ratio(0.7, 0.65, 0.75), low_ms=2.0, fp8_ms=1.4)
    assert faster.lowers and faster.gain_ms == pytest.approx(0.6) and "faster in fp8" in faster.reason
    slower = judge_fp8(config, FP8, BF16, _ratio(1.4, 1.3, 1.5), low_ms=0.2, fp8_ms=0.28)  # a small projection
    assert not slower.lowers and "not faster than bf16 by the margin" in slower.reason
    unclear = judge_fp8(config, FP8, BF16, _ratio(0.9, 0.8, 1.02), low_ms=2.0, fp8_ms=1.8)
    assert not unclear.lowers and "cannot be told apart" in unclear.reason
    tiny = judge_fp8(config, FP8, BF16, _ratio(0.5, 0.45, 0.55), low_ms=0.01, fp8_ms=0.005)
    assert not tiny.lowers and "less than min_gain_ms" in tiny.reason
    tiny.drop("whole step")  # not a candidate: nothing to drop
    assert tiny.reason.startswith("faster in fp8 by less")
    faster.drop("the plan with it is not faster as a whole step")
    assert not faster.lowers and faster.reason.startswith("the plan with it")


def test_an_fp8_candidate_is_its_own_lever_spelled_in_checkpoints() -> None:
    fp8 = Candidate.in_fp8("blocks.*.mlp.fc")
    assert fp8.fp8 and fp8.dimension is Dimension.COMPUTE and fp8.lever == "fp8"
    assert fp8 != Candidate("blocks.*.mlp.fc") and str(fp8) == "blocks.*.mlp.fc (fp8)"
    assert Candidate.from_plain(fp8.to_plain()) == fp8 and fp8.to_plain() == ["blocks.*.mlp.fc", "fp8"]
    with pytest.raises(SearchConfigError, match=r"An fp8 candidate lowers compute, not 'saved'"):
        Candidate("l1", Dimension.SAVED, fp8=True)
    with pytest.raises(SearchConfigError, match=r"lever of \['compute', 'fp8', 'saved', 'state', 'master'\]"):
        Candidate.from_plain(["l1", "fp4"])


def test_a_failing_group_tries_the_16_bit_lowerings_apart_from_fp8_and_fp8_apart_from_memory_levers() -> None:
    compute = (Candidate("l2"), Candidate("l3"))
    fp8 = (Candidate.in_fp8("l2"), Candidate.in_fp8("l3"))
    group = (compute[0], fp8[0], Candidate.state("l2"), compute[1], fp8[1])
    assert dimensions_of(group) == ("compute", "fp8", "state")
    first, rest = split(group)
    assert first == compute and rest == (fp8[0], Candidate.state("l2"), fp8[1])
    assert split(rest) == (fp8, (Candidate.state("l2"),))
    # l3 unsafe in fp8 only: the 16-bit lowerings pass whole, fp8 is narrowed down to l3's, which alone is dropped
    search = GroupSearch(candidates=group)
    unsafe = {fp8[1]}
    while not search.done:
        tried = search.next_group()
        assert tried is not None
        search.report(tried, passed=not unsafe & set(tried))
    assert search.result is not None and set(search.result) == set(group) - unsafe
    assert search.unsafe == [fp8[1]]


def test_a_trial_plan_computes_fp8_candidates_in_their_recipe_and_the_others_in_bf16() -> None:
    group = [Candidate("l2"), Candidate.in_fp8("l3"), Candidate("l4"), Candidate.in_fp8("l4")]
    plan = plan_for(BF16, [], group, {Dimension.COMPUTE: {"l3": ROWWISE, "l4": FP8}})
    assert {n: plan.of(Dimension.COMPUTE, n) for n in ("l2", "l3", "l4", "l5")} == {
        "l2": BF16, "l3": ROWWISE, "l4": FP8, "l5": ComputePrecision.FP32}
    with pytest.raises(SearchConfigError, match=r"fp8 candidates \['l3'\] have no fp8 precision"):
        plan_for(BF16, [], [Candidate.in_fp8("l3")], {})
