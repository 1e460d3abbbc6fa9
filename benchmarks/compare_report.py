"""The outputs of ``benchmarks/compare.py``: Markdown, CSV and JSON files and console lines.

The Markdown report has the table per model and mode, the throughput search's cost (``## CoMP search``), CoMP against
the fixed policies and the batch stage's own evidence (``## CoMP vs fixed policies and the batch stage's forecast``:
the best fixed policy that converges, the trialled plan against the fastest plan measured, the forecast against AMP
next to training's), the memory axis (``## Memory axis``: every mode's step peak and saved-for-backward bytes against
AMP, and the saved lowerings each CoMP search chose), where each mode's training step spends its time
(``## Where a training step's time goes``: forward, backward, the update), every CoMP search's cost by objective and
the targets.
"""

from __future__ import annotations

import json
import math
import platform
from collections import Counter
from pathlib import Path
from typing import Any

from compare_analysis import _process_peak, _step_peak, round_ratio
from compare_suite import AXIS_MODES, COMP_MODES, FIXED_PLAN_MODES, MODES
from harness import json_default


def short_lines(key: str, m: dict[str, Any]) -> str:
    """One console line per mode of an analysed model: throughput, memory, final val_loss."""
    lines = []
    for mode, e in m["modes"].items():
        if "error" in e:
            lines.append(f"    {mode:<11} ERROR")
            continue
        t, mem, val = e["throughput"], e["memory"], e["final_validation"]
        lines.append(f"    {mode:<11} {t['samples_per_s']:9.1f} samples/s [{t['min']:.1f}-{t['max']:.1f}]"
                     f"  step peak {_step_peak(e) / 2**20:7.1f} MiB  RSS +{mem['increment_bytes'] / 2**20:7.1f} MiB"
                     f"  val_loss {val.get('val_loss', math.nan):.4f}")
    return "\n".join(lines)


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: run details, the table per model and mode, the search table, the targets."""
    m = report["machine"]
    lines = [
        f"# CoMP vs FP32 / AMP / BF16: results of `{report['command']}`",
        "",
        f"- date: {report['date']}; total {report['total_seconds']:.0f} s",
        f"- machine: {m.get('lscpu Model name', platform.processor())}, {m.get('lscpu CPU(s)', m['cpu_count'])} CPUs,"
        f" torch {m['torch']} ({m['torch_threads']} threads), lightning {m['lightning']}, device {report['device']}"
        + (f" ({m.get('cuda_device')})" if report["device"] == "cuda" else ""),
        f"- load average (1/5/15 min) at start {report['load_average_start']}, at end {report['load_average_end']}",
        f"- search settings (from `lightning_comp/conf/precision/comp.yaml`): tolerance {report['tolerance']}"
        f" ({report['tolerance_mode']}) on val_loss",
    ]
    if report.get("compile"):
        lines.append("- every mode and search ran with the model's `forward` compiled by `torch.compile` (Inductor);"
                     " graph breaks per run in `## torch.compile`")
    for mode, why in report["skipped_modes"].items():
        lines.append(f"- `{mode}` {why}")
    for key, model in report["models"].items():
        for mode, why in model.get("skipped_modes", {}).items():
            lines.append(f"- {key} `{mode}` {why}")
    lines += ["", "| model | mode | samples/s (median) | spread (min-max over rounds) | vs FP32 | vs AMP |"
              " step peak tensor mem (MiB) | saved for bwd (MiB) | process RSS: peak / +over baseline (MiB) |"
              " val_loss | val metric | steps |", "|" + "---|" * 12]
    for key, model in report["models"].items():
        modes = model["modes"]
        fp32 = modes.get("fp32", {}).get("throughput")
        amp = modes.get("bf16-mixed", {}).get("throughput")
        for mode, e in modes.items():
            if "error" in e:
                lines.append(f"| {key} | {MODES[mode].label} | error | | | | | | | | | |")
                continue
            t = e["throughput"]
            vs32 = round_ratio(t, fp32)["median"] if fp32 else math.nan
            vsamp = round_ratio(t, amp)["median"] if amp else math.nan
            saved = e["saved_for_backward"] or {}
            val = e["final_validation"]
            metric = model["metric"]
            lines.append(
                f"| {key} | {MODES[mode].label} | {_fmt(t['samples_per_s'], '.1f')} |"
                f" {_fmt(t['min'], '.1f')}-{_fmt(t['max'], '.1f')} | {_fmt(vs32)} | {_fmt(vsamp)} |"
                f" {_fmt(_step_peak(e) / 2**20, '.1f')} |"
                f" {_fmt(saved.get('activation_bytes', math.nan) / 2**20, '.1f')} |"
                f" {_fmt(e['memory']['peak_bytes'] / 2**20, '.0f')} /"
                f" +{_fmt(e['memory']['increment_bytes'] / 2**20, '.0f')} |"
                f" {_fmt(val.get('val_loss'), '.4f')} | {metric} {_fmt(val.get(metric), '.4f')} | {e['steps']} |")
    if report.get("compile"):
        lines += compile_lines(report)
    lines += ["", "## CoMP search", "", "| model | chosen | lowered / operators | cost (s, measured) |"
              " cost at full epochs (s) | 20 epochs at the plan's step time (s) | share | measured 20-epoch fit |"
              " trials |", "|" + "---|" * 9]
    for key, model in report["models"].items():
        s = model["search"]
        if "error" in s:
            lines.append(f"| {key} | {'not benchmarked' if s['error'] == 'CoMP not benchmarked' else 'search failed'}"
                         " | | | | | | | |")
            continue
        x = s["extrapolated"]
        trials = "; ".join(f"{t['label']}: {t['verdict']}" for t in s["trials"])
        lines.append(f"| {key}{' (default example)' if s['default_example'] else ''} | {s['chosen_trial']} |"
                     f" {len(s['lowered_operators'])} / {s['num_operators']} |"
                     f" {_fmt(s['measured']['search_seconds'], '.1f')}"
                     f" | {_fmt(x['search_seconds_full_epochs'], '.1f')} | {_fmt(x['run_20_epochs_seconds'], '.0f')} |"
                     f" {_fmt(100 * x['share_of_20_epoch_run'], '.1f')} % | {_real_cell(s.get('real_run'))} |"
                     f" {trials} |")
    lines += (fixed_policy_lines(report) + memory_axis_lines(report) + phase_lines(report)
              + search_objective_lines(report))
    lines += ["", "## Ratios and targets", "", "| target | model | value | threshold | met |", "|---|---|---|---|---|"]
    for c in report["targets"]["checks"]:
        met = "n/a" if c["met"] is None else "yes" if c["met"] else "**no**"
        note = f" ({c['note']})" if c["note"] else ""
        lines.append(f"| {c['target']}{note} | {c['model'] or 'suite'} | {_fmt(c['value'], '.3f')} |"
                     f" {c['op']} {c['threshold']} | {met} |")
    return "\n".join(lines) + "\n"


def _ratio_cell(ratio: dict[str, Any] | None) -> str:
    """A ``round_ratio``: its median with the min-max over rounds (``n/a`` where absent)."""
    if not ratio:
        return "n/a"
    return f"{_fmt(ratio.get('median'), '.3f')} [{_fmt(ratio.get('min'))}-{_fmt(ratio.get('max'))}]"


def _best_fixed_cell(best: dict[str, Any] | None) -> str:
    """The best fixed policy that converges, its samples/s and the policies left out for not converging."""
    if not best or best.get("mode") is None:
        return "n/a"
    left_out = [MODES[m].label for m in best.get("not_converging", []) if m in MODES]
    return (f"{best['label']} ({_fmt(best.get('samples_per_s'), '.1f')}/s)"
            + (f"; not converging like FP32: {', '.join(left_out)}" if left_out else ""))


def _trialled_cells(trialled: dict[str, Any] | None) -> list[str]:
    """The trialled plan's origin, its forecast step and the fastest measured plan's (``n/a`` in older records)."""
    t = trialled or {}
    if not t.get("recorded"):
        return ["n/a", "n/a", "n/a"]
    origin = f"{t.get('from') or 'n/a'}" + (" + refined" if t.get("refined") else "")
    fastest = f"{t.get('fastest_measured') or 'n/a'} {_fmt(t.get('fastest_ms'), '.1f')}"
    return [origin, _fmt(t.get("step_ms"), ".1f"), fastest]


def fixed_policy_lines(report: dict[str, Any]) -> list[str]:
    """The ``## CoMP vs fixed policies and the batch stage's forecast`` section, one row per model.

    Columns: the best fixed policy that converges like FP32 (FP32, AMP, bf16-true, the type rules) and CoMP's
    throughput over it and over each type rule; the batch stage's trialled plan (where it came from, its step), the
    fastest plan it measured and their ratio; the batch stage's forecast of CoMP/AMP, training's and the gap.
    """
    rules = [m for m in FIXED_PLAN_MODES if any(m in model["modes"] for model in report["models"].values())]
    lines = ["", "## CoMP vs fixed policies and the batch stage's forecast", "",
             "Best fixed policy = the fastest of FP32, AMP, bf16-true and the type rules among those whose final"
             " val_loss is within the search's tolerance of FP32's; CoMP / x = median of per-round throughput ratios"
             " [min-max]."
             " Trialled vs fastest = the fastest whole-step plan the batch stage measured over the plan it trialled"
             " (> 1: refinement beat every measured plan). Forecast CoMP/AMP = AMP's plan's step over the trialled"
             " plan's, both from the batch stage; gap = training / forecast - 1.", "",
             "| model | best fixed policy that converges | CoMP / best fixed |"
             + "".join(f" CoMP / {MODES[m].label} |" for m in rules)
             + " trialled plan | trialled step (ms) | fastest measured (ms) | trialled vs fastest |"
             " forecast CoMP/AMP | training CoMP/AMP | gap |",
             "|" + "---|" * (10 + len(rules))]
    for key, model in report["models"].items():
        r = model.get("ratios", {})
        forecast = r.get("forecast_vs_training_amp") or {}
        trialled = (model.get("search") or {}).get("trialled_plan")
        cells = [key, _best_fixed_cell(r.get("best_fixed_policy")), _ratio_cell(r.get("throughput_vs_best_fixed"))]
        cells += [_ratio_cell(r.get(f"throughput_vs_{m}")) for m in rules]
        cells += _trialled_cells(trialled)
        gap = _fmt(forecast.get("gap_pct"), "+.1f")
        cells += [_fmt(r.get("trialled_vs_fastest_measured"), ".3f"), _fmt(forecast.get("forecast"), ".3f"),
                  _fmt(forecast.get("training"), ".3f"), gap if gap == "n/a" else f"{gap} %"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def compile_lines(report: dict[str, Any]) -> list[str]:
    """The ``## torch.compile`` section: per model and run, graphs compiled and graph breaks with their reasons."""
    lines = ["", "## torch.compile", "", "| model | run | graphs compiled | graph breaks | break reasons |",
             "|---|---|---|---|---|"]
    for key, raw in report.get("raw", {}).items():
        runs = [(MODES[mode].label, run) for mode, run in raw.get("runs", {}).items()]
        runs.append(("CoMPSearch run", raw.get("search") or {}))
        for label, run in runs:
            stats = run.get("dynamo")
            if not stats:
                continue
            reasons = "; ".join(f"{reason} (x{n})" for reason, n in stats["break_reasons"].items()) or "none"
            lines.append(f"| {key} | {label} | {stats['unique_graphs']} | {stats['graph_breaks']} | {reasons} |")
    return lines


