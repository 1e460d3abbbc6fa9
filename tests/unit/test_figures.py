"""The record's figures as functions of the record: what each draws from, when each is left out, and that a
missing matplotlib costs one info line and no error."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.record import figures
from lightning_comp.search.record.figures import (
    FRONTIER_FIGURE,
    NO_MATPLOTLIB,
    PLAN_FIGURE,
    TRIALS_FIGURE,
    plan_figure,
    trials_figure,
    write_figures,
)

PNG = b"\x89PNG\r\n\x1a\n"


def _trial(label: str, metrics: dict[str, float], verdict: str, kept: bool = False,
           low: list[str] | None = None) -> dict[str, Any]:
    values = list(metrics.values())
    return {"label": label, "metrics": metrics, "metric": values[-1] if values else None, "verdict": verdict,
            "kept": kept, "median_step_ms": 10.0 + len(label), "low_operators": low or []}


def _record(epochs: int = 1, mode: str = "min") -> dict[str, Any]:
    plan = PrecisionPlan.from_dict({"l2": {"compute": "bf16", "saved": "fp8", "state": "8bit"},
                                    "l3": {"saved": "recompute"}})
    names = ["l1", "l2", "l3", "head"]
    series = {str(e): 2.0 - 0.1 * e for e in range(1, epochs + 1)}
    return {
        "monitor": "val_loss" if mode == "min" else "val_acc", "mode": mode, "tolerance": 0.05,
        "tolerance_mode": "relative", "objective": "memory", "low_precision": "bf16", "chosen_trial": "group (trial 2)",
        "lowered_operator_count": 1, "chosen_plan": plan.to_dict(),
        "operators": {name: {"gain_ms": float(i) - 1.0, "decision": "candidate"} for i, name in enumerate(names)},
        "metric_bound": list(series.values())[-1] * (1.05 if mode == "min" else 0.95),
        "trials": [_trial("fp32 reference", series, "pass"),
                   _trial("all candidates", {k: math.nan for k in series}, "fail", low=["l2", "l3"]),
                   _trial("group (trial 2)", {k: v * 1.01 for k, v in series.items()}, "pass", kept=True, low=["l2"])],
        "memory_spending": {"frontier": [
            {"lever": None, "value": None, "step_mib": 10.0, "step_ms": 5.0, "past_bound": False},
            {"lever": "l2 saved (x1.1)", "value": "fp8", "step_mib": 8.0, "step_ms": 5.2, "past_bound": False},
            {"lever": "l3 saved", "value": "recompute", "step_mib": 7.0, "step_ms": 6.5, "past_bound": True}],
            "given_back": ["l3 saved"], "max_ms": 6.0, "target_mib": None, "amp_step_mib": 9.0},
    }


@pytest.mark.parametrize("epochs,mode", [(1, "min"), (3, "min"), (3, "max")])
def test_every_figure_is_written_for_a_full_record(tmp_path: Path, epochs: int, mode: str) -> None:
    pytest.importorskip("matplotlib")
    started = time.perf_counter()
    drawn = write_figures(_record(epochs, mode), tmp_path)
    assert set(drawn) == {PLAN_FIGURE, TRIALS_FIGURE, FRONTIER_FIGURE}
    for name in drawn:
        assert (tmp_path / name).read_bytes()[:8] == PNG
    assert sum(drawn.values()) <= (time.perf_counter() - started) * 1e3  # the time each took, all counted


def test_the_write_at_the_fit_end_draws_only_what_is_missing(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert len(write_figures(_record(), tmp_path)) == 3
    assert write_figures(_record(), tmp_path, final=True) == {}  # decided when the search ended: not drawn again
    (tmp_path / TRIALS_FIGURE).unlink()  # e.g. a resumed run writing into a new directory
    assert set(write_figures(_record(), tmp_path, final=True)) == {TRIALS_FIGURE}


def _strips(figure: Any) -> list[str]:
    """The dimensions of the plan figure's strips (the axes naming the operators)."""
    strips = [ax for ax in figure.axes if any(label.get_text() == "compute" for label in ax.get_yticklabels())]
    assert len(strips) == 1
    return [label.get_text() for label in strips[0].get_yticklabels()]


def test_the_plan_figure_shows_only_the_dimensions_the_plan_sets() -> None:
    pytest.importorskip("matplotlib")
    record = _record()
    figure = plan_figure(record)
    assert figure is not None
    assert _strips(figure) == ["compute", "saved", "state"]
    assert len(figure.axes) == 3  # time gained, bytes freed, the strips
    names = [label.get_text() for label in figure.axes[0].get_xticklabels()]
    assert names == list(record["operators"])
    record["chosen_plan"] = PrecisionPlan.from_dict({"l2": "bf16"}).to_dict()
    figure = plan_figure(record)
    assert figure is not None and _strips(figure) == ["compute"] and len(figure.axes) == 2  # no bytes panel


def test_figures_are_left_out_where_there_is_nothing_to_draw(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    record = _record()
    record.update(operators={}, trials=[], memory_spending=None)  # e.g. the search ended at once: fp32
    assert write_figures(record, tmp_path) == {}
    assert list(tmp_path.iterdir()) == []
    record = _record()
    record["chosen_plan"] = None  # the search is still running: no plan to draw, the trials so far are drawn
    record["trials"][-1]["verdict"] = None  # the trial running now is not drawn
    assert plan_figure(record) is None
    figure = trials_figure(record)
    assert figure is not None
    assert len(figure.axes[1].get_xticklabels()) == 2


def test_without_matplotlib_one_info_line_and_no_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    monkeypatch.setattr(figures, "rank_zero_info", said.append)  # Lightning's info logger does not propagate
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert write_figures(_record(), tmp_path) == {}
    assert write_figures(_record(), tmp_path, final=True) == {}  # the write at the fit's end says nothing again
    assert said == [NO_MATPLOTLIB] and "pip install 'lightning-comp[figures]'" in said[0]
    assert list(tmp_path.iterdir()) == []
