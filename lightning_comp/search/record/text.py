"""Readable tables of a search's decision record."""

from __future__ import annotations

from typing import Any

from lightning_comp.common.tables import format_table

__all__ = ["format_record"]


def _ms(value: Any) -> str:
    return "" if value is None else f"{float(value):.3f}"


def format_record(record: dict[str, Any]) -> str:
    """The decision record of a :class:`~lightning_comp.CoMPSearch` as text: trials, operators, cost."""
    low = record.get("low_precision") or "16 bits"
    operators_in = (f"{record.get('lowered_operator_count', len(record.get('lowered_operators', [])))} of"
                    f" {record.get('num_operators', 0)} operators in {low}" if low != "fp32" else
                    f"compute not searched (all {record.get('num_operators', 0)} operators in fp32)")
    out = [
        f"CoMPSearch: chose '{record.get('chosen_trial')}' ({record.get('finish_reason')}): {operators_in}"
        + (f" ({len(record['lowered_operators'])} plan entries: {', '.join(record['lowered_operators'])})"
           if record.get("lowered_operators") else "")
        + (f", {len(record['saved_lowered'])} save for backward in "
           f"{'/'.join(sorted(set(record['saved_lowered'].values())))}" if record.get("saved_lowered") else "")
        + (f", {len(record['state_lowered'])} keep optimizer state in "
           f"{'/'.join(sorted(set(record['state_lowered'].values())))}" if record.get("state_lowered") else "")
        + (f", {len(record['master_lowered'])} hold bf16 master weights" if record.get("master_lowered") else ""),
    ]
    if record.get("trials"):
        out += [
            "",
            "Convergence trials (monitor {m}, mode {mo}, tolerance {t} {tm}; {length}):".format(
                m=record["monitor"], mo=record["mode"], t=record["tolerance"], tm=record["tolerance_mode"],
                length=_trial_length(record)),
            format_table(
                ("trial", "low ops", "metric", "verdict", "why", "step ms", "seconds", "kept"),
                [
                    (t["label"], len(t["low_operators"]), "" if t["metric"] is None else f"{t['metric']:.6g}",
                     t["verdict"], t["reason"], _ms(t["median_step_ms"]), _ms(t["seconds"]),
                     "yes" if t["kept"] else "")
                    for t in record["trials"]
                ],
            ),
        ]
        if record.get("blind_trials"):
            out.append(f"The trials could not tell: {record['blind_trials']}.")
    else:
        out.append("No convergence trials: nothing was left to trial.")
    operators = record.get("operators") or {}
    if operators:
        timing = record.get("timing") or {}
        clock = f"; clock: {timing['reason']}" if timing.get("reason") else ""
        out += ["", f"Batch stage (fwd+bwd ms per step, {low}/fp32 ratio [75% interval] over paired rounds, bytes"
                    f" saved for backward; a group of operators playing the same part in repeated blocks is one row,"
                    f" its members' times summed{clock}):",
                format_table(("operator", "type", "fp32 ms", f"{low} ms", "ratio", "fp32 B", f"{low} B", "decision",
                              "why"), _operator_rows(operators))]
    out += _fp8_section(operators, record.get("fp8_stage") or {})
    out += _saved_section(operators)
    out += _parameter_section(operators, record.get("parameter_step") or {})
    out += _spending_section(record.get("memory_spending"))
    step_ms = record.get("step_ms") or {}
    if step_ms:
        ratios = record.get("step_ratios") or {}
        wall = record.get("step_wall_ms") or {}
        parts = []
        for k, v in step_ms.items():
            text = f"{k} {v:.3f}"
            if k in wall and abs(wall[k] - v) > 1e-9:
                text += f" (wall {wall[k]:.3f})"
            if k in ratios:
                r = ratios[k]
                text += f" x{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"
            parts.append(text)
        out.append("Whole step (min ms over rounds; ratio to fp32 [75% interval]): " + ", ".join(parts))
    out += _trialled_lines(record)
    step_saved = record.get("step_saved_bytes") or {}
    if step_saved:
        out.append("Whole step (MiB saved for backward): "
                   + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in step_saved.items()))
    peaks = record.get("step_process_peaks") or {}
    if peaks:
        out.append("Whole step (the process's peak, MiB: live heap / OS, or CUDA reserved / allocated): "
                   + ", ".join(f"{k} {_peak_text(v)}" for k, v in peaks.items()))
    memory = record.get("memory") or {}
    if memory:
        parts = []
        for label, m in memory.items():
            text = f"{label} {m.get('saved_bytes', 0) / 2**20:.2f} MiB saved for backward"
            if m.get("peak_bytes"):
                text += f", peak {m['peak_bytes'] / 2**20:.1f} MiB"
            if m.get("reserved_bytes"):
                text += f", reserved {m['reserved_bytes'] / 2**20:.1f} MiB"
            if m.get("live_bytes") is not None:
                text += f", live peak {m['live_bytes'] / 2**20:.1f} MiB"
            if m.get("os_bytes") is not None:
                text += f", OS peak {m['os_bytes'] / 2**20:.1f} MiB"
                if m.get("live_bytes") is not None:
                    text += f" (allocator adds {(m['os_bytes'] - m['live_bytes']) / 2**20:.1f} MiB)"
            parts.append(text)
        out.append("Memory per step: " + "; ".join(parts))
    cost = record.get("cost") or {}
    share = cost.get("share_of_fit")
    out.append(
        f"Search cost: {cost.get('search_seconds', 0.0):.2f} s (profiling {cost.get('profiling_seconds', 0.0):.2f} s,"
        f" rejected trials {cost.get('rejected_trial_seconds', 0.0):.2f} s)"
        + ("" if share is None else f", {share:.1%} of the fit")
        + ("" if not cost.get("warmup_overhead_seconds") else
           f"; with the FP32 warm-up's {cost['warmup_overhead_seconds']:.2f} s over the plan"
           f" {cost['total_seconds']:.2f} s" + ("" if cost.get("total_share_of_fit") is None
                                                 else f" ({cost['total_share_of_fit']:.1%})"))
        + f"; max_epochs extended by {record.get('extension_epochs', 0)}"
        + _snapshot_cost(cost)
    )
    return "\n".join(out)


