"""PNG plots of ``benchmarks/compare.py``: throughput and memory per mode, validation curves per mode."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from compare_suite import COMP_MODES

COLORS = {"fp32": "#4c72b0", "bf16-mixed": "#dd8452", "bf16-true": "#55a868", "16-mixed": "#8172b3", "comp": "#c44e52",
          "comp-balanced": "#937860", "comp-memory": "#da8bc3", "type-linear": "#64b5cd"}
LABELS = {"fp32": "FP32", "bf16-mixed": "AMP bf16-mixed", "bf16-true": "bf16-true", "16-mixed": "16-mixed",
          "comp": "CoMP", "comp-balanced": "CoMP balanced", "comp-memory": "CoMP memory",
          "type-linear": "type:Linear bf16"}
MARKERS = {"comp": "x", "comp-balanced": "+", "comp-memory": "d"}


def _setup() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ok_modes(model: dict[str, Any]) -> list[str]:
    return [m for m, e in model["modes"].items() if "error" not in e]


def _panel_width(models: dict[str, Any]) -> float:
    """Inches per model panel of a bar plot: room for every mode's bar and label (up to 7 modes)."""
    return max(3.2, 0.55 * max((len(m["modes"]) for m in models.values()), default=0))


def plot_throughput(report: dict[str, Any], path: Path) -> Path:
    plt = _setup()
    models = report["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(_panel_width(models) * len(models) + 0.6, 3.6), squeeze=False)
    for ax, (key, model) in zip(axes[0], models.items()):
        modes = _ok_modes(model)
        values = [model["modes"][m]["throughput"]["samples_per_s"] for m in modes]
        lows = [v - model["modes"][m]["throughput"]["min"] for m, v in zip(modes, values)]
        highs = [model["modes"][m]["throughput"]["max"] - v for m, v in zip(modes, values)]
        x = range(len(modes))
        ax.bar(x, values, color=[COLORS[m] for m in modes], yerr=[lows, highs], capsize=3)
        ax.set_xticks(list(x))
        ax.set_xticklabels([LABELS[m] for m in modes], rotation=35, ha="right", fontsize=8)
        ax.set_title(key, fontsize=10)
        ax.set_ylabel("samples/s" if ax is axes[0][0] else "")
        fp32 = model["modes"].get("fp32", {}).get("throughput", {}).get("samples_per_s")
        for i, v in enumerate(values):
            if fp32:
                ax.text(i, v, f"{v / fp32:.2f}x", ha="center", va="bottom", fontsize=7)
    fig.suptitle("Training throughput (median over interleaved rounds, whiskers min-max; labels vs FP32)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(report: dict[str, Any], path: Path) -> Path:
    plt = _setup()
    models = report["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(_panel_width(models) * len(models) + 0.6, 6.0), squeeze=False)
    for col, (key, model) in enumerate(models.items()):
        modes = _ok_modes(model)
        x = list(range(len(modes)))
        mem = [(((model["modes"][m]["memory"].get("step_peak") or {}).get("bytes")) or math.nan) / 2**20 for m in modes]
        saved = [((model["modes"][m]["saved_for_backward"] or {}).get("activation_bytes", math.nan)) / 2**20
                 for m in modes]
        for row, (values, label) in enumerate(((mem, "peak tensor memory of\none training step (MiB)"),
                                                (saved, "saved for backward\n(MiB, one step)"))):
            ax = axes[row][col]
            ax.bar(x, values, color=[COLORS[m] for m in modes])
            ax.set_xticks(x)
            ax.set_xticklabels([LABELS[m] for m in modes] if row == 1 else [""] * len(x), rotation=35, ha="right",
                               fontsize=8)
            if col == 0:
                ax.set_ylabel(label, fontsize=8)
            if row == 0:
                ax.set_title(key, fontsize=10)
    device = report.get("device", "cpu")
    how = ("params + grads + optimizer state + profiler peak of live tensors" if device == "cpu"
           else "torch.cuda.max_memory_allocated")
    fig.suptitle(f"Memory per mode\n({how}; each mode in its own process)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_validation(report: dict[str, Any], path: Path) -> Path:
    plt = _setup()
    models = report["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(3.4 * len(models) + 0.6, 3.4), squeeze=False)
    for ax, (key, model) in zip(axes[0], models.items()):
        metric = model["metric"]
        for mode in _ok_modes(model):
            points = [(v["step"], v.get(metric, math.nan)) for v in model["modes"][mode]["validation"]]
            if points:
                steps, values = zip(*points)
                dashed = mode in COMP_MODES  # CoMP often coincides with AMP or FP32 (same numerics): keep both visible
                ax.plot(steps, values, marker=MARKERS.get(mode, "o"), ms=5 if dashed else 3, color=COLORS[mode],
                        linestyle="--" if dashed else "-", label=LABELS[mode])
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.set_ylabel(metric, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Validation metric per mode (same initial weights, same batches)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(report: dict[str, Any], img_dir: Path, prefix: str = "compare") -> list[Path]:
    """Write ``<prefix>_throughput.png``, ``<prefix>_memory.png`` and ``<prefix>_val_curves.png``."""
    return [
        plot_throughput(report, img_dir / f"{prefix}_throughput.png"),
        plot_memory(report, img_dir / f"{prefix}_memory.png"),
        plot_validation(report, img_dir / f"{prefix}_val_curves.png"),
    ]
