"""The columns of ``benchmarks/compare.py`` that compare CoMP with fixed policies and the batch stage's own evidence.

On hand-made worker results and search records (nothing is trained): CoMP against the best fixed policy that converges
like FP32 (the one-line type rule ``type-linear`` included), the batch stage's trialled plan against the fastest plan it
measured, its forecast of CoMP/AMP against training's, the targets on them, and the Markdown and CSV cells. Records
from before the record's ``trialled_plan`` existed read ``n/a``, never an error.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from compare_analysis import (  # type: ignore[import-not-found]  # noqa: E402
    analyse_model,
    best_fixed_policy,
    evaluate_targets,
    forecast_vs_training,
)
from compare_report import (  # type: ignore[import-not-found]  # noqa: E402
    _comp_columns,
    csv_rows,
    fixed_policy_lines,
    phase_lines,
)
from compare_searches import trialled_plan_summary  # type: ignore[import-not-found]  # noqa: E402
from compare_suite import (  # type: ignore[import-not-found]  # noqa: E402
    COMP_MODES,
    FIXED_PLAN_MODES,
    FIXED_POLICY_MODES,
    MODES,
    SUITE,
)

NEW_RECORD: dict[str, Any] = {
    "step_ms": {"fp32": 200.0, "candidates": 115.0, "amp": 132.0, "all_low": 126.0, "compute": 105.0},
    "step_ratios": {"compute": {"ratio": 0.55, "low": 0.5, "high": 0.7, "rounds": 4, "confidence": 0.75}},
    "trialled_plan": {"from": "compute", "refined": True, "step_ms": 100.0, "ratio_to_fp32": 0.5,
                      "fastest_measured": "compute", "fastest_ms": 105.0},
}
OLD_RECORD: dict[str, Any] = {"step_ms": {"fp32": 200.0, "candidates": 115.0, "amp": 132.0}, "step_ratios": {}}


def test_type_rule_mode_is_a_fixed_plan_not_a_search() -> None:
    mode = MODES["type-linear"]
    assert mode.fixed_plan == {"type:Linear": "bf16"} and mode.trainer_precision is None and mode.objective is None
    assert mode.label == 'Type rule {"type:Linear": "bf16"}'
    assert FIXED_PLAN_MODES == ("type-linear",) and "type-linear" not in COMP_MODES
    assert FIXED_POLICY_MODES == ("fp32", "bf16-mixed", "bf16-true", "type-linear")
    from lightning_comp import PrecisionPlan

    assert PrecisionPlan.from_dict(mode.fixed_plan).to_dict()["entries"] == {"type:Linear": "bf16"}


def test_trialled_plan_summary_of_a_new_record() -> None:
    t = trialled_plan_summary(NEW_RECORD)
    assert t["recorded"] is True and t["from"] == "compute" and t["refined"] is True
    assert t["vs_fastest_measured"] == pytest.approx(105.0 / 100.0)  # refinement beat every measured plan
    assert t["forecast_vs_amp"] == pytest.approx(132.0 / 100.0)
    assert t["fastest_measured"] == "compute" and t["fastest_ms"] == 105.0 and t["amp_ms"] == 132.0
    assert t["measured_step_ms"]["compute"] == 105.0 and "compute" in t["step_ratios"]


@pytest.mark.parametrize("record", [OLD_RECORD, {}, None, {"trialled_plan": "?", "step_ms": {"amp": "x"}},
                                    {"trialled_plan": {"step_ms": 0.0, "fastest_ms": 1.0}, "step_ms": None}])
def test_trialled_plan_summary_of_an_older_or_odd_record_reads_nan(record: Any) -> None:
    t = trialled_plan_summary(record)
    assert not math.isfinite(t["vs_fastest_measured"]) and not math.isfinite(t["forecast_vs_amp"])
    assert t["refined"] is None and t["fastest_measured"] is None


def _throughput(samples_per_s: float) -> dict[str, Any]:
    return {"samples_per_s": samples_per_s, "min": samples_per_s, "max": samples_per_s,
            "rounds": {"1": samples_per_s, "2": samples_per_s}}


def test_best_fixed_policy_skips_what_does_not_converge() -> None:
    modes = {"fp32": {"throughput": _throughput(100.0), "converges_like_fp32": True},
             "bf16-mixed": {"throughput": _throughput(150.0), "converges_like_fp32": True},
             "bf16-true": {"throughput": _throughput(300.0), "converges_like_fp32": False},
             "type-linear": {"throughput": _throughput(160.0), "converges_like_fp32": True},
             "comp": {"throughput": _throughput(400.0), "converges_like_fp32": True},  # not a fixed policy
             "16-mixed": {"error": "boom"}}
    best = best_fixed_policy(modes)
    assert best["mode"] == "type-linear" and best["label"] == MODES["type-linear"].label
    assert best["samples_per_s"] == 160.0 and best["not_converging"] == ["bf16-true"]
    assert set(best["converging"]) == {"fp32", "bf16-mixed", "type-linear"}
    older = {k: v for k, v in modes.items() if k != "type-linear"}  # a report from before the type rules
    assert best_fixed_policy(older)["mode"] == "bf16-mixed"
    none = best_fixed_policy({"fp32": {"error": "x"}})
    assert none["mode"] is None and none["label"] is None and math.isnan(none["samples_per_s"])


def test_forecast_vs_training() -> None:
    f = forecast_vs_training(trialled_plan_summary(NEW_RECORD), {"median": 1.254})
    assert f["forecast"] == pytest.approx(1.32) and f["training"] == 1.254
    assert f["gap_pct"] == pytest.approx(100 * (1.254 / 1.32 - 1))
    assert math.isnan(forecast_vs_training(trialled_plan_summary(NEW_RECORD), None)["gap_pct"])  # AMP did not run
    old = forecast_vs_training(trialled_plan_summary(OLD_RECORD), {"median": 1.1})
    assert math.isnan(old["forecast"]) and math.isnan(old["gap_pct"]) and old["training"] == 1.1


def _run(ms: float, val_loss: float) -> dict[str, Any]:
    """A training worker's result: 3 rounds of 2 steps at ``ms`` each, one validation."""
    return {"batches": [{"round": r, "special": False, "ms": ms, "loss": 1.0} for r in range(3) for _ in range(2)],
            "memory": {"increment_bytes": 1000, "peak_bytes": 2000, "step_peak": {"bytes": 500}},
            "saved_for_backward": {"activation_bytes": 100}, "validation": [{"step": 6, "val_loss": val_loss}],
            "global_step": 6}


