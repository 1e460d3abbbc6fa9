"""The analysis of ``benchmarks/compare.py``'s raw measurements: throughput, ratios, search cost and the targets.

Throughput = batch size / median batch time of a round (round 0, the warm-up, and the probed steps left out); summary
= median over rounds (spread: min-max); ratios between modes are medians of per-round ratios. ``reanalyse`` rebuilds a
whole report from a ``compare_raw.json`` without measuring again.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from compare_suite import ModelSpec

# Targets of the issue (ratios measured in one run).
TARGET_GEOMEAN_VS_AMP = 1.15
TARGET_PER_MODEL_VS_AMP = 1.0
TARGET_PER_MODEL_VS_FP32 = 1.0
TARGET_VS_BF16_TRUE = 0.95
TARGET_MEMORY_VS_AMP = 0.8
MEMORY_TARGET_MODELS = ("cnn", "gpt")
TARGET_SEARCH_SHARE = 0.10
REFERENCE_EPOCHS = 20


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def _geomean(values: list[float]) -> float:
    values = [v for v in values if v and math.isfinite(v) and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def throughput_stats(result: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """Per-round throughput (samples/s from the round's median batch time); round 0 is warm-up."""
    per_round: dict[int, list[float]] = {}
    steady: list[float] = []
    for b in result["batches"]:
        if b["round"] < 1 or b["special"]:
            continue
        per_round.setdefault(b["round"], []).append(b["ms"])
        steady.append(b["ms"])
    rounds = {r: batch_size / (_median(v) / 1e3) for r, v in sorted(per_round.items())}
    values = list(rounds.values())
    if not values:  # too few steps for a warm-up round: use everything but the special steps
        steady = [b["ms"] for b in result["batches"] if not b["special"]]
        values = [batch_size / (_median(steady) / 1e3)] if steady else []
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3 if values else [math.nan] * 3
    return {
        "samples_per_s": _median(values),
        "min": min(values) if values else math.nan,
        "max": max(values) if values else math.nan,
        "q1": q[0], "q3": q[2],
        "rounds": {str(k): v for k, v in rounds.items()},
        "pooled_samples_per_s": batch_size / (_median(steady) / 1e3) if steady else math.nan,
        "median_step_ms": _median(steady),
        "min_step_ms": min(steady) if steady else math.nan,
        "steady_batches": len(steady),
    }


def round_ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Median (and min/max) over rounds of the per-round throughput ratio a/b."""
    ra, rb = a["rounds"], b["rounds"]
    ratios = [ra[r] / rb[r] for r in ra if r in rb and rb[r] > 0]
    if not ratios:
        value = a["samples_per_s"] / b["samples_per_s"] if b["samples_per_s"] else math.nan
        return {"median": value, "min": value, "max": value, "rounds": 0}
    return {"median": _median(ratios), "min": min(ratios), "max": max(ratios), "rounds": len(ratios),
            "ratio_of_medians": a["samples_per_s"] / b["samples_per_s"]}


def _step_peak(entry: dict[str, Any]) -> float:
    """Peak tensor bytes of one steady training step (the memory target's metric), NaN if not measured."""
    peak = ((entry.get("memory") or {}).get("step_peak") or {}).get("bytes")
    return float(peak) if peak else math.nan


def _final_val(result: dict[str, Any]) -> dict[str, float]:
    return result["validation"][-1] if result.get("validation") else {}


def _within(value: float, reference: float, tolerance: float, mode: str, relative: bool = True) -> bool:
    if not (math.isfinite(value) and math.isfinite(reference)):
        return False
    slack = tolerance * (abs(reference) if relative else 1.0)
    return value <= reference + slack if mode == "min" else value >= reference - slack


def analyse_model(spec: ModelSpec, search: dict[str, Any], runs: dict[str, Any],
                  tolerance: float, tolerance_mode: str) -> dict[str, Any]:
    """Throughput, memory and convergence per mode, CoMP's ratios to the other modes and the search's summary.

    Args:
        spec: The model.
        search: The search worker's result (or an ``error``).
        runs: The training workers' results by mode.
        tolerance: The search's val_loss tolerance, for "converges like FP32".
        tolerance_mode: ``relative`` or absolute.

    Returns:
        ``modes``, ``ratios``, ``search``, ``metric`` and ``metric_mode``.
    """
    batch = int(spec.data_kwargs["batch_size"])
    from lightning_comp import zoo

    model_cls = getattr(zoo, spec.model)
    metric, metric_mode = model_cls.val_metric, model_cls.val_metric_mode
    out: dict[str, Any] = {"modes": {}, "metric": metric, "metric_mode": metric_mode}
    for mode, result in runs.items():
        if "error" in result:
            out["modes"][mode] = {"error": result["error"]}
            continue
        entry = {
            "throughput": throughput_stats(result, batch),
            "memory": result["memory"],
            "saved_for_backward": result["saved_for_backward"],
            "final_validation": _final_val(result),
            "validation": result["validation"],
            "profile": result.get("profile"),
            "forward_hooks": result.get("forward_hooks"),
            "param_dtype": result.get("param_dtype"),
            "device": result.get("device"),
            "torch_threads": result.get("torch_threads"),
            "steps": result.get("global_step"),
            "fit_seconds": result.get("fit_seconds"),
            "train_loss_last": next((b["loss"] for b in reversed(result["batches"]) if b["loss"] is not None), None),
        }
        for key in ("plan_lowered", "hooked_operators"):
            if key in result:
                entry[key] = result[key]
        out["modes"][mode] = entry
    modes = out["modes"]
    ok = {m for m, e in modes.items() if "error" not in e}
    fp32_loss = modes["fp32"]["final_validation"].get("val_loss", math.nan) if "fp32" in ok else math.nan
    for mode in ok:
        val = modes[mode]["final_validation"].get("val_loss", math.nan)
        modes[mode]["converges_like_fp32"] = _within(val, fp32_loss, tolerance, "min", tolerance_mode == "relative")
    ratios: dict[str, Any] = {}
    if "comp" in ok:
        comp = modes["comp"]
        for other in ("bf16-mixed", "fp32", "bf16-true", "16-mixed"):
            if other in ok:
                ratios[f"throughput_vs_{other}"] = round_ratio(comp["throughput"], modes[other]["throughput"])
                inc_o = modes[other]["memory"]["increment_bytes"]
                inc_c = comp["memory"]["increment_bytes"]
                ratios[f"memory_increment_vs_{other}"] = inc_c / inc_o if inc_o else math.nan
                step_o, step_c = _step_peak(modes[other]), _step_peak(comp)
                ratios[f"memory_step_peak_vs_{other}"] = step_c / step_o if step_o else math.nan
                peak_o = modes[other]["memory"]["peak_bytes"]
                ratios[f"memory_peak_vs_{other}"] = comp["memory"]["peak_bytes"] / peak_o if peak_o else math.nan
                so, sc = modes[other]["saved_for_backward"], comp["saved_for_backward"]
                if so and sc and so["activation_bytes"]:
                    ratios[f"saved_bytes_vs_{other}"] = sc["activation_bytes"] / so["activation_bytes"]
    if "bf16-mixed" in ok and "fp32" in ok:
        ratios["amp_vs_fp32"] = round_ratio(modes["bf16-mixed"]["throughput"], modes["fp32"]["throughput"])
    if "bf16-true" in ok and "fp32" in ok:
        ratios["bf16_true_vs_fp32"] = round_ratio(modes["bf16-true"]["throughput"], modes["fp32"]["throughput"])
    out["ratios"] = ratios
    out["search"] = search_summary(spec, search, modes)
    return out


def search_summary(spec: ModelSpec, search: dict[str, Any], modes: dict[str, Any]) -> dict[str, Any]:
    """The search's cost (measured, and extrapolated to full epochs and a 20-epoch run), its trials and decisions.

    Args:
        spec: The model.
        search: The search worker's result (or an ``error``).
        modes: The analysed modes (the step times of ``comp`` and ``fp32`` price the epochs).

    Returns:
        The summary, or ``{"error": ...}``.
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
    comp_ms = modes.get("comp", {}).get("throughput", {}).get("median_step_ms", math.nan)
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
        "chosen_trial": record.get("chosen_trial"),
        "finish_reason": record.get("finish_reason"),
        "lowered_operators": record.get("lowered_operators", []),
        "num_operators": record.get("num_operators"),
        "decision_counts": reasons,
        "profile_step_ms": record.get("step_ms", {}),
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


def evaluate_targets(models: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """Check every target of the issue against the analysed models.

    Args:
        models: The analysed models by key.
        tolerance: The search's val_loss tolerance.

    Returns:
        ``checks`` (one per target and model; ``met`` is None where a target does not apply) and ``geomean_vs_amp``.
    """
    checks: list[dict[str, Any]] = []

    def add(name: str, value: float, target: float, op: str, model: str | None = None, note: str = "") -> None:
        ok = (value >= target if op == ">=" else value <= target) if math.isfinite(value) else False
        checks.append({"target": name, "model": model, "value": value, "op": op, "threshold": target,
                       "met": bool(ok), "note": note})

    vs_amp = []
    for key, m in models.items():
        r = m.get("ratios", {})
        if "throughput_vs_bf16-mixed" in r:
            vs_amp.append(r["throughput_vs_bf16-mixed"]["median"])
            add("throughput CoMP/AMP", r["throughput_vs_bf16-mixed"]["median"], TARGET_PER_MODEL_VS_AMP, ">=", key)
        if "throughput_vs_fp32" in r:
            add("throughput CoMP/FP32", r["throughput_vs_fp32"]["median"], TARGET_PER_MODEL_VS_FP32, ">=", key)
        if "throughput_vs_bf16-true" in r:
            converges = m["modes"]["bf16-true"].get("converges_like_fp32", False)
            add("throughput CoMP/bf16-true", r["throughput_vs_bf16-true"]["median"], TARGET_VS_BF16_TRUE, ">=", key,
                note="" if converges else "bf16-true does not converge like FP32 here: target not applicable")
            if not converges:
                checks[-1]["met"] = None
        if key in MEMORY_TARGET_MODELS and "memory_step_peak_vs_bf16-mixed" in r:
            add("peak tensor memory of a training step CoMP/AMP", r["memory_step_peak_vs_bf16-mixed"],
                TARGET_MEMORY_VS_AMP, "<=", key,
                note=f"process RSS increment ratio {r['memory_increment_vs_bf16-mixed']:.2f}")
        comp = m["modes"].get("comp", {})
        fp32 = m["modes"].get("fp32", {})
        if "final_validation" in comp and "final_validation" in fp32:
            c = comp["final_validation"].get("val_loss", math.nan)
            f = fp32["final_validation"].get("val_loss", math.nan)
            add("val_loss CoMP/FP32", c / f if f else math.nan, 1 + tolerance, "<=", key,
                note=f"CoMP {c:.4f} vs FP32 {f:.4f}")
        s = m.get("search", {})
        if s.get("default_example") and s.get("real_run"):
            real = s["real_run"]
            add("search cost share of a 20-epoch run (default example)", real["total_share_of_fit"],
                TARGET_SEARCH_SHARE, "<=", key,
                note=f"measured: search {real['search_seconds']:.1f} s + FP32 warm-up over the plan"
                f" {real['warmup_overhead_seconds'] or 0.0:.1f} s = {real['total_seconds']:.1f} s of a"
                f" {real['fit_seconds']:.0f} s fit of {real['epochs_trained']} epochs (search alone"
                f" {real['share_of_fit']:.3f}); vs 20 epochs of training alone at the plan's benchmark step time:"
                f" {s['extrapolated']['share_incl_warmup_penalty']:.3f} with the warm-up")
        elif s.get("default_example") and "extrapolated" in s:
            add("search cost share of a 20-epoch run (default example)", s["extrapolated"]["share_of_20_epoch_run"],
                TARGET_SEARCH_SHARE, "<=", key,
                note="search measured on full epochs; 20-epoch run = 20 x full epoch at the plan's measured step time"
                if s["extrapolated"]["scale"] == 1 else "search cost extrapolated from shortened epochs")
    if vs_amp:
        add("throughput CoMP/AMP geomean over the suite", _geomean(vs_amp), TARGET_GEOMEAN_VS_AMP, ">=")
    return {"checks": checks, "geomean_vs_amp": _geomean(vs_amp) if vs_amp else math.nan}


def analyse_raw(spec: ModelSpec, raw: dict[str, Any], tolerance: float, tolerance_mode: str) -> dict[str, Any]:
    """``analyse_model`` on one model's raw record, plus its round orders, duration, title and load average."""
    analysed = analyse_model(spec, raw["search"], raw["runs"], tolerance, tolerance_mode)
    analysed.update(round_orders=raw["orders"], seconds=raw["seconds"], title=spec.title,
                    load_average_after=raw["load_average_after"])
    return analysed


def reanalyse(path: Path) -> dict[str, Any]:
    """Rebuild the report from a ``compare_raw.json`` (after a change to the analysis, without re-measuring)."""
    report = json.loads(path.read_text())
    report["models"] = {}
    for key, raw in report["raw"].items():
        spec = ModelSpec(**report["specs"][key])
        report["models"][key] = analyse_raw(spec, raw, report["tolerance"], report["tolerance_mode"])
    report["targets"] = evaluate_targets(report["models"], report["tolerance"])
    return report