def search_of(model: dict[str, Any], mode: str) -> dict[str, Any] | None:
    """The summary of ``mode``'s search in an analysed model (``None`` where that mode was not searched)."""
    return model.get("search") if mode == "comp" else model.get("searches", {}).get(mode)


def saved_lowerings_cell(model: dict[str, Any], mode: str) -> str:
    """The saved-for-backward lowerings ``mode``'s search chose: their count and precisions (``-``: not CoMP)."""
    s = search_of(model, mode) if mode in COMP_MODES else None
    if s is None:
        return "-"
    if "error" in s:
        return "search failed"
    saved = s.get("saved_lowered") or {}
    counts = Counter(saved.values())
    return f"{len(saved)}" + (f" ({', '.join(f'{p} x{n}' for p, n in sorted(counts.items()))})" if saved else "")


def memory_axis_lines(report: dict[str, Any]) -> list[str]:
    """The ``## Memory axis`` section: per model and mode, step peak tensor memory, saved-for-backward bytes and
    throughput against AMP, the validation metric and the saved lowerings each CoMP search chose."""
    lines = ["", "## Memory axis", "",
             "Step peak tensor memory = weights, gradients, optimizer state and saved activations of one training step;"
             " process peak = the heap in use at the step's high point (glibc mallinfo2, sampled per operator; the"
             " whole process: model, data, libraries) and the largest RSS sampled (on CUDA: the allocator's reserved"
             " peak); x AMP = ratio to AMP (bf16-mixed); throughput x AMP = median of per-round ratios.", "",
             "| model | mode | step peak (MiB) | x AMP | process live peak (MiB) | x AMP | RSS (MiB) | x AMP |"
             " saved for bwd (MiB) | x AMP | throughput x AMP | val metric |"
             " val_loss within tolerance of FP32 | saved lowerings chosen |", "|" + "---|" * 14]
    for key, model in report["models"].items():
        modes = model["modes"]
        amp = modes.get("bf16-mixed", {})
        amp_ok = "throughput" in amp
        amp_step = _step_peak(amp) if amp_ok else math.nan
        amp_live = _process_peak(amp) if amp_ok else math.nan
        amp_os = _process_peak(amp, "os_bytes") if amp_ok else math.nan
        amp_saved = ((amp.get("saved_for_backward") or {}).get("activation_bytes") or math.nan) if amp_ok else math.nan
        for mode, e in modes.items():
            if "error" in e:
                chosen = saved_lowerings_cell(model, mode)
                lines.append(f"| {key} | {MODES[mode].label} | error | | | | | | | | | | | {chosen} |")
                continue
            step, live, os_peak = _step_peak(e), _process_peak(e), _process_peak(e, "os_bytes")
            saved = (e["saved_for_backward"] or {}).get("activation_bytes", math.nan)
            thr = round_ratio(e["throughput"], amp["throughput"])["median"] if amp_ok else math.nan
            metric = model["metric"]
            converges = e.get("converges_like_fp32")
            lines.append(
                f"| {key} | {MODES[mode].label} | {_fmt(step / 2**20, '.2f')} | {_fmt(step / amp_step)} |"
                f" {_fmt(live / 2**20, '.1f')} | {_fmt(live / amp_live)} | {_fmt(os_peak / 2**20, '.1f')} |"
                f" {_fmt(os_peak / amp_os)} |"
                f" {_fmt(saved / 2**20, '.2f')} | {_fmt(saved / amp_saved)} | {_fmt(thr)} |"
                f" {metric} {_fmt(e['final_validation'].get(metric), '.4f')} |"
                f" {'n/a' if converges is None else 'yes' if converges else 'no'} |"
                f" {saved_lowerings_cell(model, mode)} |")
    return lines