def _operator_rows(operators: dict[str, Any]) -> list[tuple[Any, ...]]:
    """One row per operator, or per group of several (its pattern with the member count, sums of its members)."""
    rows: list[tuple[Any, ...]] = []
    done: set[str] = set()
    for name, op in operators.items():
        group = op.get("group")
        if group is None:
            fp32, lowm = op.get("fp32", {}), op.get("low", {})
            rows.append((name or "<root>", op["type"], _ms(fp32.get("total_ms")), _ms(lowm.get("total_ms")),
                         _ratio(op), fp32.get("saved_bytes", ""), lowm.get("saved_bytes", ""), op["decision"],
                         op["reason"]))
            continue
        if group in done:
            continue
        done.add(group)
        members = [m for m in operators.values() if m.get("group") == group]

        def total(which: str, key: str, members: list[dict[str, Any]] = members) -> float:
            return sum(float((m.get(which) or {}).get(key, 0.0)) for m in members)

        decisions = sorted({m["decision"] for m in members})
        decision = decisions[0] if len(decisions) == 1 else "/".join(
            f"{sum(m['decision'] == d for m in members)} {d}" for d in decisions)
        rows.append((f"{group} (x{len(members)})", op["type"], _ms(total("fp32", "total_ms")),
                     _ms(total("low", "total_ms")), _ratio(op), int(total("fp32", "saved_bytes")),
                     int(total("low", "saved_bytes")), decision, op["reason"]))
    return rows


