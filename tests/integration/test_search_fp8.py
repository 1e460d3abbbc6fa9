"""fp8 as the search's third compute level, through the Trainer on a CPU (where fp8 is emulated, so the candidates
are pinned with ``include``/``include_fp8`` and a ``speed_margin`` nothing meets by itself: what is shown does not
depend on how fast anything is here).

A layer whose fp8 breaks convergence is demoted to bf16, not to FP32, and the other layers keep fp8; ``fp8="auto"``
searches no fp8 where it is emulated; the search state with fp8 candidates resumes from a checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_comp import CoMPPrecision, CoMPSearch
from lightning_comp.numerics import ComputePrecision
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.measurement.clocks import single_intra_op_thread
from lightning_comp.search.state import SearchState
from tests.helpers.search_models import Fp8SensitiveMLP, WideMLP, loaders, search_trainer

LAYERS = ("l2", "l3", "l4")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_intra_op_thread():
        yield


def pinned_search(**kwargs: Any) -> CoMPSearch:
    """bf16 and fp8 compute of l2, l3, l4 trialled whatever is measured; nothing else."""
    kwargs.setdefault("fp8", "fp8")
    return CoMPSearch(low_precision="bf16", include=list(LAYERS), include_fp8=list(LAYERS),
                      exclude=["l1", "head", "a?"], measurement={"speed_margin": 0.9, "profile_steps": 3},
                      tolerance=0.05, verbose=False, **kwargs)


def _fit(tmp_path: Path, search: CoMPSearch, model: pl.LightningModule) -> tuple[pl.Trainer, CoMPPrecision]:
    pl.seed_everything(0)
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=plugin)
    trainer.fit(model, *loaders(n_train=1024, n_val=256))
    return trainer, plugin


def test_a_layer_whose_fp8_fails_is_demoted_to_bf16_and_the_others_keep_fp8(tmp_path: Path) -> None:
    search = pinned_search()
    _, plugin = _fit(tmp_path, search, Fp8SensitiveMLP())
    plan = plugin.plan
    assert {n: plan.of("compute", n).value for n in LAYERS} == {"l2": "fp8", "l3": "bf16", "l4": "fp8"}
    trials = search.state.trials[1:]
    fp8 = tuple(Candidate.in_fp8(n) for n in LAYERS)
    assert trials[0].label == "all candidates" and trials[0].verdict == "fail"
    assert trials[1].group == tuple(Candidate(n) for n in LAYERS) and trials[1].verdict == "pass"
    assert trials[1].label.startswith("compute of 3, split by dimension from a failing compute+fp8 group of 6")
    assert [t.verdict for t in trials if t.group == (Candidate.in_fp8("l3"),)] == ["fail"]
    assert all(not set(t.group) - set(fp8) for t in trials[2:] if not t.label.startswith("confirm"))
    record = search.record
    assert record is not None
    assert record["fp8_stage"]["candidates"] == dict.fromkeys(LAYERS, "fp8")
    assert all(record["operators"][n]["fp8"]["forced"] for n in LAYERS)
    assert record["chosen_plan"]["entries"] == {"l2": "fp8", "l3": "bf16", "l4": "fp8"}
    # the state a checkpoint holds (a resumed search goes on from it) keeps the fp8 candidates and their precision
    state = SearchState.from_dict(json.loads(json.dumps(search.state.to_dict())))
    assert state.fp8_precision is ComputePrecision.FP8 and state.batch is not None
    assert state.batch.fp8.choices == dict.fromkeys(LAYERS, ComputePrecision.FP8)
    assert state.group_search is not None and Candidate.in_fp8("l3") in state.group_search.unsafe
    assert state.batch.decisions["l3"].fp8 == search.state.batch.decisions["l3"].fp8  # type: ignore[union-attr]


def test_fp8_rowwise_is_searched_with_its_recipe_and_a_passing_plan_keeps_every_layer_in_fp8(tmp_path: Path) -> None:
    search = pinned_search(fp8="fp8-rowwise")
    _, plugin = _fit(tmp_path, search, WideMLP(offset=False))
    plan = plugin.plan
    assert {n: plan.of("compute", n) for n in LAYERS} == dict.fromkeys(LAYERS, ComputePrecision.FP8_ROWWISE)
    assert [t.verdict for t in search.state.trials[1:]] == ["pass"]  # all candidates at once


def test_auto_searches_no_fp8_where_it_is_emulated_and_the_state_round_trips(tmp_path: Path) -> None:
    search = CoMPSearch(low_precision="bf16", include=list(LAYERS), exclude=["l1", "head", "a?"],
                        measurement={"speed_margin": 0.9, "profile_steps": 2}, max_trials=1, verbose=False)
    _fit(tmp_path, search, WideMLP(offset=False))
    assert search.state.fp8_precision is None  # fp8 is emulated on a CPU: "auto" does not search it
    assert search.state.batch is not None and search.state.batch.fp8.choices == {}
    assert not any(c.fp8 for c in search.state.batch.candidates)
    state = SearchState.from_dict(json.loads(json.dumps(search.state.to_dict())))  # JSON types only
    assert state.fp8_precision is None and state.batch is not None


def test_the_decision_table_shows_each_linears_fp8_verdict(tmp_path: Path) -> None:
    search = pinned_search(max_trials=1)
    _fit(tmp_path, search, WideMLP(offset=False))
    from lightning_comp.search.record.text import format_record

    record = search.record
    assert record is not None
    text = format_record(record)
    assert "fp8 (each Linear the plan lowers" in text
    for name in LAYERS:
        assert any(line.lstrip().startswith(name) and "included by CoMPSearch(include_fp8=...)" in line
                   for line in text.splitlines()), name
