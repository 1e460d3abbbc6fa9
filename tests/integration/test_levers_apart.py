"""Levers tested apart, through the Trainer: when the all-candidates trial fails because of one layer's 8-bit
optimizer state, the group testing tries the compute lowerings apart from the memory levers, so the bf16 compute of
every layer is kept and only that layer's state stays FP32.

Trials pin their candidates (``include`` for the compute dimension, ``include_dimensions`` for the state, and a
``speed_margin`` nothing can meet by itself), so what they show does not depend on how fast BF16 is on this CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_comp import CoMPPrecision, CoMPSearch
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.measurement.clocks import single_intra_op_thread
from tests.helpers.search_models import StateSensitiveMLP, loaders, search_trainer

LAYERS = ("l2", "l3", "l4")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_intra_op_thread():
        yield


def pinned_search(**kwargs: Any) -> CoMPSearch:
    """bf16 compute and 8-bit state of l2, l3, l4 trialled whatever is measured; nothing else."""
    return CoMPSearch(objective="memory", low_precision="bf16", include=list(LAYERS), exclude=["l1", "head", "a?"],
                      include_dimensions={"state": list(LAYERS)}, precisions={"saved": "off", "master": "off"},
                      measurement={"speed_margin": 0.9, "profile_steps": 3}, max_slowdown_vs_fastest=1e6,
                      tolerance=0.02, verbose=False, **kwargs)


def _fit(tmp_path: Path, search: CoMPSearch) -> tuple[pl.Trainer, CoMPPrecision]:
    pl.seed_everything(0)
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=plugin)
    trainer.fit(StateSensitiveMLP(), *loaders())
    return trainer, plugin


@pytest.mark.slow
def test_a_failing_eight_bit_state_drops_only_that_state_and_no_compute_lowering(tmp_path: Path) -> None:
    search = pinned_search()
    trainer, plugin = _fit(tmp_path, search)
    plan = plugin.plan
    assert {n: plan.of("compute", n).value for n in LAYERS} == dict.fromkeys(LAYERS, "bf16")
    assert {n: plan.of("state", n).value for n in LAYERS} == {"l2": "8bit", "l3": "fp32", "l4": "8bit"}
    model = trainer.lightning_module
    assert trainer.optimizers[0].state[model.l3.weight]["exp_avg"].dtype == torch.float32  # trains on so
    compute = tuple(Candidate(n) for n in LAYERS)
    trials = search.state.trials[1:]
    assert trials[0].label == "all candidates" and trials[0].verdict == "fail"
    assert trials[1].group == compute and trials[1].verdict == "pass"  # the compute lowerings whole, levers apart
    assert trials[1].label == "compute of 3, split by dimension from a failing compute+state group of 6 (trial 2)"
    assert [t.verdict for t in trials if t.group == (Candidate.state("l3"),)] == ["fail"]
    levers = [t for t in trials[2:] if not t.label.startswith("confirm safe set")]
    assert levers and all(t.group and not set(t.group) & set(compute) for t in levers)  # the levers apart
    assert trials[-1].label.startswith("confirm safe set") and trials[-1].verdict == "pass"
    record = search.record
    assert record is not None
    assert record["state_lowered"] == {"l2": "8bit", "l4": "8bit"}
    assert set(record["lowered_operators"]) >= set(LAYERS)
    assert any("split by dimension" in t["label"] for t in record["trials"])


@pytest.mark.slow
def test_with_two_trials_the_compute_lowerings_are_kept_when_a_lever_fails(tmp_path: Path) -> None:
    """The budget ends after the compute lowerings' trial: the best passing group is all of them, not a mixed half."""
    search = pinned_search(max_trials=2)
    _, plugin = _fit(tmp_path, search)
    plan = plugin.plan
    assert {n: plan.of("compute", n).value for n in LAYERS} == dict.fromkeys(LAYERS, "bf16")
    assert {n: plan.of("state", n).value for n in LAYERS} == dict.fromkeys(LAYERS, "fp32")
    # the trial of the compute lowerings was the last allowed; it passed, and its plan trains on
    assert len(search.state.trials) == 3 and search.state.chosen_label == search.state.trials[-1].label
    assert search.state.trials[-1].label.startswith("compute of 3, split by dimension")
