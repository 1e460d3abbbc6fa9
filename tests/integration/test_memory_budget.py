"""``CoMPSearch(objective="memory", memory_budget=...)`` on the Trainer path: the levers are taken cheapest bytes
first until the budget is met, then no more; the frontier is in the record and drawn beside ``plan.json``.

Only the optimizer-state levers are searched (``precisions={"saved": "off", "master": "off"}``), and compute is not
(``low_precision="off"``), so what is tested does not depend on how fast bf16 is on the CPU: every fit starts its
levers from the same FP32 step bytes and the budget is met by the state formats alone. (Searching compute too, a
per-operator verdict left to timing noise lowered the candidates in one fit and not in the other where bf16 is
native, and a budget taken from the first fit's frontier was met before the second took any lever.) Where a fraction
of AMP's step is asked for, AMP's plan is timed, so that fit searches bf16 compute; its budget is out of reach on
every CPU class.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_comp import CoMPPrecision, CoMPSearch
from lightning_comp.errors import SearchConfigError
from lightning_comp.search.measurement.clocks import single_intra_op_thread
from lightning_comp.search.record.figures import FRONTIER_FIGURE
from lightning_comp.search.record.text import format_record
from tests.helpers.search_models import AdamWMLP, loaders, search_trainer


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_intra_op_thread():
        yield


def _fit(tmp_path: Path, low_precision: str = "off", **settings: Any) -> dict[str, Any]:
    pl.seed_everything(0)
    search = CoMPSearch(objective="memory", low_precision=low_precision, precisions={"saved": "off", "master": "off"},
                        verbose=False, measurement={"profile_steps": 3}, max_trials=3, record_dir=str(tmp_path),
                        **settings)
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=CoMPPrecision())
    trainer.fit(AdamWMLP(), *loaders())
    assert search.record is not None
    return search.record


def test_a_budget_is_met_with_the_cheapest_levers_and_no_more(tmp_path: Path) -> None:
    # out of reach (5 % of AMP's step): every lever is taken, past the time allowed, and the record says so
    amp = _fit(tmp_path / "amp", low_precision="bf16", memory_budget=0.05)["memory_spending"]
    assert amp["amp_step_mib"] is not None
    assert amp["target_mib"] == pytest.approx(0.05 * amp["amp_step_mib"], abs=0.01)
    assert not amp["met"] and "the budget is not met" in amp["stopped"]
    # judged by measured steps too: the plan's tensor peak against AMP's plan's, both measured
    peaks = amp["process_peaks"]
    assert set(peaks) == {"start", "plan", "amp"} and amp["process_reference"] == "amp"
    if peaks["amp"]["tensor_mib"] is not None:  # (glibc: the CPU's live heap is measured)
        assert amp["process_limit_mib"] == pytest.approx(0.05 * peaks["amp"]["tensor_mib"], abs=0.01)
        assert amp["process_met"] is False
    # compute left FP32: a fraction is of the FP32 step's bytes (no AMP is timed)
    far = _fit(tmp_path / "far", memory_budget=0.05)["memory_spending"]
    start, end = far["frontier"][0]["step_mib"], far["frontier"][-1]["step_mib"]
    assert far["amp_step_mib"] is None and far["target_mib"] == pytest.approx(0.05 * start, abs=0.01)
    assert not far["met"] and "the budget is not met" in far["stopped"]
    # half of what the levers can free: met partway
    budget = (start - (start - end) / 2) / start
    record = _fit(tmp_path / "half", memory_budget=budget)
    spending = record["memory_spending"]
    assert spending["frontier"][0]["step_mib"] == start
    assert spending["target_mib"] == pytest.approx(budget * start, abs=1e-3)
    assert spending["met"] and spending["stopped"].startswith("the budget is met")
    # the measured check: no AMP here, so a fraction of the plan's measured peak before the levers; the 8-bit state
    # the plan frees is taken off its measured step (a forward and backward on the run's own FP32 state)
    peaks = spending["process_peaks"]
    assert spending["process_reference"] == "start" and "amp" not in peaks
    if peaks["plan"]["tensor_mib"] is not None:
        assert "optimizer state the plan's formats free" in peaks["plan"]["how"]
        assert peaks["plan"]["tensor_mib"] < peaks["start"]["tensor_mib"]
        assert spending["process_limit_mib"] == pytest.approx(budget * peaks["start"]["tensor_mib"], abs=0.01)
        assert spending["process_met"] is not None
    frontier = spending["frontier"]
    assert frontier[-1]["step_mib"] <= spending["target_mib"] < frontier[-2]["step_mib"]  # stopped once met
    # cheapest bytes first: what each increment freed per ms falls along the frontier, within the time allowed and
    # then past it (where the budget needed more)
    for past in (False, True):
        rates = [p["mib_per_ms"] for p in frontier[1:] if p["mib_per_ms"] is not None and p["past_bound"] is past]
        assert rates == sorted(rates, reverse=True)
    searched = {n for n, op in record["operators"].items() if "parameters" in op}
    taken = {label.removeprefix("state:") for label in spending["taken"]}
    # some of the increments, not all: it stopped short of what every lever frees. (Not compared by frontier length
    # with the other fit: each fit prices its levers anew, and where bf16 moments step as fast as the optimizer's own,
    # their price is 0 in one fit and a fraction of a millisecond in the next, so one fit takes bf16 on every layer
    # first and the other 8-bit at once: the two frontiers' lengths are then not comparable.)
    assert taken <= searched and len(frontier) > 1
    assert frontier[-1]["step_mib"] > far["frontier"][-1]["step_mib"]
    assert any(entry["value"] != far["taken"][label]["value"] or label not in far["taken"]
               for label, entry in spending["taken"].items()) or taken < searched
    for name in searched - taken:
        assert record["operators"][name]["parameters"]["reason"].startswith("optimizer's own state, fp32 master:"
                                                                            " not taken")
    assert set(record["chosen_plan"].get("state", {})) <= taken
    assert (tmp_path / "half" / FRONTIER_FIGURE).stat().st_size > 0


def test_a_budget_in_bytes_is_judged_by_the_peak_the_process_needs(tmp_path: Path) -> None:
    """A budget in bytes is what the job must fit in: the accounting's step bytes (a few MiB here) meet it at once,
    but the process's live heap (model, data, libraries: hundreds of MiB) does not, so the levers are taken further
    by what the process needs beyond it, and the record says the budget is not met by the process."""
    record = _fit(tmp_path, memory_budget=64 * 2**20)
    spending = record["memory_spending"]
    peaks = spending["process_peaks"]
    assert set(peaks) == {"start", "plan"}
    if peaks["plan"]["live_mib"] is None:  # no glibc: the process peak is not measured, the accounting judges
        assert spending["process_met"] is None and spending["met"]
        return
    assert peaks["plan"]["live_mib"] > 64 and peaks["start"]["live_mib"] > 64
    assert spending["process_met"] is False
    assert spending["process_target_mib"] is not None and spending["process_target_mib"] < spending["target_mib"]
    # every state lever taken for it (past the time allowed where needed), and none of them is reported as spare
    searched = {f"state:{n}" for n, op in record["operators"].items() if "parameters" in op}
    assert set(spending["taken"]) == searched
    text = format_record(record)
    assert "judged by the process's peak (held to 64.0 MiB): not met" in text
    assert "the process's peak over one step" in text.lower()
    assert set(record["step_process_peaks"]) == {"fp32"}  # compute not searched: the FP32 plan alone timed whole


def test_without_a_budget_every_lever_within_the_bound_is_taken(tmp_path: Path) -> None:
    record = _fit(tmp_path, max_slowdown_vs_fastest=1e6)
    spending = record["memory_spending"]
    assert spending["target_mib"] is None and spending["met"]
    searched = {f"state:{n}" for n, op in record["operators"].items() if "parameters" in op}
    assert set(spending["taken"]) == searched
    assert all(entry["value"] == "8bit" for entry in spending["taken"].values())  # the most bytes, at any cost
    text = format_record(record)
    assert "Memory levers, cheapest bytes first" in text and f"Stopped: {spending['stopped']}." in text
    assert all(label in text for label in spending["taken"])


def test_with_compute_left_fp32_bf16_masters_are_levers_priced_with_their_fp32_copies(tmp_path: Path) -> None:
    """Where no compute is lowered (a CPU where bf16 does not pay, or operators kept FP32), a bf16 master is still a
    lever: the operator computes in FP32 with FP32 copies of its bf16 parameters, the casts timed with its update.
    Taken at any cost here, it trains into the chosen plan with compute left FP32."""
    pl.seed_everything(0)
    search = CoMPSearch(objective="memory", low_precision="off", precisions={"saved": "off"}, tolerance=1.0,
                        max_slowdown_vs_fastest=1e6, verbose=False, measurement={"profile_steps": 3}, max_trials=3)
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=CoMPPrecision())
    model = AdamWMLP()
    trainer.fit(model, *loaders())
    record = search.record
    assert record is not None
    searched = {n for n, op in record["operators"].items() if "parameters" in op}
    assert searched
    for name in searched:
        parameters = record["operators"][name]["parameters"]
        assert "master+fp32 copies" in parameters["time_ratio"] and "master" not in parameters["time_ratio"]
        assert parameters["bytes"]["master+fp32 copies"] > 0
    assert format_record(record).count("(fp32 copies)") == len(searched)  # the master time column of each
    taken = record["memory_spending"]["taken"]
    assert {label.removeprefix("state:") for label in taken} == searched
    assert all(entry["value"] == "8bit+master bf16" for entry in taken.values())  # the most bytes, at any cost
    plan = trainer.precision_plugin.plan
    assert set(record["chosen_plan"]["master"]) == searched and plan.is_all_fp32
    for name in searched:  # trained in bf16 (handed back in fp32, with the bf16 values it trained to)
        weight = model.get_submodule(name).weight
        assert torch.equal(weight, weight.bfloat16().float()), name


def test_a_budget_needs_the_memory_objective_and_a_positive_size() -> None:
    with pytest.raises(SearchConfigError, match=r"memory_budget.*objective='memory', not 'throughput'"):
        CoMPSearch(memory_budget=0.5)
    with pytest.raises(SearchConfigError, match=r"memory_budget.*-1.*fraction of AMP's step peak"):
        CoMPSearch(objective="memory", memory_budget=-1)
    with pytest.raises(SearchConfigError, match=r"memory_budget"):
        CoMPSearch(objective="memory", memory_budget=True)
