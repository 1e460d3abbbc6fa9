"""The analysis of ``benchmarks/compare.py``'s raw measurements: throughput, ratios, search cost and the targets.

Throughput = batch size / median batch time of a round (round 0, the warm-up, and the probed steps left out); summary
= median over rounds (spread: min-max); ratios between modes are medians of per-round ratios. ``ratios`` holds the
throughput-searched CoMP mode's ratios to every other mode; ``ratios_by_mode`` every CoMP mode's ratios to AMP
(``bf16-mixed``) and whether it converges like FP32 (the memory axis). ``ratios`` also holds CoMP against the best
fixed policy that converges like FP32 (``best_fixed_policy``, ``throughput_vs_best_fixed``: FP32, AMP, bf16-true and
the one-line type rules of ``FIXED_PLAN_MODES``), the batch stage's trialled plan against the fastest plan it measured
(``trialled_vs_fastest_measured``) and its forecast against AMP next to training's (``forecast_vs_training_amp``).
``reanalyse`` rebuilds a whole report from a ``compare_raw.json.gz`` without measuring again (older files, without the
memory-axis modes, the type rules or the trialled plan's record, included: what they lack reads NaN, ``n/a``).
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compare_searches import mode_searches, search_summary
from compare_suite import COMP_MODES, FIXED_PLAN_MODES, FIXED_POLICY_MODES, MODES, ModelSpec
from harness import geomean, median, ratio_summary

# Targets of the issue (ratios measured in one run).
TARGET_GEOMEAN_VS_AMP = 1.15
TARGET_PER_MODEL_VS_AMP = 1.0
TARGET_PER_MODEL_VS_FP32 = 1.0
TARGET_VS_BF16_TRUE = 0.95
TARGET_MEMORY_VS_AMP = 0.8
MEMORY_TARGET_MODELS = ("cnn", "gpt")
AXIS_TARGET_MODELS = ("cnn", "gpt", "litgpt")  # the memory and balanced objectives' targets (issue 34)
TARGET_SEARCH_SHARE = 0.10
TARGET_VS_BEST_FIXED = 0.98  # CoMP / the best fixed policy that converges like FP32, per model
TARGET_TRIALLED_VS_FASTEST = 0.98  # the batch stage's trialled plan / the fastest whole-step plan it measured
TARGET_FORECAST_GAP_PCT = 3.0  # |training CoMP/AMP over the batch stage's forecast CoMP/AMP - 1|, in %
# The memory axis (AXIS_TARGET_MODELS): per CoMP mode, the largest step peak tensor memory and the smallest
# throughput relative to AMP, and whether its final val_loss must stay within the search's tolerance of FP32, or of
# AMP where FP32 itself is noisy (AMP past that tolerance of FP32) (issue 34's targets).
AXIS_TARGETS: dict[str, dict[str, Any]] = {
    "comp-memory": {"memory_vs_amp": 0.60, "throughput_vs_amp": 0.85, "val_within_tolerance": True},
    "comp-balanced": {"memory_vs_amp": 0.75, "throughput_vs_amp": 0.95, "val_within_tolerance": False},
}


def throughput_stats(result: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """Per-round throughput (samples/s from the round's median batch time); round 0 is warm-up."""
    per_round: dict[int, list[float]] = {}
    steady: list[float] = []
    for b in result["batches"]:
        if b["round"] < 1 or b["special"]:
            continue
        per_round.setdefault(b["round"], []).append(b["ms"])
        steady.append(b["ms"])
    rounds = {r: batch_size / (median(v) / 1e3) for r, v in sorted(per_round.items())}
    values = list(rounds.values())
    if not values:  # too few steps for a warm-up round: use everything but the special steps
        steady = [b["ms"] for b in result["batches"] if not b["special"]]
        values = [batch_size / (median(steady) / 1e3)] if steady else []
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3 if values else [math.nan] * 3
    return {
        "samples_per_s": median(values),
        "min": min(values) if values else math.nan,
        "max": max(values) if values else math.nan,
        "q1": q[0], "q3": q[2],
        "rounds": {str(k): v for k, v in rounds.items()},
        "pooled_samples_per_s": batch_size / (median(steady) / 1e3) if steady else math.nan,
        "median_step_ms": median(steady),
        "min_step_ms": min(steady) if steady else math.nan,
        "steady_batches": len(steady),
        "phases_ms": _phases(result["batches"]),
    }


def _phases(batches: list[dict[str, Any]]) -> dict[str, float] | None:
    """The median of each phase of a steady batch (forward, backward, the update and rest; ms), where timed (too few
    steps for a warm-up round, as ``throughput_stats`` does: every batch but the special ones)."""
    timed = [b["phases"] for b in batches if b["round"] >= 1 and not b["special"] and b.get("phases")]
    timed = timed or [b["phases"] for b in batches if not b["special"] and b.get("phases")]
    if not timed:
        return None
    return {name: median([p[name] for p in timed]) for name in timed[0]}


def round_ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Median (and min/max) over rounds of the per-round throughput ratio a/b."""
    ra, rb = a["rounds"], b["rounds"]
    ratios = [ra[r] / rb[r] for r in ra if r in rb and rb[r] > 0]
    if not ratios:
        value = a["samples_per_s"] / b["samples_per_s"] if b["samples_per_s"] else math.nan
        return {"median": value, "min": value, "max": value, "rounds": 0}
    return {**ratio_summary(ratios), "ratio_of_medians": a["samples_per_s"] / b["samples_per_s"]}


def _step_peak(entry: dict[str, Any]) -> float:
    """Peak tensor bytes of one steady training step (the memory target's metric), NaN if not measured."""
    peak = ((entry.get("memory") or {}).get("step_peak") or {}).get("bytes")
    return float(peak) if peak else math.nan


def _process_peak(entry: dict[str, Any], kind: str = "live_bytes") -> float:
    """The peak the process needed for one warm step (``live_bytes``: the heap in use, or ``os_bytes``: RSS), NaN if
    not measured."""
    peak = ((entry.get("memory") or {}).get("process_peak") or {}).get(kind)
    return float(peak) if peak else math.nan


def _final_val(result: dict[str, Any]) -> dict[str, float]:
    return result["validation"][-1] if result.get("validation") else {}


def _within(value: float, reference: float, tolerance: float, mode: str, relative: bool = True) -> bool:
    if not (math.isfinite(value) and math.isfinite(reference)):
        return False
    slack = tolerance * (abs(reference) if relative else 1.0)
    return value <= reference + slack if mode == "min" else value >= reference - slack


def analyse_model(spec: ModelSpec, search: dict[str, Any], runs: dict[str, Any],
                  tolerance: float, tolerance_mode: str, searches: dict[str, Any] | None = None) -> dict[str, Any]:
    """Throughput, memory and convergence per mode, CoMP's ratios to the other modes and the searches' summaries.

    Args:
        spec: The model.
        search: The throughput search's worker result (``comp``; or an ``error``).
        runs: The training workers' results by mode.
        tolerance: The search's val_loss tolerance, for "converges like FP32".
        tolerance_mode: ``relative`` or absolute.
        searches: The other CoMP modes' search results by mode (``comp-balanced``, ``comp-memory``; may be absent).

    Returns:
        ``modes``, ``ratios`` (``comp`` to the other modes), ``ratios_by_mode`` (every CoMP mode to AMP), ``search``
        (``comp``'s), ``searches`` (the other CoMP modes'), ``metric`` and ``metric_mode``.
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
        for key in ("plan_lowered", "plan_saved", "hooked_operators"):
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
        for other in ("bf16-mixed", "fp32", "bf16-true", "16-mixed", *FIXED_PLAN_MODES):
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
    best = best_fixed_policy(modes)
    ratios["best_fixed_policy"] = best
    if "comp" in ok and best["mode"] is not None:
        ratios["throughput_vs_best_fixed"] = round_ratio(modes["comp"]["throughput"], modes[best["mode"]]["throughput"])
    out["ratios"] = ratios
    out["ratios_by_mode"] = ratios_by_mode(modes, fp32_loss, tolerance_mode)
    out["search"] = search_summary(spec, search, modes)
    trialled = out["search"].get("trialled_plan")
    if trialled is not None:
        ratios["trialled_vs_fastest_measured"] = trialled["vs_fastest_measured"]
        ratios["forecast_vs_training_amp"] = forecast_vs_training(trialled, ratios.get("throughput_vs_bf16-mixed"))
    out["searches"] = {mode: search_summary(spec, result, modes, mode) for mode, result in (searches or {}).items()}
    return out


def best_fixed_policy(modes: dict[str, Any]) -> dict[str, Any]:
    """The fastest of the fixed policies (``FIXED_POLICY_MODES``) that ran and converge like FP32.

    Args:
        modes: The analysed modes (``converges_like_fp32`` already set; older reports may lack the type rules).

    Returns:
        ``mode`` (``None`` where no fixed policy ran and converged), ``label``, ``samples_per_s`` (median over
        rounds), ``converging`` (each such policy's samples/s) and ``not_converging`` (those that ran but do not
        converge like FP32: left out).
    """
    converging: dict[str, float] = {}
    not_converging: list[str] = []
    for mode in FIXED_POLICY_MODES:
        entry = modes.get(mode) or {}
        if "throughput" not in entry:
            continue
        value = entry["throughput"].get("samples_per_s", math.nan)
        if not entry.get("converges_like_fp32"):
            not_converging.append(mode)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            converging[mode] = float(value)
    best = max(converging, key=converging.__getitem__) if converging else None
    return {"mode": best, "label": MODES[best].label if best else None,
            "samples_per_s": converging[best] if best else math.nan,
            "converging": converging, "not_converging": not_converging}


def forecast_vs_training(trialled: dict[str, Any], training: dict[str, Any] | None) -> dict[str, float]:
    """The batch stage's forecast of CoMP/AMP next to the CoMP/AMP throughput ratio measured in training.

    Args:
        trialled: The search's ``trialled_plan`` summary (``compare_searches.trialled_plan_summary``).
        training: ``round_ratio`` of CoMP's training throughput over AMP's (``None`` where AMP did not run).

    Returns:
        ``forecast`` (AMP's plan's step over the trialled plan's, as the batch stage measured them), ``training``
        (median of per-round ratios) and ``gap_pct`` (``100 * (training / forecast - 1)``: negative where training
        falls short of the forecast); NaN where either is missing.
    """
    forecast = trialled.get("forecast_vs_amp", math.nan)
    forecast = float(forecast) if isinstance(forecast, (int, float)) else math.nan
    measured = float((training or {}).get("median", math.nan))
    gap = 100.0 * (measured / forecast - 1.0) if math.isfinite(forecast) and forecast > 0 else math.nan
    return {"forecast": forecast, "training": measured, "gap_pct": gap if math.isfinite(gap) else math.nan}


def ratios_by_mode(modes: dict[str, Any], fp32_loss: float, tolerance_mode: str) -> dict[str, Any]:
    """Each CoMP mode's ratios to AMP (``bf16-mixed``) and its convergence against FP32.

    Args:
        modes: The analysed modes (``converges_like_fp32`` already set).
        fp32_loss: FP32's final val_loss (NaN where FP32 did not run).
        tolerance_mode: ``relative`` (``val_loss_vs_fp32`` is a ratio) or absolute (a difference).

    Returns:
        By CoMP mode that ran: ``throughput_vs_bf16-mixed`` (median of per-round ratios, with min/max),
        ``memory_step_peak_vs_bf16-mixed``, ``saved_bytes_vs_bf16-mixed`` (each where AMP ran), ``val_loss_vs_fp32``
        and ``converges_like_fp32``.
    """
    amp = modes.get("bf16-mixed", {})
    out: dict[str, Any] = {}
    for mode in COMP_MODES:
        entry = modes.get(mode, {})
        if "throughput" not in entry:
            continue
        val = entry["final_validation"].get("val_loss", math.nan)
        amp_loss = (amp.get("final_validation") or {}).get("val_loss", math.nan)
        r: dict[str, Any] = {
            "val_loss_vs_fp32": _versus(val, fp32_loss, tolerance_mode),
            "converges_like_fp32": bool(entry.get("converges_like_fp32")) if math.isfinite(fp32_loss) else None,
            # FP32 is noisy where AMP's own val_loss is past the tolerance of FP32's: then AMP's is the reference too
            "fp32_noisy": (not amp.get("converges_like_fp32")) if "converges_like_fp32" in amp else None,
            "val_loss_vs_amp": _versus(val, amp_loss, tolerance_mode),
        }
        if "throughput" in amp:
            r["throughput_vs_bf16-mixed"] = round_ratio(entry["throughput"], amp["throughput"])
            step_amp = _step_peak(amp)
            r["memory_step_peak_vs_bf16-mixed"] = _step_peak(entry) / step_amp if step_amp else math.nan
            for kind in ("live_bytes", "os_bytes"):
                r[f"process_{kind.removesuffix('_bytes')}_peak_vs_bf16-mixed"] = (
                    _process_peak(entry, kind) / _process_peak(amp, kind))
            so, sc = amp["saved_for_backward"] or {}, entry["saved_for_backward"] or {}
            r["saved_bytes_vs_bf16-mixed"] = (sc.get("activation_bytes", math.nan) / so["activation_bytes"]
                                              if so.get("activation_bytes") else math.nan)
        out[mode] = r
    return out


def _axis_targets(key: str, model: dict[str, Any], tolerance: float, tolerance_mode: str,
                  add: Callable[..., None]) -> None:
    """The memory axis's targets of one model (``AXIS_TARGETS``), for each of those CoMP modes that ran."""
    for mode, target in AXIS_TARGETS.items():
        r = model.get("ratios_by_mode", {}).get(mode)
        if not r:
            continue
        label = MODES[mode].label
        if "memory_step_peak_vs_bf16-mixed" in r:
            add(f"peak tensor memory of a training step {label}/AMP", r["memory_step_peak_vs_bf16-mixed"],
                target["memory_vs_amp"], "<=", key,
                note=f"saved for backward {label}/AMP {r['saved_bytes_vs_bf16-mixed']:.2f}")
            live = r.get("process_live_peak_vs_bf16-mixed", math.nan)
            if math.isfinite(live):
                add(f"process live peak of a training step {label}/AMP", live, target["memory_vs_amp"], "<=", key,
                    note=f"whole heap in use, model and data included; RSS {label}/AMP"
                         f" {r.get('process_os_peak_vs_bf16-mixed', math.nan):.2f}")
            add(f"throughput {label}/AMP", r["throughput_vs_bf16-mixed"]["median"], target["throughput_vs_amp"],
                ">=", key)
        if target["val_within_tolerance"] and r["converges_like_fp32"] is not None:
            relative = tolerance_mode == "relative"
            limit = 1 + tolerance if relative else tolerance
            versus_amp = r.get("val_loss_vs_amp", math.nan)
            if not r["converges_like_fp32"] and r.get("fp32_noisy") and math.isfinite(versus_amp):
                # the target: within the tolerance of FP32 or, where FP32 itself is noisy, of AMP
                add(f"val_loss {label}/AMP" if relative else f"val_loss {label} - AMP", versus_amp, limit, "<=", key,
                    note=f"within the search's tolerance of AMP: FP32 itself is noisy here (AMP is past its tolerance"
                         f" of FP32; {label}/FP32 {_number_text(r['val_loss_vs_fp32'])})")
            else:
                add(f"val_loss {label}/FP32" if relative else f"val_loss {label} - FP32", r["val_loss_vs_fp32"],
                    limit, "<=", key, note="within the search's tolerance of FP32")



def _versus(val: float, reference: float, tolerance_mode: str) -> float:
    """``val`` against ``reference``: their ratio (``relative``) or difference (NaN where either is missing)."""
    if tolerance_mode == "relative":
        return val / reference if reference and math.isfinite(reference) else math.nan
    return val - reference


def _number_text(value: Any, spec: str = ".3f") -> str:
    """``value`` formatted, or ``n/a`` where it is missing or not finite."""
    return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"


def _batch_stage_targets(key: str, model: dict[str, Any], add: Callable[..., None],
                         checks: list[dict[str, Any]]) -> None:
    """The targets on what the batch stage measured: the trialled plan against the fastest plan it measured, and its
    forecast of CoMP/AMP against training's (``n/a`` where the search record or AMP's run lacks them)."""
    r = model.get("ratios", {})
    trialled = (model.get("search") or {}).get("trialled_plan") or {}
    if "trialled_vs_fastest_measured" in r:
        origin = str(trialled.get("from")) + (" refined" if trialled.get("refined") else "")
        add("trialled plan/fastest measured plan (batch stage)", r["trialled_vs_fastest_measured"],
            TARGET_TRIALLED_VS_FASTEST, ">=", key,
            note=f"trialled ({origin}) {_number_text(trialled.get('step_ms'), '.1f')} ms, fastest measured"
            f" ({trialled.get('fastest_measured')}) {_number_text(trialled.get('fastest_ms'), '.1f')} ms"
            if trialled.get("recorded") else "the search record has no trialled_plan: not applicable")
        if not math.isfinite(checks[-1]["value"]):
            checks[-1]["met"] = None
    forecast = r.get("forecast_vs_training_amp")
    if forecast is not None:
        add("|gap| training vs forecast CoMP/AMP (%)", abs(forecast["gap_pct"]),
            TARGET_FORECAST_GAP_PCT, "<=", key,
            note=f"forecast {_number_text(forecast['forecast'])}, training {_number_text(forecast['training'])},"
            f" gap {_number_text(forecast['gap_pct'], '+.1f')}" + (" %" if math.isfinite(forecast["gap_pct"]) else ""))
        if not math.isfinite(checks[-1]["value"]):
            checks[-1]["met"] = None


def evaluate_targets(models: dict[str, Any], tolerance: float, tolerance_mode: str = "relative",
                     compiled: bool = False) -> dict[str, Any]:
    """Check every target of the issue against the analysed models.

    Args:
        models: The analysed models by key.
        tolerance: The search's val_loss tolerance.
        tolerance_mode: ``relative`` or absolute (for the memory axis's convergence target).
        compiled: Whether the run compiled every mode (the geomean target over AMP is the eager runs'; ``n/a``).

    Returns:
        ``checks`` (one per target and model; ``met`` is None where a target does not apply), ``geomean_vs_amp`` and
        ``geomean_vs_best_fixed`` (CoMP over the best fixed policy that converges, over the models that have one).
    """
    checks: list[dict[str, Any]] = []

    def add(name: str, value: float, target: float, op: str, model: str | None = None, note: str = "") -> None:
        ok = (value >= target if op == ">=" else value <= target) if math.isfinite(value) else False
        checks.append({"target": name, "model": model, "value": value, "op": op, "threshold": target,
                       "met": bool(ok), "note": note})

    vs_amp = []
    vs_best: list[float] = []
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
        if "throughput_vs_best_fixed" in r:
            best = r.get("best_fixed_policy") or {}
            left_out = ", ".join(MODES[x].label for x in best.get("not_converging", []) if x in MODES)
            vs_best.append(r["throughput_vs_best_fixed"]["median"])
            add("throughput CoMP/best fixed policy that converges", r["throughput_vs_best_fixed"]["median"],
                TARGET_VS_BEST_FIXED, ">=", key,
                note=f"best: {best.get('label')}" + (f"; not converging like FP32: {left_out}" if left_out else ""))
        _batch_stage_targets(key, m, add, checks)
        if key in MEMORY_TARGET_MODELS and "memory_step_peak_vs_bf16-mixed" in r:
            add("peak tensor memory of a training step CoMP/AMP", r["memory_step_peak_vs_bf16-mixed"],
                TARGET_MEMORY_VS_AMP, "<=", key,
                note=f"process RSS increment ratio {r['memory_increment_vs_bf16-mixed']:.2f}")
        if key in AXIS_TARGET_MODELS:
            _axis_targets(key, m, tolerance, tolerance_mode, add)
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
        add("throughput CoMP/AMP geomean over the suite", geomean(vs_amp), TARGET_GEOMEAN_VS_AMP, ">=",
            note="the target is the eager runs': not applicable compiled" if compiled else "eager")
        if compiled:
            checks[-1]["met"] = None
    return {"checks": checks, "geomean_vs_amp": geomean(vs_amp) if vs_amp else math.nan,
            "geomean_vs_best_fixed": geomean(vs_best)}


def analyse_raw(spec: ModelSpec, raw: dict[str, Any], tolerance: float, tolerance_mode: str) -> dict[str, Any]:
    """``analyse_model`` on one model's raw record, plus its round orders, duration, title and load average."""
    searches = {mode: s for mode, s in mode_searches(raw).items() if mode != "comp"}
    analysed = analyse_model(spec, raw["search"], raw["runs"], tolerance, tolerance_mode, searches)
    analysed.update(round_orders=raw["orders"], seconds=raw["seconds"], title=spec.title,
                    load_average_after=raw["load_average_after"])
    return analysed


def reanalyse(path: Path) -> dict[str, Any]:
    """Rebuild the report from a ``compare_raw.json.gz`` (or an older plain ``compare_raw.json``), after a change to
    the analysis, without re-measuring."""
    data = path.read_bytes()
    report = json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)
    report["models"] = {}
    for key, raw in report["raw"].items():
        spec = ModelSpec(**report["specs"][key])
        report["models"][key] = analyse_raw(spec, raw, report["tolerance"], report["tolerance_mode"])
    report["targets"] = evaluate_targets(report["models"], report["tolerance"], report["tolerance_mode"],
                                         bool(report.get("compile")))
    return report
