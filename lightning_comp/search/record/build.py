"""The decision record: what the search measured, tried and chose, and what it cost; written, logged, printed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.decisions.trial_plans import PARAMETER_SIDE
from lightning_comp.search.decisions.trials import blind_trials, metric_bound
from lightning_comp.search.record.batch import batch_record
from lightning_comp.search.record.figures import write_figures
from lightning_comp.search.record.forecast import forecast_check
from lightning_comp.search.record.loggers import log_record
from lightning_comp.search.record.spending import spending_record
from lightning_comp.search.record.text import format_record
from lightning_comp.search.state import STATE_VERSION, SearchState

__all__ = ["build_record", "publish", "warmup_overhead_seconds"]


def build_record(state: SearchState, config: SearchConfig) -> dict[str, Any]:
    """The decision record (JSON-able): settings, per-operator measurements and reasons, trials, cost."""
    trials = []
    rejected_seconds = 0.0
    for index, trial in enumerate(state.trials):
        plan = PrecisionPlan.from_dict(trial.plan)
        kept = index == state.kept_trial
        if not kept and trial.seconds is not None:
            rejected_seconds += float(trial.seconds)
        trials.append({
            "label": trial.label,
            "low_operators": [s for s, p in plan[Dimension.COMPUTE].entries if p is not ComputePrecision.FP32],
            "metric": trial.metric,
            "metrics": {epoch: trial.metrics[epoch] for epoch in sorted(trial.metrics, key=int)},  # per epoch
            "reference": state.trials[0].metric if state.trials else None,
            "verdict": None if trial.verdict is None else trial.verdict.value,
            "reason": trial.reason,
            "epochs": config.trial_epochs,
            "batches": trial.batches,  # None: whole epochs
            "seconds": trial.seconds,
            "median_step_ms": trial.median_step_ms,
            "skipped_steps": trial.skipped_steps,
            "kept": kept,
        })
    search_seconds = float(state.profiling_seconds) + rejected_seconds
    warmup_seconds = warmup_overhead_seconds(state)
    fit_seconds = float(state.fit_seconds)
    chosen = state.chosen
    reference = state.trials[0].metric if state.trials else None
    return {
        "version": STATE_VERSION,
        "monitor": config.monitor,
        "mode": config.mode.value,
        "tolerance": config.tolerance,
        "tolerance_mode": config.tolerance_mode.value,
        # the worst metric a trial may end with, once the reference trial has one
        "metric_bound": None if reference is None else metric_bound(config, float(reference)),
        # why a plan that learned nothing during its trial would have passed (None: it would not, or not known)
        "blind_trials": None if not state.trials else blind_trials(
            config, state.trials[0].metrics.get(str(state.trials[0].start_epoch - 1)), reference),
        "objective": config.objective.value,
        "low_precision": None if state.low_precision is None else state.low_precision.value,
        "search_start_epoch": state.search_start_epoch,
        "chosen_plan": chosen,
        "chosen_trial": state.chosen_label,
        "finish_reason": state.finish_reason,
        "lowered_operators": list(_lowered(chosen, Dimension.COMPUTE)),
        "lowered_operator_count": _lowered_count(chosen, state),
        **{f"{dimension.value}_lowered": _lowered(chosen, dimension) for dimension in PARAMETER_SIDE},
        "num_operators": state.num_operators,
        **batch_record(state.batch),
        "forecast_check": forecast_check(state.batch, state.trials),
        "memory_spending": spending_record(state.batch),
        "trials": trials,
        "extension_epochs": state.extension_epochs,
        "cost": {
            "profiling_seconds": float(state.profiling_seconds),
            # each snapshot's capture and each rewind's restore (each rank copies its own shards under FSDP)
            "snapshot_seconds": [round(float(s), 6) for s in state.snapshot_seconds],
            "rewind_seconds": [round(float(s), 6) for s in state.rewind_seconds],
            "rejected_trial_seconds": rejected_seconds,
            "search_seconds": search_seconds,
            "fit_seconds": fit_seconds or None,
            "share_of_fit": (search_seconds / fit_seconds) if fit_seconds else None,
            # The FP32 warm-up epochs ran slower than the chosen plan would have; users pay that too.
            "warmup_batches": int(state.warmup_batches or 0),
            "warmup_overhead_seconds": warmup_seconds,
            "total_seconds": search_seconds + (warmup_seconds or 0.0),
            "total_share_of_fit": ((search_seconds + (warmup_seconds or 0.0)) / fit_seconds)
            if fit_seconds else None,
        },
    }


def _lowered_count(chosen: dict[str, Any] | None, state: SearchState) -> int:
    """How many operators the chosen plan computes in low precision (a group's glob counts its members)."""
    if chosen is None:
        return 0
    plan = PrecisionPlan.from_dict(chosen)
    names = list(state.batch.decisions) if state.batch is not None else []
    if not names:
        return len(_lowered(chosen, Dimension.COMPUTE))
    return sum(plan.of(Dimension.COMPUTE, name) is not ComputePrecision.FP32 for name in names)


def _lowered(chosen: dict[str, Any] | None, dimension: Dimension) -> dict[str, str]:
    """The chosen plan's entries of ``dimension`` that change it from FP32."""
    if chosen is None:
        return {}
    plan = PrecisionPlan.from_dict(chosen)
    return {selector: value.value for selector, value in plan[dimension].entries if value is not dimension.fp32}


def warmup_overhead_seconds(state: SearchState) -> float | None:
    """Estimated time the FP32 warm-up batches lost against the chosen plan (``None`` until one is chosen).

    Warm-up batches x (median FP32 reference batch time - median batch time of the kept trial), both measured
    in real training; zero when the plan stays FP32.
    """
    if state.chosen is None:
        return None
    batches = int(state.warmup_batches or 0)
    trials = state.trials
    if not batches or not trials or PrecisionPlan.from_dict(state.chosen).is_all_fp32:
        return 0.0
    same = [t for t in trials[1:] if t.label == state.chosen_label]
    reference = trials[0].median_step_ms
    chosen = same[-1].median_step_ms if same else None
    if reference is None or chosen is None:
        return None
    return batches * max(0.0, float(reference) - float(chosen)) / 1e3


def publish(trainer: pl.Trainer, state: SearchState, config: SearchConfig, final: bool) -> None:
    """Write ``search_record.json``, ``plan.json`` and the figures (rank 0); unless ``final``, send the record and
    the figures to the loggers (:mod:`~lightning_comp.search.record.loggers`,
    :mod:`~lightning_comp.search.record.figures`) and print it."""
    record = build_record(state, config)
    # Trainer.log_dir is a collective (it broadcasts from rank 0): every rank must ask for it.
    directory = Path(config.record_dir or trainer.log_dir or trainer.default_root_dir)
    if trainer.is_global_zero:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "search_record.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        if record["chosen_plan"] is not None:
            PrecisionPlan.from_dict(record["chosen_plan"]).save(directory / "plan.json")
        drawn = write_figures(record, directory, loggers=() if final else trainer.loggers, step=trainer.global_step,
                              final=final)
        if drawn and config.verbose and not final:
            rank_zero_info(f"CoMPSearch figures in {directory}: " + ", ".join(
                f"{name} ({ms:.0f} ms)" for name, ms in drawn.items()))
    if final:
        return
    log_record(trainer, record)
    if config.verbose:
        rank_zero_info(format_record(record))
