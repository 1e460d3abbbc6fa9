"""The CoMP searches of ``benchmarks/compare.py``: what each cost (measured, extrapolated) and what it chose.

Every CoMP mode has a search of its own (``MODES[mode].objective``). A raw record keeps the throughput search
(``comp``) under ``"search"``, as older raw files do, and the others under ``"searches"`` (absent in older files).
``trialled_plan_summary`` reads what the batch stage measured of the plan it trialled (the record's
``trialled_plan``, ``step_ms`` and ``step_ratios``): how it compares with the fastest whole-step plan measured and its
forecast against one global autocast region (``forecast_check``; older records: AMP's plan). Records from before
``trialled_plan`` existed give NaN (``n/a``) there.
"""

from __future__ import annotations

import math
from typing import Any

from compare_suite import ModelSpec

REFERENCE_EPOCHS = 20


def mode_searches(raw: dict[str, Any]) -> dict[str, Any]:
    """Every CoMP mode's search result in a model's raw record, by mode (``comp`` first).

    Args:
        raw: One model's raw record (``"search"`` and, since the memory axis, ``"searches"``).

    Returns:
        The search worker's result (or ``{"error": ...}``) by CoMP mode.
    """
    return {"comp": raw["search"], **(raw.get("searches") or {})}


def _number(value: Any) -> float:
    """``value`` as a finite float, or NaN (missing, not a number, infinite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value) if math.isfinite(value) else math.nan


def _quotient(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, NaN unless both are finite and the denominator positive."""
    if not (math.isfinite(numerator) and math.isfinite(denominator)) or denominator <= 0:
        return math.nan
    return numerator / denominator


def trialled_plan_summary(record: dict[str, Any] | None) -> dict[str, Any]:
    """What the batch stage measured of the plan it trialled, from a search record (older records: NaN, ``None``).

    Args:
        record: The search's ``search_record.json`` dict: ``trialled_plan`` (``from``, ``refined``, ``step_ms``,
            ``ratio_to_fp32``, ``fastest_measured``, ``fastest_ms``), ``step_ms`` (ms of each whole-step plan
            measured, by label) and ``step_ratios`` (each plan's ratio to FP32 with its interval). Any may be absent.

    Returns:
        ``recorded`` (whether the record has a ``trialled_plan``), ``from``, ``refined``, ``step_ms`` (the batch
        stage's forecast of the trialled plan's step), ``ratio_to_fp32``, ``fastest_measured``, ``fastest_ms``,
        ``vs_fastest_measured`` (``fastest_ms / step_ms``: 1 where the fastest measured plan was trialled, > 1 where
        refinement found a faster one), ``amp_ms`` (AMP's plan's measured step), ``forecast_vs_amp``
        (``amp_ms / step_ms``: the forecast speed-up over AMP), ``measured_step_ms`` and ``step_ratios``.
    """
    record = record if isinstance(record, dict) else {}
    trialled = record.get("trialled_plan")
    trialled = trialled if isinstance(trialled, dict) else {}
    step_ms = record.get("step_ms")
    step_ms = step_ms if isinstance(step_ms, dict) else {}
    ratios = record.get("step_ratios")
    trialled_ms = _number(trialled.get("step_ms"))
    fastest_ms = _number(trialled.get("fastest_ms"))
    amp_ms = _number(step_ms.get("amp"))
    check = record.get("forecast_check")
    check = check if isinstance(check, dict) else {}
    # the forecast against one global autocast region (what bf16-mixed trains), with the optimizer and loop time
    # training adds to both (forecast_check); older records: AMP's plan's batch-stage step over the trialled plan's
    forecast = _number(check.get("autocast_forecast_speedup"))
    if not math.isfinite(forecast):
        forecast = _quotient(amp_ms, trialled_ms)
    refined = trialled.get("refined")
    return {
        "recorded": bool(trialled),
        "from": trialled.get("from"),
        "refined": refined if isinstance(refined, bool) else None,
        "step_ms": trialled_ms,
        "ratio_to_fp32": _number(trialled.get("ratio_to_fp32")),
        "fastest_measured": trialled.get("fastest_measured"),
        "fastest_ms": fastest_ms,
        "vs_fastest_measured": _quotient(fastest_ms, trialled_ms),
        "amp_ms": amp_ms,
        "forecast_vs_amp": forecast,
        "forecast_check": check,
        "measured_step_ms": {str(label): _number(ms) for label, ms in step_ms.items()},
        "step_ratios": ratios if isinstance(ratios, dict) else {},
    }


def _saved_lowered(record: dict[str, Any]) -> dict[str, str]:
    """Operator -> saved precision of the chosen plan's saved-for-backward lowerings (older records: none)."""
    saved = record.get("saved_lowered")
    if saved is None:
        saved = ((record.get("chosen_plan") or {}).get("saved")) or {}
    return {str(k): str(v) for k, v in saved.items() if v != "fp32"}