def _search(record: dict[str, Any]) -> dict[str, Any]:
    return {"sizes": {"train_batches_per_epoch": 10, "val_batches_per_epoch": 2}, "search_train_batches": 5,
            "search_val_batches": 1, "search_kwargs": {"warmup_epochs": 1}, "record": record, "fit_seconds": 1.0}


def _analysed(record: dict[str, Any], with_type_rule: bool = True) -> dict[str, Any]:
    runs = {"fp32": _run(10.0, 1.0), "bf16-mixed": _run(8.0, 1.005), "bf16-true": _run(5.0, 1.5),
            "comp": _run(6.0, 1.001)}
    if with_type_rule:
        runs["type-linear"] = _run(7.0, 1.002)
    return analyse_model(SUITE["mlp"], _search(record), runs, 0.02, "relative")


def test_analysed_model_has_the_new_ratios() -> None:
    model = _analysed(NEW_RECORD)
    r = model["ratios"]
    assert r["best_fixed_policy"]["mode"] == "type-linear"  # bf16-true is faster but does not converge
    assert r["best_fixed_policy"]["not_converging"] == ["bf16-true"]
    assert r["throughput_vs_best_fixed"]["median"] == pytest.approx(7.0 / 6.0)
    assert r["throughput_vs_type-linear"]["median"] == pytest.approx(7.0 / 6.0)
    assert r["trialled_vs_fastest_measured"] == pytest.approx(1.05)
    f = r["forecast_vs_training_amp"]
    assert f["training"] == pytest.approx(8.0 / 6.0) and f["forecast"] == pytest.approx(1.32)
    assert f["gap_pct"] == pytest.approx(100 * ((8.0 / 6.0) / 1.32 - 1))
    assert model["search"]["trialled_plan"]["from"] == "compute"


def _check(targets: dict[str, Any], name: str) -> dict[str, Any]:
    (check,) = [c for c in targets["checks"] if c["target"] == name]
    return check


def test_targets_on_a_new_record() -> None:
    targets = evaluate_targets({"mlp": _analysed(NEW_RECORD)}, 0.02)
    assert _check(targets, "throughput CoMP/best fixed policy that converges")["met"] is True
    trialled = _check(targets, "trialled plan/fastest measured plan (batch stage)")
    assert trialled["met"] is True and trialled["threshold"] == 0.98 and "compute refined" in trialled["note"]
    gap = _check(targets, "|gap| training vs forecast CoMP/AMP (%)")
    assert gap["value"] == pytest.approx(abs(100 * ((8.0 / 6.0) / 1.32 - 1))) and gap["met"] is True
    geomean = _check(targets, "throughput CoMP/AMP geomean over the suite")
    assert geomean["threshold"] == 1.15 and geomean["met"] is True
    assert targets["geomean_vs_best_fixed"] == pytest.approx(7.0 / 6.0)
    compiled = evaluate_targets({"mlp": _analysed(NEW_RECORD)}, 0.02, compiled=True)
    assert _check(compiled, "throughput CoMP/AMP geomean over the suite")["met"] is None  # the eager runs' target