def _trialled_lines(record: dict[str, Any]) -> list[str]:
    """The trialled plan's source and forecast, and each refinement flip with its evidence."""
    trialled = record.get("trialled_plan")
    if not trialled:
        return []
    out = [f"Trialled: the fastest measured plan, {trialled['from']}"
           + (" refined" if trialled.get("refined") else "")
           + f" (forecast {trialled['step_ms']:.3f} ms, x{trialled['ratio_to_fp32']:.2f} of fp32; fastest measured"
             f" {trialled['fastest_measured']} {trialled['fastest_ms']:.3f} ms)"]
    check = record.get("forecast_check")
    if check:
        line = (f"Forecast vs training: x{check['forecast_ratio']:.3f} of the fp32 reference's training step"
                f" forecast ({check['outside_ms']:.2f} ms of optimizer, loop and data taken from training), trained"
                f" x{check['training_ratio']:.3f} ('{check['trial']}'): {check['gap']:+.1%}")
        if check.get("autocast_forecast_speedup") is not None:
            line += f"; forecast x{check['autocast_forecast_speedup']:.3f} the speed of one global autocast region"
        if not check.get("comparable", True):
            line += f" (not comparable: {check.get('note')})"
        out.append(line)
    for flip in record.get("refinements") or []:
        r = flip["ratio"]
        count = len(flip["members"])
        what = flip["group"] + (f" (x{count})" if count > 1 else "")
        out.append(f"  refinement: {what} to {flip['to']}: expected -{flip['expected_gain_ms']:.3f} ms, step"
                   f" x{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}] of the plan without it over {r['rounds']}"
                   f" rounds: {'kept' if flip['kept'] else 'not kept'}")
    return out


def _snapshot_cost(cost: dict[str, Any]) -> str:
    """What the snapshots and rewinds cost, for the search-cost line (empty where none was taken)."""
    parts = []
    for key, what in (("snapshot_seconds", "snapshot"), ("rewind_seconds", "rewind")):
        seconds = cost.get(key) or []
        if seconds:
            parts.append(f"{len(seconds)} {what}(s), {1e3 * max(seconds):.1f} ms at most")
    return "; " + ", ".join(parts) if parts else ""


def _fp8_section(operators: dict[str, Any], stage: dict[str, Any]) -> list[str]:
    """The fp8 decisions (where fp8 was searched): one row per Linear or group judged, its fp8/16-bit time."""
    rows, seen = [], set()
    for name, op in operators.items():
        fp8 = op.get("fp8")
        if not fp8:
            continue
        group = tuple(fp8.get("group") or (name,))
        if group in seen:
            continue
        seen.add(group)
        ratio = fp8.get("time_ratio") or {}
        rows.append((name if len(group) == 1 else f"{name} (+{len(group) - 1} alike)", fp8["precision"],
                     f"{fp8['low_ms']:.3f}", f"{fp8['fp8_ms']:.3f}",
                     f"x{ratio['ratio']:.2f} [{ratio['low']:.2f}, {ratio['high']:.2f}]" if ratio else "",
                     "fp8" if fp8["lowers"] else "16-bit", fp8["reason"]))
    if not rows:
        return ["", f"fp8: not searched here ({stage['skipped']})."] if stage.get("skipped") else []
    return ["", "fp8 (each Linear the plan lowers, fwd+bwd ms in its 16-bit precision and in fp8 at the plan's casts):",
            format_table(("operator", "fp8", "16-bit ms", "fp8 ms", "ratio", "candidate", "why"), rows)]


def _saved_section(operators: dict[str, Any]) -> list[str]:
    """The saved-for-backward decisions (memory and balanced objectives), if the search made any."""
    rows = []
    for name, op in operators.items():
        saved = op.get("saved")
        if not saved:
            continue
        nbytes, times = saved.get("bytes", {}), saved.get("time_ratio", {})
        rows.append((name or "<root>", op["type"], *(nbytes.get(k, "") for k in ("fp32", "bf16", "fp8")),
                     *(f"x{times[k][0]:.2f}" if k in times else "" for k in ("bf16", "fp8")), saved["decision"],
                     saved["reason"]))
    if not rows:
        return []
    lines = ["", "Saved for backward (bytes each operator saves as computed / bf16 / fp8, its time ratio to saving as"
                 " computed):",
             format_table(("operator", "type", "as computed B", "bf16 B", "fp8 B", "bf16 time", "fp8 time", "saved",
                           "why"), rows)]
    return lines