def phase_lines(report: dict[str, Any]) -> list[str]:
    """The ``## Where a training step's time goes`` section: per model and mode, the median steady batch split at
    ``on_before_backward`` and ``on_after_backward``, and each phase's difference from FP32's."""
    lines = ["", "## Where a training step's time goes", "",
             "Median over steady batches of each phase (ms): forward (from `on_train_batch_start`, the training step"
             " included), backward, and the rest (clipping, the optimizer's update, Lightning's bookkeeping up to"
             " `on_train_batch_end`); + FP32 = the phase's median less FP32's (machines shared with other jobs move"
             " all of them).", "",
             "| model | mode | forward | backward | update and rest | batch | + FP32: forward | backward |"
             " update and rest |", "|" + "---|" * 9]
    rows = 0
    for key, model in report["models"].items():
        modes = model["modes"]
        fp32 = (modes.get("fp32", {}).get("throughput") or {}).get("phases_ms") or {}
        for mode, e in modes.items():
            phases = (e.get("throughput") or {}).get("phases_ms") if "error" not in e else None
            if not phases:
                continue
            rows += 1
            deltas = [_fmt(phases[n] - fp32[n], "+.1f") if n in fp32 else "n/a"
                      for n in ("forward", "backward", "update")]
            lines.append(f"| {key} | {MODES[mode].label} | {_fmt(phases['forward'], '.1f')} |"
                         f" {_fmt(phases['backward'], '.1f')} | {_fmt(phases['update'], '.1f')} |"
                         f" {_fmt(e['throughput']['median_step_ms'], '.1f')} | {' | '.join(deltas)} |")
    return lines if rows else []


