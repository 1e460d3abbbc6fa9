"""One measuring run of ``benchmarks/compare.py``: every model of the suite under every precision mode.

How each number is measured (per model):

1. **CoMP searches.** Per CoMP mode, a fresh process trains the model with ``CoMPPrecision()`` + ``CoMPSearch``,
   using the search settings of the shipped default example (``lightning_comp/conf/precision/comp.yaml``) with the
   mode's ``objective``: ``comp`` searches for throughput (the shipped setting), ``comp-balanced`` and ``comp-memory``
   for ``"balanced"`` and ``"memory"``, which also choose the precision each operator's saved-for-backward tensors are
   stored in. The default example's model (``gpt``) searches on full epochs; the others on epochs shortened to
   ``search_batches`` batches (validation shortened in the same proportion), and their cost is scaled to full epochs.
   The share of a 20-epoch run divides the search cost by 20 full epochs at the chosen plan's measured step time (a
   real 20-epoch run per model does not fit the time budget).
2. **Interleaved training.** One fresh process per mode (``32-true``, ``bf16-mixed``, ``bf16-true``, ``16-mixed`` on
   a CUDA device with fast FP16 (never on a CPU: ``fp16_amp_skipped``), the one-line type rule ``type-linear``
   (``CoMPPrecision(plan=PrecisionPlan.from_dict({"type:Linear": "bf16"}))``, no search; not in ``--compile``'s
   defaults), and per CoMP mode ``CoMPPrecision(plan=<its own search's chosen plan>)``), all from the same seed,
   initial weights and batches. A coordinator hands a baton to one
   process at a time, which trains ``segment`` optimizer steps and hands it back; the order rotates every round, so all
   modes see the same machine conditions while each keeps a process (and a memory peak) of its own. Round 0 is warm-up.
   Each batch is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, clipping, optimizer
   step; synchronised on CUDA). Throughput = batch size / median batch time of a round; summary = median over rounds
   (spread: min-max); ratios between modes are medians of per-round ratios.
3. **Memory.** The peak tensor memory of one steady training step: parameters, gradients and optimizer state at the
   step's start plus the peak of live tensors during the step from ``torch.profiler`` memory events (on CUDA,
   ``torch.cuda.max_memory_allocated``). Bytes saved for backward over one step come from
   ``torch.autograd.graph.saved_tensors_hooks`` (unique storages; parameters, saved by reference, counted apart).
   The process's peak RSS (Linux ``VmHWM``) and its rise over the pre-training RSS are recorded too: they include
   allocator retention and vary from run to run, so the target is judged on the tensor metric.
4. **Convergence.** All modes train the same number of optimizer steps and validate on the same batches every
   ``val_every`` steps; the final validation loss is compared with FP32 under the search's tolerance.

One step per mode (in the warm-up round) also runs under ``torch.profiler`` to attribute time to casts
(``aten::_to_copy``/``aten::copy_``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from compare_analysis import analyse_raw, evaluate_targets
from compare_report import short_lines
from compare_suite import (
    COMP_MODES,
    DEFAULT_MODELS,
    FIXED_PLAN_MODES,
    MODES,
    ROOT,
    SUITE,
    ModelSpec,
    smoke_spec,
    unavailable,
)
from compare_workers import _search_kwargs, mp_context, run_interleaved, run_search
from harness import load_average, machine_info


def modes_that_cannot_run(spec: ModelSpec, modes: list[str], device_type: str) -> dict[str, str]:
    """Lightning precisions that cannot run ``spec``'s model on this device, with why (CoMP always can).

    CPU autocast has no BF16 ``nn.LSTM`` kernel on CPUs without AVX512-BF16 (pytorch/pytorch#88136), so Lightning's
    ``bf16-mixed`` dies inside oneDNN there; what runs is decided by the package's own kernel probe.
    """
    if device_type != "cpu" or "bf16-mixed" not in modes:
        return {}
    import torch

    from lightning_comp import zoo
    from lightning_comp.devices.device_classes import device_class
    from lightning_comp.devices.lowering import Lowering, lowering_for
    from lightning_comp.numerics.precision import ComputePrecision

    with torch.device("meta"):
        model = getattr(zoo, spec.model)(**spec.model_kwargs)
    lstms = [m for m in model.modules() if isinstance(m, torch.nn.LSTM)]
    if lstms and lowering_for(lstms[0], ComputePrecision.BF16, "cpu") is not Lowering.AUTOCAST:
        return {"bf16-mixed": f"skipped: CPU autocast has no BF16 nn.LSTM kernel on this CPU"
                              f" ({device_class('cpu').describe()}); Lightning's bf16-mixed would fail inside oneDNN"}
    return {}


def fp16_amp_skipped(device_type: str) -> str | None:
    """Why ``16-mixed`` does not run on ``device_type`` (``None``: it runs, on CUDA with fast FP16).

    On a CPU it never runs, whatever its class: Lightning turns ``precision="16-mixed"`` into ``"bf16-mixed"`` there,
    so the mode would time AMP twice under two names. The reason names the device class: with AMX-FP16 FP16 is
    native, but not through Lightning's AMP.
    """
    from lightning_comp.devices.device_classes import device_class
    from lightning_comp.numerics.precision import ComputePrecision

    cls = device_class(device_type)
    lightning = "Lightning turns precision='16-mixed' into 'bf16-mixed' on CPU"
    if device_type == "cpu" and cls.is_native(ComputePrecision.FP16):
        return f"skipped: {lightning} (FP16 is native on this CPU, {cls.describe()}, but not through Lightning's AMP)"
    if device_type == "cpu":
        return (f"skipped: this CPU has no fast FP16 ({cls.describe()}): FP16 matmul runs at ~1x FP32, FP16 Conv2d"
                " backward uses oneDNN's reference kernel (~100x slower), nn.LSTM has no FP16 CPU kernel, and"
                f" {lightning}.")
    return None if cls.is_native(ComputePrecision.FP16) else f"skipped: no fast FP16 on this {device_type}"


def search_comp_modes(ctx: Any, spec: ModelSpec, comp_modes: list[str], args: argparse.Namespace,
                      out_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """One ``CoMPSearch`` per CoMP mode, each with the mode's objective, in a fresh process of its own.

    Args:
        ctx: The multiprocessing context (``mp_context()``).
        spec: The model.
        comp_modes: The CoMP modes to search for.
        args: The command-line options.
        out_dir: The results folder; ``comp`` records under ``compare_search_<model>``, the others under
            ``compare_search_<model>_<mode>``.

    Returns:
        Each mode's search result (or ``{"error": ...}``) and the chosen plan of each mode whose search chose one.
    """
    searches: dict[str, Any] = {}
    plans: dict[str, Any] = {}
    for mode in comp_modes:
        objective = MODES[mode].objective
        print(f"[compare] {spec.key}: {mode} search (objective {objective}) ...", flush=True)
        record_dir = out_dir / (f"compare_search_{spec.key}" if mode == "comp" else f"compare_search_{spec.key}_{mode}")
        search = searches[mode] = run_search(ctx, spec, args, record_dir, objective)
        if "error" in search:
            print(f"[compare] {spec.key}: {mode} search failed:\n{search['error']}", flush=True)
            continue
        if search.get("plan") is not None:
            plans[mode] = search["plan"]
        rec = search.get("record") or {}
        saved = rec.get("saved_lowered") or {}
        print(f"[compare] {spec.key}: {mode} search chose {rec.get('chosen_trial')!r}, lowered"
              f" {len(rec.get('lowered_operators', []))}/{rec.get('num_operators')} operators, saved-for-backward"
              f" lowerings {len(saved)}, cost {rec.get('cost', {}).get('search_seconds', math.nan):.1f} s",
              flush=True)
    return searches, plans


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Search and train every model of the selection under every mode that can run here, and analyse as it goes.

    Args:
        args: The command-line options.

    Returns:
        The report: machine, settings, specs, the raw record per model, the analysed models and the targets.
    """
    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    modes = ["fp32", "bf16-mixed", "bf16-true"]
    skipped: dict[str, str] = {}
    skip_fp16 = fp16_amp_skipped(device_type)
    if skip_fp16 is None:
        modes.append("16-mixed")
    else:
        skipped["16-mixed"] = skip_fp16
    modes += FIXED_PLAN_MODES  # the one-line type rules (eager runs' defaults)
    modes += COMP_MODES
    if getattr(args, "compile", False) and not args.modes:
        modes = ["fp32", "bf16-mixed", "comp"]  # compiled: the baselines and the shipped objective
    if args.modes:
        wanted = args.modes.split(",")
        unknown = sorted(set(wanted) - set(MODES))
        if unknown:
            raise SystemExit(f"--modes: unknown mode(s) {unknown}; choose from {list(MODES)}")
        modes = [m for m in modes if m in wanted]
    keys = DEFAULT_MODELS if args.models in (None, "default") else tuple(SUITE) if args.models == "all" \
        else tuple(args.models.split(","))
    missing = {k: unavailable(k) for k in keys if unavailable(k)}
    if missing and args.models not in (None, "default", "all"):
        raise SystemExit(f"--models: {'; '.join(f'{k}: {why}' for k, why in missing.items())}")
    for key, why in missing.items():
        print(f"[compare] {key} skipped: {why}", flush=True)
    keys = tuple(k for k in keys if k not in missing)
    specs = [smoke_spec(SUITE[k]) if args.smoke else SUITE[k] for k in keys]
    if args.steps_scale != 1.0:
        specs = [replace(s, steps=max(2 * s.segment, int(round(s.steps * args.steps_scale / s.segment)) * s.segment))
                 for s in specs]
    ctx = mp_context()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    search_kwargs = _search_kwargs({}, "")
    tolerance = float(search_kwargs.get("tolerance", 0.02))
    tolerance_mode = str(search_kwargs.get("tolerance_mode", "relative"))
    started = time.perf_counter()
    report: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "machine": machine_info(),
        "device": device_type,
        "load_average_start": load_average(),
        "smoke": bool(args.smoke),
        "compile": bool(getattr(args, "compile", False)),
        "modes": modes,
        "skipped_modes": skipped,
        "search_settings": {k: v for k, v in search_kwargs.items() if k not in ("record_dir", "verbose")},
        "search_objectives": {m: MODES[m].objective for m in modes if m in COMP_MODES},
        "fixed_plans": {m: MODES[m].fixed_plan for m in modes if m in FIXED_PLAN_MODES},
        "tolerance": tolerance, "tolerance_mode": tolerance_mode,
        "specs": {s.key: asdict(s) for s in specs},
        "models": {},
        "raw": {},
    }
    for spec in specs:
        t0 = time.perf_counter()
        searches, plans = search_comp_modes(ctx, spec, [m for m in modes if m in COMP_MODES], args, out_dir)
        run_modes = [m for m in modes if m not in COMP_MODES or plans.get(m) is not None]
        cannot_run = modes_that_cannot_run(spec, run_modes, device_type)
        for mode, why in cannot_run.items():
            print(f"[compare] {spec.key}/{mode} {why}", flush=True)
        run_modes = [m for m in run_modes if m not in cannot_run]
        print(f"[compare] {spec.key}: interleaved training of {', '.join(run_modes)} ...", flush=True)
        runs, orders = run_interleaved(ctx, spec, run_modes, plans, args)
        for mode, result in runs.items():
            if "error" in result:
                print(f"[compare] {spec.key}/{mode} failed:\n{result['error']}", flush=True)
        # "search": the throughput search (``comp``), as in older raw files; "searches": the other CoMP modes'.
        raw = {"search": searches.pop("comp", {"error": "CoMP not benchmarked"}), "searches": searches,
               "runs": runs, "orders": orders, "seconds": time.perf_counter() - t0,
               "load_average_after": load_average()}
        report["raw"][spec.key] = raw
        analysed = analyse_raw(spec, raw, tolerance, tolerance_mode)
        analysed["skipped_modes"] = cannot_run
        report["models"][spec.key] = analysed
        print(f"[compare] {spec.key}: done in {analysed['seconds']:.0f} s; load {analysed['load_average_after']}",
              flush=True)
        print(short_lines(spec.key, analysed), flush=True)
    report["targets"] = evaluate_targets(report["models"], tolerance, tolerance_mode, report["compile"])
    report["load_average_end"] = load_average()
    report["total_seconds"] = time.perf_counter() - started
    return report