def search_summary(spec: ModelSpec, search: dict[str, Any], modes: dict[str, Any],
                   mode: str = "comp") -> dict[str, Any]:
    """The search's cost (measured, and extrapolated to full epochs and a 20-epoch run), its trials and decisions.

    Args:
        spec: The model.
        search: The search worker's result (or an ``error``).
        modes: The analysed modes (the step times of ``mode`` and ``fp32`` price the epochs).
        mode: The CoMP mode whose search this is (its plan's step time prices the 20-epoch run).

    Returns:
        The summary (with the search's ``objective``, the chosen ``saved_lowered`` and ``trialled_plan``: the
        batch stage's trialled plan against the fastest measured and AMP's, ``trialled_plan_summary``), or
        ``{"error": ...}``.
    """
    if "error" in search:
        return {"error": search["error"]}
    record = search.get("record") or {}
    cost = record.get("cost") or {}
    sizes = search["sizes"]
    scale = sizes["train_batches_per_epoch"] / max(1, search["search_train_batches"])
    profiling = float(cost.get("profiling_seconds") or 0.0)
    rejected_recorded = float(cost.get("rejected_trial_seconds") or 0.0)
    search_recorded = float(cost.get("search_seconds") or 0.0)
    # Since commit bb58650 the record counts the batch stage once (before, the reference trial's seconds contained
    # it and search_seconds = profiling + rejected counted it twice); older records are flagged here.
    trials_raw = record.get("trials", [])
    double_counted = bool(trials_raw and not trials_raw[0].get("kept") and profiling > 0
                          and (trials_raw[0].get("seconds") or 0.0) >= profiling
                          and search_recorded > float(search.get("fit_seconds") or math.inf))
    rejected = rejected_recorded
    search_seconds = search_recorded
    comp_ms = modes.get(mode, {}).get("throughput", {}).get("median_step_ms", math.nan)
    fp32_ms = modes.get("fp32", {}).get("throughput", {}).get("median_step_ms", math.nan)
    full_epoch_comp = sizes["train_batches_per_epoch"] * comp_ms / 1e3
    full_epoch_fp32 = sizes["train_batches_per_epoch"] * fp32_ms / 1e3
    search_full = profiling + rejected * scale
    run20 = REFERENCE_EPOCHS * full_epoch_comp
    warmup_epochs = int(search["search_kwargs"].get("warmup_epochs", 1))
    # What a user pays beyond training with the plan from step 0: the search's cost plus the FP32 warm-up epoch(s),
    # which run slower than the plan would.
    warmup_penalty = warmup_epochs * max(0.0, full_epoch_fp32 - full_epoch_comp)
    trials = [{k: t.get(k) for k in ("label", "verdict", "reason", "metric", "reference", "seconds", "median_step_ms",
                                     "kept", "low_operators")} for t in record.get("trials", [])]
    operators = record.get("operators", {})
    reasons: dict[str, int] = {}
    for info in operators.values():
        key = f"{info.get('decision')}: {str(info.get('reason', '')).split(' (')[0].split(':')[0]}"
        reasons[key] = reasons.get(key, 0) + 1
    return {
        "mode": mode,
        "objective": record.get("objective") or search["search_kwargs"].get("objective", "throughput"),
        "chosen_trial": record.get("chosen_trial"),
        "finish_reason": record.get("finish_reason"),
        "lowered_operators": record.get("lowered_operators", []),
        "num_operators": record.get("num_operators"),
        "saved_lowered": _saved_lowered(record),
        "saved_step": record.get("saved_step") or {},
        "decision_counts": reasons,
        "profile_step_ms": record.get("step_ms", {}),
        "trialled_plan": trialled_plan_summary(record),
        "trials": trials,
        "measured": {"profiling_seconds": profiling, "rejected_trial_seconds": rejected,
                     "search_seconds": search_seconds, "record_search_seconds": search_recorded,
                     "record_double_counts_profiling": double_counted,
                     "fit_seconds": search.get("fit_seconds"),
                     "wall_seconds_incl_process_start": search.get("wall_seconds"),
                     "search_train_batches": search["search_train_batches"],
                     "search_val_batches": search["search_val_batches"],
                     "share_of_this_fit": cost.get("share_of_fit")},
        "extrapolated": {"train_batches_per_full_epoch": sizes["train_batches_per_epoch"],
                         "scale": scale,
                         "search_seconds_full_epochs": search_full,
                         "comp_epoch_seconds_full": full_epoch_comp,
                         "fp32_epoch_seconds_full": full_epoch_fp32,
                         f"run_{REFERENCE_EPOCHS}_epochs_seconds": run20,
                         "share_of_20_epoch_run": search_full / run20 if run20 and math.isfinite(run20) else math.nan,
                         "fp32_warmup_penalty_seconds": warmup_penalty,
                         "share_incl_warmup_penalty": (search_full + warmup_penalty) / run20
                         if run20 and math.isfinite(run20) else math.nan},
        "real_run": _real_run(search),
        "search_run_final_metrics": search.get("final_metrics"),
        "default_example": spec.default_example,
    }


def _real_run(search: dict[str, Any]) -> dict[str, Any] | None:
    """The search run itself, when it trained ``REFERENCE_EPOCHS`` user epochs on full epochs: a measured share."""
    record = search.get("record") or {}
    cost = record.get("cost") or {}
    epochs = len(search.get("epoch_times") or [])
    full = search.get("search_train_batches") == (search.get("sizes") or {}).get("train_batches_per_epoch")
    if not full or epochs < REFERENCE_EPOCHS or not cost.get("fit_seconds"):
        return None
    return {"epochs_trained": epochs, "extension_epochs": record.get("extension_epochs"),
            "fit_seconds": cost["fit_seconds"], "search_seconds": cost.get("search_seconds"),
            "share_of_fit": cost.get("share_of_fit"),
            # the record also charges the FP32 warm-up epoch's lost time against the plan (measured batch times)
            "warmup_overhead_seconds": cost.get("warmup_overhead_seconds"),
            "total_seconds": cost.get("total_seconds", cost.get("search_seconds")),
            "total_share_of_fit": cost.get("total_share_of_fit", cost.get("share_of_fit")),
            "final_metrics": search.get("final_metrics")}