def search_objective_lines(report: dict[str, Any]) -> list[str]:
    """The ``## CoMP searches by objective`` section: per model and CoMP mode, what its search chose and cost."""
    lines = ["", "## CoMP searches by objective", "",
             "| model | mode | objective | chosen | lowered / operators | saved lowerings | cost (s, measured) |"
             " share of the search run's fit |", "|" + "---|" * 8]
    for key, model in report["models"].items():
        for mode in COMP_MODES:
            s = search_of(model, mode)
            if s is None or (mode == "comp" and s.get("error") == "CoMP not benchmarked"):
                continue
            label = MODES[mode].label
            if "error" in s:
                lines.append(f"| {key} | {label} | {MODES[mode].objective} | search failed | | | | |")
                continue
            share = s["measured"].get("share_of_this_fit")
            lines.append(f"| {key} | {label} | {s.get('objective') or MODES[mode].objective} | {s['chosen_trial']} |"
                         f" {len(s['lowered_operators'])} / {s['num_operators']} |"
                         f" {saved_lowerings_cell(model, mode)} | {_fmt(s['measured']['search_seconds'], '.1f')} |"
                         f" {_fmt(None if share is None else 100 * share, '.1f')} % |")
    return lines


def _real_cell(real: dict[str, Any] | None) -> str:
    if not real:
        return "-"
    return (f"{real['total_seconds']:.1f} s (search {real['search_seconds']:.1f} s + FP32 warm-up over the plan"
            f" {real.get('warmup_overhead_seconds') or 0.0:.1f} s) of {real['fit_seconds']:.0f} s"
            f" ({real['epochs_trained']} epochs) = {100 * real['total_share_of_fit']:.1f} %")


