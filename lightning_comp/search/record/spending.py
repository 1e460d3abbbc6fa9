"""The record's ``memory_spending``: the memory levers taken cheapest bytes first, and their frontier as a figure.

The frontier is the step's bytes against its time after each lever taken
(:mod:`lightning_comp.search.decisions.cheapest_bytes`). :func:`write_frontier_figure` draws it as
``memory_frontier.png`` beside ``plan.json`` where matplotlib is installed (``pip install lightning-comp[figures]``);
the record holds the same numbers either way.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lightning_comp.search.decisions.batch_result import BatchStageResult

__all__ = ["FRONTIER_FIGURE", "spending_record", "write_frontier_figure"]

FRONTIER_FIGURE = "memory_frontier.png"
LABELLED = 8  # levers named in the figure: those that freed most
MiB = 2**20


def spending_record(batch: BatchStageResult | None) -> dict[str, Any] | None:
    """The record form of the memory objective's spending (``None``: it did not run)."""
    spending = None if batch is None else batch.memory_spending
    if spending is None:
        return None
    selection = spending.selection
    return {
        "start_mib": _mib(spending.start_bytes),
        "start_ms": round(spending.start_ms, 4),
        "max_ms": _finite(spending.max_ms),
        "target_mib": None if spending.target_bytes is None else _mib(spending.target_bytes),
        "amp_step_mib": None if spending.amp_step_bytes is None else _mib(spending.amp_step_bytes),
        "taken": {label: {"value": option.value, "freed_mib": _mib(option.bytes_saved),
                          "extra_ms": round(option.extra_ms, 4)} for label, option in selection.chosen.items()},
        "skipped": dict(selection.skipped),
        "stopped": selection.stopped,
        "met": selection.met,
        "final_mib": _mib(spending.final_bytes),
        "final_vs_amp": (None if not spending.amp_step_bytes
                         else round(spending.final_bytes / spending.amp_step_bytes, 4)),
        "forecast_ms": round(spending.forecast_ms, 4),
        "measured_ms": None if spending.measured_ms is None else round(spending.measured_ms, 4),
        "given_back": list(spending.given_back),
        "frontier": [{"lever": p.lever or None, "value": p.value or None, "step_mib": _mib(p.step_bytes),
                      "step_ms": round(p.step_ms, 4), "mib_per_ms": _finite(p.bytes_per_ms / MiB),
                      "forced": math.isnan(p.bytes_per_ms), "past_bound": p.past_bound}
                     for p in selection.frontier],
    }


def write_frontier_figure(record: dict[str, Any], directory: Path) -> Path | None:
    """Draw the record's frontier into ``directory / FRONTIER_FIGURE``; ``None`` where there is nothing to draw or
    matplotlib is not installed (the record keeps the numbers)."""
    spending = record.get("memory_spending")
    if not spending or len(spending["frontier"]) < 2:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    frontier = spending["frontier"]
    given_back = set(spending["given_back"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ms = [p["step_ms"] for p in frontier]
    mib = [p["step_mib"] for p in frontier]
    ax.plot(ms, mib, "-", color="0.6", zorder=1)
    colours = ["tab:grey"] + ["tab:red" if p["lever"] in given_back else "tab:orange" if p["past_bound"]
                              else "tab:blue" for p in frontier[1:]]
    ax.scatter(ms, mib, c=colours, zorder=2)
    for colour, what in (("tab:red", "given back (timed whole: slower than forecast)"),
                         ("tab:orange", "past the time allowed, for the budget")):
        if colour in colours:
            ax.scatter([], [], c=colour, label=what)
    # the levers that freed most are named (at most LABELLED); the others are points on the line
    freed = [(previous["step_mib"] - point["step_mib"], index)
             for index, (previous, point) in enumerate(zip(frontier, frontier[1:]), start=1)]
    named = {index for _, index in sorted(freed, reverse=True)[:LABELLED]}
    for index in sorted(named):
        point = frontier[index]
        ax.annotate(f"{point['lever'].split(' (')[0]}={point['value']}", (point["step_ms"], point["step_mib"]),
                    fontsize=6, xytext=(4, 2), textcoords="offset points")
    if spending["max_ms"] is not None:
        ax.axvline(spending["max_ms"], color="tab:orange", linestyle="--", label="slowest step allowed")
    if spending["target_mib"] is not None:
        ax.axhline(spending["target_mib"], color="tab:green", linestyle="--", label="memory budget")
    if spending["amp_step_mib"] is not None:
        ax.axhline(spending["amp_step_mib"], color="tab:purple", linestyle=":", label="AMP's step")
    ax.set_xlabel("step time (ms): forward, backward, update")
    ax.set_ylabel("step bytes (MiB): weights, grads, state, saved")
    ax.set_title("Memory levers, cheapest bytes first")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = directory / FRONTIER_FIGURE
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _mib(nbytes: float) -> float:
    return round(nbytes / MiB, 3)


def _finite(value: float) -> float | None:
    """``value`` rounded, ``None`` where it is infinite or undefined (JSON has neither)."""
    return round(value, 4) if math.isfinite(value) else None