def _parameter_section(operators: dict[str, Any], step: dict[str, Any]) -> list[str]:
    """The optimizer-state and master-weight decisions (memory and balanced objectives), if the search made any."""
    rows = []
    for name, op in operators.items():
        parameters = op.get("parameters")
        if not parameters:
            continue
        nbytes, times = parameters.get("bytes", {}), parameters.get("time_ratio", {})
        copies = "master+fp32 copies" in times  # an fp32 operator's master: timed with its FP32 copies' casts
        master = f"x{times['master+fp32 copies'][0]:.2f} (fp32 copies)" if copies else \
            (f"x{times['master'][0]:.2f}" if "master" in times else "")
        rows.append((name or "<root>", op["type"], f"{parameters.get('params', 0):,}",
                     *(nbytes.get(k, "") for k in ("fp32", "8bit", "bf16")),
                     *(f"x{times[k][0]:.2f}" if k in times else "" for k in ("8bit", "bf16")), master,
                     parameters["state"], parameters["master"], parameters["reason"]))
    if not rows and not step.get("skipped"):
        return []
    lines = [""]
    if step.get("skipped"):
        lines.append(f"Optimizer state and master weights: not searched ({step['skipped']}).")
    if rows:
        lines += ["Optimizer state and master weights (bytes of each operator's Adam state as today / 8bit / bf16;"
                  " its update time relative to the optimizer's own):",
                  format_table(("operator", "type", "params", "state B", "8bit B", "bf16 B", "8bit time", "bf16 time",
                                "master time", "state", "master", "why"), rows)]
    return lines


def _spending_section(spending: dict[str, Any] | None) -> list[str]:
    """The memory and balanced objectives' levers, cheapest bytes first: what was taken, in the order taken, and why
    it stopped."""
    if not spending:
        return []
    rows = [(point["lever"], point["value"], f"{point['step_mib']:.1f}", f"{point['step_ms']:.2f}",
             "forced" if point.get("forced") else
             ("free" if point["mib_per_ms"] is None else f"{point['mib_per_ms']:.3f}"),
             "given back" if point["lever"] in spending["given_back"] else
             ("past the bound" if point.get("past_bound") else ""))
            for point in spending["frontier"][1:]]
    bound = "no bound" if spending["max_ms"] is None else f"at most {spending['max_ms']:.2f} ms"
    if spending["max_ms"] is not None and spending.get("bound_of"):
        bound += f", the bound of {spending['bound_of']}"
    budget = "" if spending["target_mib"] is None else f", budget {spending['target_mib']:.1f} MiB"
    amp = "" if spending.get("final_vs_amp") is None else f" (x{spending['final_vs_amp']:.2f} AMP's step)"
    lines = ["", f"Memory levers, cheapest bytes first (step {spending['start_mib']:.1f} MiB,"
                 f" {spending['start_ms']:.2f} ms; {bound}{budget}):"]
    if rows:
        lines.append(format_table(("lever", "value", "step MiB", "step ms", "MiB per ms", ""), rows))
    measured = "" if spending["measured_ms"] is None else f", timed whole {spending['measured_ms']:.2f} ms"
    if spending["measured_ms"] is not None and spending.get("measured_fast_ms") is not None:
        measured += f" (at least {spending['measured_fast_ms']:.2f} ms by the rounds' fast end)"
    lines.append(f"Stopped: {spending['stopped']}. The plan's step: {spending.get('final_mib', 0):.1f} MiB{amp},"
                 f" forecast {spending['forecast_ms']:.2f} ms{measured}.")
    other = spending.get("other_base")
    if other:
        allowed = "" if other["max_ms"] is None else f" (at most {other['max_ms']:.2f} ms)"
        lines.append(f"The levers were also spent on {other['base']}: from {other['start_mib']:.1f} MiB to"
                     f" {other['final_mib']:.1f} MiB at {other['end_ms']:.2f} ms{allowed}"
                     f"{'' if other['met'] else ', the budget not met'}; this base's end is {other['why']}.")
    costs = spending.get("update_costs") or {}
    if costs:
        lines.append("State and master levers priced by the update's cost model over every operator: " + ", ".join(
            f"{variant} +{1000 * cost['per_tensor_ms']:.0f} us per tensor + {cost['per_million_elements_ms']:.3f} ms"
            f" per million elements ({cost['operators']} operators)" for variant, cost in costs.items()) + ".")
    codecs = spending.get("codec_costs") or {}
    if codecs:
        lines.append("Saved codecs not timed directly priced by their cost model over the operators measured so: "
                     + ", ".join(f"{codec} +{1000 * cost['per_operator_ms']:.0f} us per operator +"
                                 f" {cost['per_mib_ms']:.3f} ms per MiB saved as computed ({cost['operators']}"
                                 " operators)" for codec, cost in codecs.items())
                     + "; the others by their casts timed directly in the profiled steps.")
    peaks = spending.get("process_peaks") or {}
    if peaks:
        lines.append("The process's peak over one step (MiB: live heap / OS, or CUDA reserved / allocated): "
                     + ", ".join(f"{_PEAK_NAMES.get(k, k)} {_peak_text(v)}" for k, v in peaks.items()) + ".")
    if spending.get("process_met") is not None:
        retaken = spending.get("process_target_mib")
        again = "" if retaken is None else f"; the levers were taken down to {retaken:.1f} MiB of step bytes for it"
        verdict = "met" if spending["process_met"] else "not met"
        limit = spending.get("process_limit_mib")
        held = "" if limit is None else f" (held to {limit:.1f} MiB)"
        reference = spending.get("process_reference")
        how = ("the process's peak" if reference is None else "the step's tensor peak against "
               + ("AMP's plan's" if reference == "amp" else "the plan's before the levers"))
        lines.append(f"The budget, judged by {how}{held}: {verdict}{again}.")
    return lines


