"""The decision record in every attached Lightning logger, in the form that logger shows best.

- Any logger: the chosen plan as flat hyperparameters (``comp/plan/<selector>: precision``, ``comp/saved/<selector>:
  saved precision``, ``comp/state/<selector>`` and ``comp/master/<selector>`` where the plan sets them, the plan's
  summary as the plugin hooked it: ``comp/precision``, operator counts, device class and fingerprints of
  :mod:`lightning_comp.plugins.summary`, plus the searched precision, objective and counts), the search's summary
  scalars (operators lowered, trials, search seconds), and each trial's metric, median step time and verdict as
  scalars under their own names, over the trial number as the step (``comp/trials/metric``,
  ``comp/trials/median_step_ms``, ``comp/trials/passed``), apart from the user's own validation curves.
- TensorBoard: the plan and the per-operator decisions as Markdown tables (TEXT tab).
- CSV: two flat tables beside ``metrics.csv``: ``comp_operators.csv`` (one row per operator: decision, times, ratio
  and its interval, bytes, reason) and ``comp_trials.csv`` (one row per trial).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from lightning_comp.plugins.shell import PlanShell

__all__ = ["OPERATOR_COLUMNS", "TRIAL_COLUMNS", "log_record", "operator_rows", "plan_hyperparameters", "trial_metrics",
           "trial_rows"]

OPERATOR_COLUMNS = ("operator", "type", "kind", "decision", "fp32_ms", "low_ms", "ratio", "ratio_low", "ratio_high",
                    "rounds", "fp32_saved_bytes", "low_saved_bytes", "reason", "saved", "saved_reason", "state",
                    "master", "parameters_reason")
TRIAL_COLUMNS = ("trial", "label", "low_operators", "metric", "reference", "verdict", "reason", "median_step_ms",
                 "seconds", "skipped_steps", "kept")


def plan_hyperparameters(record: dict[str, Any]) -> dict[str, Any]:
    """Flat hyperparameters of the chosen plan: one ``comp/plan/<selector>`` per entry, and the search's setting."""
    chosen = record.get("chosen_plan") or {}
    params: dict[str, Any] = {f"comp/plan/{selector}": precision
                              for selector, precision in (chosen.get("entries") or {}).items()}
    for dimension in ("saved", "state", "master"):
        params.update({f"comp/{dimension}/{selector}": value
                       for selector, value in (chosen.get(dimension) or {}).items()})
    params.update({
        "comp/plan/<default>": chosen.get("default", "fp32"),
        "comp/low_precision": record.get("low_precision") or "none",
        "comp/objective": record.get("objective"),
        "comp/chosen_trial": record.get("chosen_trial") or "",
        "comp/lowered_operators": len(record.get("lowered_operators") or []),
        "comp/clock": (record.get("timing") or {}).get("clock", ""),
    })
    return params


def operator_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per operator of the batch stage (``OPERATOR_COLUMNS``)."""
    rows = []
    for name, op in (record.get("operators") or {}).items():
        spread = op.get("time_spread") or [None, None]
        rows.append({
            "operator": name, "type": op.get("type"), "kind": op.get("kind"), "decision": op.get("decision"),
            "fp32_ms": (op.get("fp32") or {}).get("total_ms"), "low_ms": (op.get("low") or {}).get("total_ms"),
            "ratio": op.get("time_ratio"), "ratio_low": spread[0], "ratio_high": spread[1],
            "rounds": op.get("rounds"), "fp32_saved_bytes": (op.get("fp32") or {}).get("saved_bytes"),
            "low_saved_bytes": (op.get("low") or {}).get("saved_bytes"), "reason": op.get("reason"),
            # the saved-for-backward dimension (objective memory/balanced; empty otherwise)
            "saved": (op.get("saved") or {}).get("decision"), "saved_reason": (op.get("saved") or {}).get("reason"),
            # the optimizer-state and master-weight dimensions (operators owning parameters, memory/balanced)
            "state": (op.get("parameters") or {}).get("state"), "master": (op.get("parameters") or {}).get("master"),
            "parameters_reason": (op.get("parameters") or {}).get("reason"),
        })
    return rows


def trial_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per convergence trial (``TRIAL_COLUMNS``)."""
    return [{"trial": index, "label": t["label"], "low_operators": len(t["low_operators"]), "metric": t["metric"],
             "reference": t["reference"], "verdict": t["verdict"], "reason": t["reason"],
             "median_step_ms": t["median_step_ms"], "seconds": t["seconds"], "skipped_steps": t["skipped_steps"],
             "kept": t["kept"]}
            for index, t in enumerate(record.get("trials") or [])]


def _markdown(columns: tuple[str, ...], rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _tensorboard(logger: TensorBoardLogger, record: dict[str, Any], step: int) -> None:
    writer = logger.experiment
    chosen = record.get("chosen_plan") or {}
    dimensions = {d: chosen.get(d) or {} for d in ("entries", "saved", "state", "master")}
    selectors = sorted(set().union(*dimensions.values()))
    plan_rows = [{"selector": s, "precision": dimensions["entries"].get(s, ""), "saved": dimensions["saved"].get(s, ""),
                  "state": dimensions["state"].get(s, ""), "master": dimensions["master"].get(s, "")}
                 for s in selectors]
    writer.add_text("comp/plan", f"chosen: **{record.get('chosen_trial')}** ({record.get('finish_reason')})\n\n"
                    + _markdown(("selector", "precision", "saved", "state", "master"), plan_rows), step)
    ops = operator_rows(record)
    if ops:
        writer.add_text("comp/operators", _markdown(("operator", "type", "decision", "ratio", "ratio_low",
                                                     "ratio_high", "reason"), ops), step)
    writer.flush()


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def trial_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A trial's scalars under their own names (``comp/trials/...``), logged at the trial's number as the step:
    the monitored metric it ended with, its median step time, and whether it passed (1) or not (0)."""
    metrics = {"comp/trials/passed": 1.0 if row["verdict"] == "pass" else 0.0}
    if row["metric"] is not None:
        metrics["comp/trials/metric"] = float(row["metric"])
    if row["median_step_ms"] is not None:
        metrics["comp/trials/median_step_ms"] = float(row["median_step_ms"])
    return metrics


def log_record(trainer: pl.Trainer, record: dict[str, Any]) -> None:
    """Send ``record`` to every logger of ``trainer`` (loggers write on rank 0 only)."""
    step = trainer.global_step
    plugin = trainer.precision_plugin
    plan = plugin.plan_hyperparameters() if isinstance(plugin, PlanShell) else {}  # the plan as hooked
    for logger in trainer.loggers:
        _log_common(logger, record, step, plan)
        for row in trial_rows(record):
            logger.log_metrics(trial_metrics(row), step=row["trial"])
        if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
            _tensorboard(logger, record, step)
        elif isinstance(logger, CSVLogger) and trainer.is_global_zero:
            directory = Path(logger.log_dir)
            _write_csv(directory / "comp_operators.csv", OPERATOR_COLUMNS, operator_rows(record))
            _write_csv(directory / "comp_trials.csv", TRIAL_COLUMNS, trial_rows(record))


def _log_common(logger: Logger, record: dict[str, Any], step: int, plan: dict[str, Any]) -> None:
    logger.log_metrics(
        {
            "comp/lowered_operators": float(len(record["lowered_operators"])),
            "comp/trials": float(len(record["trials"])),
            "comp/search_seconds": float(record["cost"]["search_seconds"]),
        },
        step=step,
    )
    logger.log_hyperparams({**plan, **plan_hyperparameters(record)})
