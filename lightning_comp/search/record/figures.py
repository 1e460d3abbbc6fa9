"""The decision record drawn: the plan along the model, the trials against the FP32 reference, the memory frontier.

Three figures, each drawn from the record alone (:func:`~lightning_comp.search.record.build.build_record`), so a
record read back from ``search_record.json`` draws the same:

- :data:`PLAN_FIGURE`: the operators in model order, a bar of each one's measured gain per step (coloured by the
  precision the chosen plan computes it in), and below it one strip per dimension the plan sets (compute, saved,
  state, master), one cell per operator, coloured by its value;
- :data:`TRIALS_FIGURE`: each trial's monitored validation metric against the FP32 reference's and the worst a trial
  may end with (``tolerance``), coloured by verdict (per epoch where trials train several), and each trial's median
  step time against the reference's;
- :data:`FRONTIER_FIGURE`: the memory objective's levers taken cheapest bytes first (step bytes against step time).

:func:`write_figures` writes them as PNG beside ``plan.json`` and sends them to every logger that takes figures
(TensorBoard: as images, tags ``comp/plan``, ``comp/trials``, ``comp/memory_frontier``). They need matplotlib
(``pip install 'lightning-comp[figures]'``); without it nothing is drawn and the record and its text say the same.
Figures are drawn on matplotlib's Agg canvas through its object API: pyplot, its global backend and its figure
registry are left alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info

from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["FRONTIER_FIGURE", "PLAN_FIGURE", "TRIALS_FIGURE", "frontier_figure", "plan_figure", "trials_figure",
           "write_figures"]

PLAN_FIGURE = "precision_plan.png"
TRIALS_FIGURE = "trials.png"
FRONTIER_FIGURE = "memory_frontier.png"
NO_MATPLOTLIB = ("CoMPSearch: no figures of the search (matplotlib is not installed; pip install"
                 " 'lightning-comp[figures]' draws the plan and the trials as PNG); search_record.json holds the same"
                 " numbers.")
DPI = 110
MiB = 2**20
LABELLED = 8  # levers named in the frontier figure: those that freed most
# one colour per value of every dimension (the values are spelled alike across dimensions: bf16 is blue everywhere)
COLOURS = {"fp32": "0.82", "bf16": "tab:blue", "fp16": "tab:orange", "fp8": "tab:red", "fp8-rowwise": "tab:pink",
           "recompute": "tab:green", "8bit": "tab:purple"}
VERDICT_COLOURS = {"pass": "tab:green", "fail": "tab:red", None: "0.5"}
SHORT_LABEL = 34  # characters of a trial's label on the trials figure's axis


def plan_figure(record: dict[str, Any]) -> Figure | None:
    """The chosen plan along the model: each operator's measured gain in time (and, where a dimension of memory is
    in the plan, in bytes), and its value in each dimension the plan sets; ``None`` before a plan is chosen or where
    the batch stage measured no operator."""
    operators: dict[str, dict[str, Any]] = record.get("operators") or {}
    if record.get("chosen_plan") is None or not operators:
        return None
    plan = PrecisionPlan.from_dict(record["chosen_plan"])
    names = list(operators)
    values = {dimension: [plan.of(dimension, name).value for name in names] for dimension in Dimension}
    # compute always; another dimension where the plan sets it for some operator
    shown = [d for d in Dimension if d is Dimension.COMPUTE or any(v != "fp32" for v in values[d])]
    panels = 2 if len(shown) > 1 else 1
    figure = _figure(max(6.4, 0.16 * len(names) + 1.5), 1.4 + 2.2 * panels + 0.3 * len(shown))
    grid = figure.add_gridspec(panels + 1, 1, height_ratios=[3.0] * panels + [0.35 * len(shown)])
    strips: Axes = figure.add_subplot(grid[panels])
    axes: list[Axes] = [figure.add_subplot(grid[i], sharex=strips) for i in range(panels)]
    positions = list(range(len(names)))
    gains = [float(operators[name].get("gain_ms") or 0.0) for name in names]
    axes[0].bar(positions, gains, color=_colours(values[Dimension.COMPUTE]), edgecolor="0.3", linewidth=0.4)
    axes[0].set_ylabel("time gained in\nlow precision (ms/step)", fontsize=8)
    if panels == 2:  # bytes each dimension's low value frees, one thin bar per dimension shown, in strip order
        width = 0.8 / len(shown)
        for k, dimension in enumerate(shown):
            freed = [_bytes_gain(operators[name], dimension) / MiB for name in names]
            axes[1].bar([x - 0.4 + width * (k + 0.5) for x in positions], freed, width=width,
                        color=_colours(values[dimension]), edgecolor="0.3", linewidth=0.3)
        axes[1].set_ylabel("bytes freed per step\n(MiB; compute, saved, ...)", fontsize=8)
    for ax in axes:
        ax.axhline(0.0, color="0.3", linewidth=0.6)
        ax.tick_params(axis="x", bottom=False, labelbottom=False)
    lowered = "; ".join(f"{d.value}: {sum(v != 'fp32' for v in values[d])} lowered" for d in shown)
    axes[0].set_title(f"Chosen plan: {_short(str(record.get('chosen_trial')))} (objective {record.get('objective')})"
                      f"\n{len(names)} operators; {lowered}", fontsize=9)
    for row, dimension in enumerate(shown):
        strips.scatter(positions, [row] * len(names), c=_colours(values[dimension]), marker="s", s=36,
                       edgecolors="0.3", linewidths=0.4)
    strips.set_yticks(range(len(shown)), [d.value for d in shown], fontsize=7)
    strips.set_ylim(len(shown) - 0.5, -0.5)
    strips.set_xticks(positions, names, rotation=90, fontsize=6)
    strips.set_xlim(-0.7, len(names) - 0.3)
    used = sorted({v for d in shown for v in values[d]}, key=list(COLOURS).index)
    for value in used:
        axes[0].bar([0], [0], color=COLOURS[value], label=value)
    axes[0].legend(fontsize=7, title="value in the plan", title_fontsize=7, loc="best")
    return figure


def _bytes_gain(operator: dict[str, Any], dimension: Dimension) -> float:
    """The bytes per step the batch stage measured ``dimension``'s low value to free for ``operator`` (the state
    and the master weights are measured together)."""
    if dimension is Dimension.COMPUTE:
        return float(operator.get("gain_bytes") or 0)
    if dimension is Dimension.SAVED:
        return float((operator.get("saved") or {}).get("gain_bytes") or 0)
    return float((operator.get("parameters") or {}).get("gain_bytes") or 0)


def _colours(values: list[str]) -> list[str]:
    return [COLOURS.get(v, "black") for v in values]


def trials_figure(record: dict[str, Any]) -> Figure | None:
    """Each trial's validation metric against the FP32 reference's, and its median step time; ``None`` before the
    reference trial closed."""
    trials: list[dict[str, Any]] = [t for t in record.get("trials") or [] if t.get("verdict") is not None]
    if not trials:
        return None
    timed = any(_finite(t.get("median_step_ms")) is not None for t in trials)
    figure = _figure(max(6.4, 0.5 * len(trials) + 3.0), 6.0 if timed else 4.2)
    metric_axes, speed_axes = figure.subplots(2, 1, height_ratios=[3.0, 2.0]) if timed else (figure.subplots(), None)
    curves = max(len(t.get("metrics") or {}) for t in trials) > 1
    if curves:
        _metric_curves(metric_axes, record, trials)
    else:
        _metric_points(metric_axes, record, trials)
    if speed_axes is not None:
        _step_times(speed_axes, trials)
    else:  # trials too short to time a batch (the first batches of each are not timed)
        metric_axes.set_title("(no trial trained enough batches to time its steps)", fontsize=7)
        if not curves:  # the trials' names go on the metric's axis
            metric_axes.set_xticks(range(len(trials)), _trial_labels(trials), rotation=35, ha="right", fontsize=6)
    figure.suptitle(f"Convergence trials against the FP32 reference ({record.get('monitor')}, tolerance"
                    f" {record.get('tolerance')} {record.get('tolerance_mode')})", fontsize=9)
    return figure


def _metric_points(axes: Axes, record: dict[str, Any], trials: list[dict[str, Any]]) -> None:
    """One point per trial (trials of one validation each)."""
    values = [_finite(t.get("metric")) for t in trials]
    for index, (trial, value) in enumerate(zip(trials, values)):
        if value is not None:
            axes.scatter([index], [value], marker="*" if trial.get("kept") else "o",
                         s=90 if trial.get("kept") else 30, color=_colour(index, trial), zorder=3)
    _reference_lines(axes, record, (-0.5, len(trials) - 0.5))
    _not_finite(axes, [i for i, v in enumerate(values) if v is None], lambda index: index)
    axes.set_xticks(range(len(trials)), [f"{i}" for i in range(len(trials))], fontsize=7)
    axes.set_xlim(-0.5, len(trials) - 0.5)
    axes.set_xlabel("trial")
    axes.set_ylabel(str(record.get("monitor")))
    _verdict_legend(axes, trials)


def _metric_curves(axes: Axes, record: dict[str, Any], trials: list[dict[str, Any]]) -> None:
    """One curve per trial over its epochs (trials of several validations); the bound judges the last epoch."""
    last = max(len(t.get("metrics") or {}) for t in trials)
    missing = []
    for index, trial in enumerate(trials):
        metrics = trial.get("metrics") or {}
        points = [(step, v) for step, epoch in enumerate(sorted(metrics, key=int), start=1)
                  if (v := _finite(metrics[epoch])) is not None]
        if len(points) < len(metrics) or not points:
            missing.append(index)
        if not points:
            continue
        reference = index == 0  # drawn wide and first: a trial on top of it stays visible
        axes.plot([p[0] for p in points], [p[1] for p in points], "-o", color=_colour(index, trial), markersize=3,
                  linewidth=3.0 if reference else 1.6 if trial.get("kept") else 0.9, alpha=0.5 if reference else 0.8,
                  zorder=2 if reference else 3)
        if trial.get("kept"):
            axes.scatter([points[-1][0]], [points[-1][1]], marker="*", s=90, color=_colour(index, trial), zorder=4)
        axes.annotate(str(index), points[-1], fontsize=6, xytext=(3, 0), textcoords="offset points")
    _reference_lines(axes, record, (last - 0.3, last + 0.3))
    _not_finite(axes, missing, lambda index: last)
    axes.set_xticks(range(1, last + 1))
    axes.set_xlim(0.7, last + 0.5)
    axes.set_xlabel("epoch of the trial (judged at its last)")
    axes.set_ylabel(str(record.get("monitor")))
    _verdict_legend(axes, trials)


def _reference_lines(axes: Axes, record: dict[str, Any], span: tuple[float, float]) -> None:
    """The reference's final metric and, over ``span``, the bound a trial must end within, its failing side
    shaded."""
    reference = _finite((record.get("trials") or [{}])[0].get("metric"))
    bound = _finite(record.get("metric_bound"))
    if reference is not None:
        axes.axhline(reference, color="black", linestyle=":", linewidth=0.9, label="fp32 reference (its end)")
    if bound is None:
        return
    axes.hlines(bound, *span, color="tab:red", linestyle="--", linewidth=0.9, label="worst a trial may end with")
    low, high = axes.get_ylim()
    margin = 0.1 * ((high - low) or abs(bound) or 1.0)
    edge = max(high, bound + margin) if record.get("mode") == "min" else min(low, bound - margin)
    axes.fill_between(span, bound, edge, color="tab:red", alpha=0.08, linewidth=0)
    axes.set_ylim(min(low, edge), max(high, edge))


def _not_finite(axes: Axes, indices: list[int], where: Callable[[int], float]) -> None:
    """Mark the trials whose metric was NaN/Inf (or missing) at the top of ``axes``."""
    top = axes.get_ylim()[1]
    for index in indices:
        axes.annotate(f"{index}: not finite", (where(index), top), fontsize=6, color="tab:red", ha="center",
                      xytext=(0, -10 - 8 * (indices.index(index) % 3)), textcoords="offset points")


def _colour(index: int, trial: dict[str, Any]) -> str:
    return "black" if index == 0 else VERDICT_COLOURS.get(trial["verdict"], "0.5")


def _verdict_legend(axes: Axes, trials: list[dict[str, Any]]) -> None:
    for verdict in ("pass", "fail"):
        if any(t["verdict"] == verdict for t in trials[1:]):
            axes.scatter([], [], color=VERDICT_COLOURS[verdict], label=f"trial: {verdict}")
    if any(t.get("kept") for t in trials):
        axes.scatter([], [], marker="*", color="0.3", s=90, label="kept (its progress is the run's)")
    axes.legend(fontsize=7, loc="best")


def _step_times(axes: Axes, trials: list[dict[str, Any]]) -> None:
    """Each trial's median step time, the reference's as a line; the x axis names the trials."""
    times = [_finite(t.get("median_step_ms")) for t in trials]
    colours = [_colour(i, t) for i, t in enumerate(trials)]
    axes.bar(range(len(trials)), [v or 0.0 for v in times], color=colours, alpha=0.75)
    if times[0] is not None:
        axes.axhline(times[0], color="black", linestyle=":", linewidth=0.9)
    axes.set_ylabel("median step (ms)")
    axes.set_xticks(range(len(trials)), _trial_labels(trials), rotation=35, ha="right", fontsize=6)
    axes.set_xlim(-0.5, len(trials) - 0.5)


def frontier_figure(record: dict[str, Any]) -> Figure | None:
    """The memory objective's frontier: the step's bytes against its time after each lever taken; ``None`` where
    the memory levers were not spent."""
    spending = record.get("memory_spending")
    if not spending or len(spending["frontier"]) < 2:
        return None
    frontier = spending["frontier"]
    given_back = set(spending["given_back"])
    figure = _figure(6.4, 4.2)
    ax = figure.subplots()
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
    return figure


FIGURES: dict[str, Callable[[dict[str, Any]], Figure | None]] = {
    PLAN_FIGURE: plan_figure, TRIALS_FIGURE: trials_figure, FRONTIER_FIGURE: frontier_figure,
}


def write_figures(record: dict[str, Any], directory: Path, loggers: Sequence[Logger] = (), step: int = 0,
                  final: bool = False) -> dict[str, float]:
    """Draw the record's figures, write each into ``directory`` as PNG and send it to ``loggers`` that take figures.

    Each figure is rendered once; its pixels are both the PNG and the image the loggers get.

    Args:
        record: the decision record.
        directory: where the PNGs are written (beside ``plan.json``); it exists.
        loggers: the Trainer's loggers; each TensorBoard one gets every figure (tag ``comp/<name>``) at ``step``.
        step: the global step the figures are logged at.
        final: the write at the fit's end: what the figures show was decided when the search ended, so a figure
            already in ``directory`` is not drawn again, and a missing matplotlib is not reported again.

    Returns:
        The file name of each figure written -> milliseconds it took to draw, write and log.
    """
    if not _has_matplotlib():
        if not final:
            rank_zero_info(NO_MATPLOTLIB)
        return {}
    from matplotlib.image import imsave

    writers = [logger.experiment for logger in loggers if isinstance(logger, TensorBoardLogger)]
    spent: dict[str, float] = {}
    for name, draw in FIGURES.items():
        if final and (directory / name).exists():
            continue
        started = time.perf_counter()
        figure = draw(record)
        if figure is None:
            continue
        pixels = _render(figure)
        imsave(directory / name, pixels)
        for writer in writers:
            writer.add_image(f"comp/{Path(name).stem}", pixels[..., :3], step, dataformats="HWC")
        spent[name] = (time.perf_counter() - started) * 1e3
    for writer in writers:
        writer.flush()
    return spent


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width: float, height: float) -> Figure:
    """A figure on its own Agg canvas (not registered with pyplot: nothing to close, no global backend changed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _render(figure: Figure) -> np.ndarray:
    """The figure's pixels (height x width x RGBA, uint8), drawn once on its Agg canvas."""
    import numpy as np  # matplotlib's own dependency

    canvas = figure.canvas
    canvas.draw()
    return np.array(canvas.buffer_rgba())  # type: ignore[attr-defined]


def _finite(value: Any) -> float | None:
    """``value`` as a float, ``None`` where it is missing, NaN or infinite."""
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _trial_labels(trials: list[dict[str, Any]]) -> list[str]:
    return [f"{i}: {_short(t['label'])}" + _lowered_names(t) for i, t in enumerate(trials)]


def _lowered_names(trial: dict[str, Any]) -> str:
    """The selectors a trial lowered, where they are few enough to name on an axis."""
    names = trial.get("low_operators") or []
    return f"\n[{', '.join(names)}]" if 0 < len(names) <= 2 else ""


def _short(label: str) -> str:
    return label if len(label) <= SHORT_LABEL else label[: SHORT_LABEL - 1] + "…"