def test_targets_on_an_older_record_are_not_applicable() -> None:
    targets = evaluate_targets({"mlp": _analysed(OLD_RECORD, with_type_rule=False)}, 0.02)
    assert _check(targets, "trialled plan/fastest measured plan (batch stage)")["met"] is None
    assert _check(targets, "|gap| training vs forecast CoMP/AMP (%)")["met"] is None
    best = _check(targets, "throughput CoMP/best fixed policy that converges")
    assert best["value"] == pytest.approx(8.0 / 6.0) and "AMP" in best["note"]  # no type rule in an older report
    # an analysed model from before these columns (no such ratios, no trialled_plan) still evaluates
    bare = {"modes": {"comp": {}}, "ratios": {"throughput_vs_bf16-mixed": {"median": 1.2}}, "search": {}}
    names = {c["target"] for c in evaluate_targets({"gpt": bare}, 0.02)["checks"]}
    assert names == {"throughput CoMP/AMP", "throughput CoMP/AMP geomean over the suite"}


def test_markdown_and_csv_cells() -> None:
    report = {"models": {"mlp": _analysed(NEW_RECORD), "old": _analysed(OLD_RECORD, with_type_rule=False)}}
    lines = fixed_policy_lines(report)
    header = next(line for line in lines if line.startswith("| model |"))
    assert f"CoMP / {MODES['type-linear'].label}" in header and "trialled vs fastest" in header
    mlp = next(line for line in lines if line.startswith("| mlp |"))
    old = next(line for line in lines if line.startswith("| old |"))
    assert "compute + refined" in mlp and "1.050" in mlp and "1.320" in mlp
    columns = len(header.split("|"))
    assert len(mlp.split("|")) == columns and len(old.split("|")) == columns
    assert old.count("n/a") >= 6  # the type rule, the trialled plan's three cells, vs fastest, forecast, gap
    cells = _comp_columns(report["models"]["mlp"])
    assert cells["best_fixed_mode"] == "type-linear" and cells["trialled_from"] == "compute"
    assert cells["trialled_vs_fastest_measured"] == pytest.approx(1.05)
    rows = csv_rows(report)
    comp = next(row for row in rows if row["model"] == "old" and row["mode"] == "comp")
    assert comp["trialled_from"] is None and math.isnan(comp["trialled_vs_fastest_measured"])
    assert all("trialled_from" not in row for row in rows if row["mode"] != "comp")


@pytest.mark.parametrize(("amp_loss", "memory_loss", "reference", "met"), [
    (1.005, 1.05, "FP32", False),  # AMP within the tolerance of FP32: FP32 is the reference
    (1.10, 1.11, "AMP", True),  # AMP itself past it (FP32 noisy): within the tolerance of AMP's
    (1.10, 0.99, "FP32", True),  # nearer FP32's than AMP's: judged against FP32
])
def test_the_memory_objectives_val_target_falls_back_to_amp_where_fp32_is_noisy(
        amp_loss: float, memory_loss: float, reference: str, met: bool) -> None:
    # the target: validation within the search's tolerance of FP32 or, where FP32 itself is noisy, of AMP
    runs = {"fp32": _run(10.0, 1.0), "bf16-mixed": _run(8.0, amp_loss), "comp-memory": _run(8.5, memory_loss)}
    model = analyse_model(SUITE["mlp"], _search(NEW_RECORD), runs, 0.02, "relative")
    targets = evaluate_targets({"gpt": model}, 0.02)  # a model with the memory axis's targets
    (check,) = [c for c in targets["checks"] if c["target"].startswith("val_loss CoMP (memory)/")]
    assert check["target"] == f"val_loss CoMP (memory)/{reference}" and check["met"] is met, check


def _phased(forward: float, backward: float, update: float) -> dict[str, Any]:
    """A worker's result whose steady batches are split into phases (round 0, warm-up, far slower)."""
    run = _run(forward + backward + update, 1.0)
    for batch in run["batches"]:
        scale = 10.0 if batch["round"] == 0 else 1.0
        batch["phases"] = {"forward": forward * scale, "backward": backward * scale, "update": update * scale}
    return run


def test_where_a_training_steps_time_goes() -> None:
    runs = {"fp32": _phased(3.0, 5.0, 2.0), "comp": _phased(2.0, 3.5, 4.5), "bf16-mixed": _run(8.0, 1.0)}
    model = analyse_model(SUITE["mlp"], _search(NEW_RECORD), runs, 0.02, "relative")
    assert model["modes"]["comp"]["throughput"]["phases_ms"] == {"forward": 2.0, "backward": 3.5, "update": 4.5}
    assert model["modes"]["bf16-mixed"]["throughput"]["phases_ms"] is None  # a worker that did not split its batches
    lines = phase_lines({"models": {"mlp": model}})
    header = next(line for line in lines if line.startswith("| model |"))
    comp = next(line for line in lines if line.startswith(f"| mlp | {MODES['comp'].label} |"))
    assert comp == f"| mlp | {MODES['comp'].label} | 2.0 | 3.5 | 4.5 | 10.0 | -1.0 | -1.5 | +2.5 |"
    assert len(comp.split("|")) == len(header.split("|"))
    assert not any(line.startswith(f"| mlp | {MODES['bf16-mixed'].label} |") for line in lines)
    assert phase_lines({"models": {"old": _analysed(OLD_RECORD)}}) == []  # no phases timed: no section