CSV_FIELDS = ("model", "mode", "samples_per_s", "samples_per_s_min", "samples_per_s_max", "pooled_samples_per_s",
              "median_step_ms", "vs_fp32", "vs_amp", "step_peak_tensor_mib", "rss_increment_mib", "rss_peak_mib",
              "rss_steady_increment_mib", "saved_activations_mib",
              "saved_parameters_mib", "val_loss", "val_metric_name", "val_metric", "steps", "converges_like_fp32",
              "cast_ms_profiled_step", "forward_hooks", "saved_lowerings",
              # per model, on the ``comp`` row only:
              "comp_vs_best_fixed", "best_fixed_mode", "trialled_from", "trialled_refined", "trialled_step_ms",
              "fastest_measured", "fastest_measured_ms", "trialled_vs_fastest_measured", "forecast_comp_vs_amp",
              "training_comp_vs_amp", "forecast_gap_pct")


def csv_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model and mode, keyed by ``CSV_FIELDS`` (a failed mode has only ``model`` and ``mode``)."""
    rows = []
    for key, model in report["models"].items():
        modes = model["modes"]
        fp32 = modes.get("fp32", {}).get("throughput")
        amp = modes.get("bf16-mixed", {}).get("throughput")
        for mode, e in modes.items():
            if "error" in e:
                rows.append({"model": key, "mode": mode})
                continue
            t, saved, val = e["throughput"], e["saved_for_backward"] or {}, e["final_validation"]
            rows.append({
                "model": key, "mode": mode, "samples_per_s": t["samples_per_s"], "samples_per_s_min": t["min"],
                "samples_per_s_max": t["max"], "pooled_samples_per_s": t["pooled_samples_per_s"],
                "median_step_ms": t["median_step_ms"],
                "vs_fp32": round_ratio(t, fp32)["median"] if fp32 else "",
                "vs_amp": round_ratio(t, amp)["median"] if amp else "",
                "step_peak_tensor_mib": _step_peak(e) / 2**20,
                "rss_increment_mib": e["memory"]["increment_bytes"] / 2**20,
                "rss_peak_mib": e["memory"]["peak_bytes"] / 2**20,
                "rss_steady_increment_mib": (e["memory"].get("steady_increment_bytes") or math.nan) / 2**20,
                "saved_activations_mib": saved.get("activation_bytes", 0) / 2**20,
                "saved_parameters_mib": saved.get("parameter_bytes", 0) / 2**20,
                "val_loss": val.get("val_loss"), "val_metric_name": model["metric"],
                "val_metric": val.get(model["metric"]),
                "steps": e["steps"], "converges_like_fp32": e.get("converges_like_fp32"),
                "cast_ms_profiled_step": (e.get("profile") or {}).get("cast_self_ms"),
                "forward_hooks": e.get("forward_hooks"),
                "saved_lowerings": len(e["plan_saved"]) if "plan_saved" in e else None,
                **(_comp_columns(model) if mode == "comp" else {}),
            })
    return rows


def _comp_columns(model: dict[str, Any]) -> dict[str, Any]:
    """The per-model CSV columns of the ``comp`` row: CoMP vs the best fixed policy, the trialled plan, the forecast."""
    r = model.get("ratios", {})
    trialled = (model.get("search") or {}).get("trialled_plan") or {}
    forecast = r.get("forecast_vs_training_amp") or {}
    return {
        "comp_vs_best_fixed": (r.get("throughput_vs_best_fixed") or {}).get("median"),
        "best_fixed_mode": (r.get("best_fixed_policy") or {}).get("mode"),
        "trialled_from": trialled.get("from"), "trialled_refined": trialled.get("refined"),
        "trialled_step_ms": trialled.get("step_ms"), "fastest_measured": trialled.get("fastest_measured"),
        "fastest_measured_ms": trialled.get("fastest_ms"),
        "trialled_vs_fastest_measured": r.get("trialled_vs_fastest_measured"),
        "forecast_comp_vs_amp": forecast.get("forecast"), "training_comp_vs_amp": forecast.get("training"),
        "forecast_gap_pct": forecast.get("gap_pct"),
    }


def write_outputs(report: dict[str, Any], out_dir: Path, img_dir: Path, prefix: str, plots: bool) -> list[Path]:
    """Write ``<prefix>_raw.json.gz`` (every batch time: over a MiB as plain JSON), ``<prefix>.json`` (without the raw
    record), ``.csv``, ``.md`` and the plots.

    Args:
        report: The report.
        out_dir: The folder of the JSON, CSV and Markdown files.
        img_dir: The folder of the PNG plots.
        prefix: The stem of every file name.
        plots: Whether to draw the plots.

    Returns:
        The paths written.
    """
    import csv
    import gzip

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    json_path = out_dir / f"{prefix}.json"
    raw_path = out_dir / f"{prefix}_raw.json.gz"
    raw_path.write_bytes(gzip.compress((json.dumps(report, default=json_default) + "\n").encode(), mtime=0))
    json_path.write_text(json.dumps({k: v for k, v in report.items() if k != "raw"}, indent=1,
                                    default=json_default) + "\n")
    paths.append(raw_path)
    csv_path = out_dir / f"{prefix}.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in csv_rows(report):
            writer.writerow({k: _csv_value(row.get(k)) for k in CSV_FIELDS})
    md_path = out_dir / f"{prefix}.md"
    md_path.write_text(markdown(report))
    paths += [json_path, csv_path, md_path]
    if plots:
        from compare_plots import plot_all

        img_dir.mkdir(parents=True, exist_ok=True)
        paths += plot_all(report, img_dir, prefix)
    return paths


# The colour and short label of each mode in the plots, where ``compare_plots`` does not name one (the type rules).


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return "" if not math.isfinite(value) else f"{value:.6g}"
    return "" if value is None else value


def print_ratios(report: dict[str, Any]) -> None:
    """Print CoMP's throughput and memory ratios per model and whether each target is met."""
    print("\nCoMP throughput ratios (median of per-round ratios; min-max over rounds):")
    for key, model in report["models"].items():
        r = model["ratios"]
        parts = []
        for other, label in (("bf16-mixed", "CoMP/AMP"), ("fp32", "CoMP/FP32"), ("bf16-true", "CoMP/bf16-true"),
                             ("16-mixed", "CoMP/16-mixed"), *((m, f"CoMP/{m}") for m in FIXED_PLAN_MODES),
                             ("best_fixed", "CoMP/best-fixed")):
            x = r.get(f"throughput_vs_{other}")
            if x:
                parts.append(f"{label} {x['median']:.3f} [{x['min']:.2f}-{x['max']:.2f}]")
        mem = r.get("memory_step_peak_vs_bf16-mixed")
        if mem is not None:
            parts.append(f"step-peak-mem CoMP/AMP {mem:.3f} (RSS increment {r['memory_increment_vs_bf16-mixed']:.3f})")
        print(f"  {key:<6} " + "  ".join(parts))
        forecast = r.get("forecast_vs_training_amp")
        if "trialled_vs_fastest_measured" in r or forecast:
            f = forecast or {}
            print(f"  {key:<6} best fixed policy that converges: {(r.get('best_fixed_policy') or {}).get('mode')}"
                  f"  trialled vs fastest measured {_fmt(r.get('trialled_vs_fastest_measured'), '.3f')}"
                  f"  CoMP/AMP forecast {_fmt(f.get('forecast'), '.3f')} vs training {_fmt(f.get('training'), '.3f')}"
                  f" (gap {_fmt(f.get('gap_pct'), '+.1f')} %)")
        for mode, x in model.get("ratios_by_mode", {}).items():
            if mode not in AXIS_MODES or "throughput_vs_bf16-mixed" not in x:
                continue
            t = x["throughput_vs_bf16-mixed"]
            within = {None: "n/a", True: "yes", False: "no"}[x["converges_like_fp32"]]
            print(f"  {key:<6} {MODES[mode].label}/AMP: throughput {t['median']:.3f} [{t['min']:.2f}-{t['max']:.2f}]"
                  f"  step-peak-mem {x['memory_step_peak_vs_bf16-mixed']:.3f}"
                  f"  saved-for-bwd {x['saved_bytes_vs_bf16-mixed']:.3f}  val_loss within tolerance of FP32: {within}")
    print(f"  geomean CoMP/AMP over the suite: {report['targets']['geomean_vs_amp']:.3f}; CoMP/best fixed policy:"
          f" {_fmt(report['targets'].get('geomean_vs_best_fixed'), '.3f')}")
    print("\nTargets:")
    for c in report["targets"]["checks"]:
        met = "n/a" if c["met"] is None else "met" if c["met"] else "MISSED"
        print(f"  [{met:>6}] {c['target']:<55} {c['model'] or 'suite':<6} {_fmt(c['value'], '.3f')}"
              f" {c['op']} {c['threshold']}  {c['note']}")