_PEAK_NAMES = {"start": "before the levers", "plan": "the plan", "amp": "AMP's plan"}


def _peak_text(peak: dict[str, Any]) -> str:
    """``482.1 / 863.0`` (live heap / OS peak; with what the allocator adds, and the step's tensor peak where
    measured), or CUDA's reserved / allocated."""
    if peak.get("reserved_mib") is not None:
        return f"{peak['reserved_mib']:.1f} / {peak.get('allocated_mib') or 0:.1f}"
    live, os_peak = peak.get("live_mib"), peak.get("os_mib")
    text = f"{'n/a' if live is None else f'{live:.1f}'} / {'n/a' if os_peak is None else f'{os_peak:.1f}'}"
    adds, tensors = peak.get("allocator_adds_mib"), peak.get("tensor_mib")
    notes = ([] if adds is None else [f"allocator adds {adds:.1f}"]) + (
        [] if tensors is None else [f"tensor peak {tensors:.1f}"])
    return f"{text} ({', '.join(notes)})" if notes else text


def _ratio(op: dict[str, Any]) -> str:
    """``x0.52 [0.49, 0.55]`` from a decision's ratio and spread (empty when not measured)."""
    if "time_ratio" not in op:
        return ""
    low, high = op.get("time_spread") or (op["time_ratio"], op["time_ratio"])
    return f"x{op['time_ratio']:.2f} [{low:.2f}, {high:.2f}]"


def _trial_length(record: dict[str, Any]) -> str:
    """How long each trial trained, e.g. ``11 batches each`` or ``1 epoch each``."""
    batches = {t.get("batches") for t in record.get("trials", [])} - {None}
    if batches:
        return f"{', '.join(str(b) for b in sorted(batches))} batches each"
    epochs = {t.get("epochs") for t in record.get("trials", [])} or {1}
    count = next(iter(epochs)) or 1
    return f"{count} epoch{'s' if count != 1 else ''} each"
