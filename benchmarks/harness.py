"""The harness every benchmark script shares: interleaved rounds, ratios with their interval, the machine, results.

A benchmark here measures variants side by side on a shared, noisy machine. The rules, said once:

- **Interleaved rounds.** Every variant runs once per round, in an order that rotates each round
  (:func:`rotated`, :func:`interleaved_rounds`), so all variants see the same drift of the machine. The first
  ``warmup`` rounds (or batches) are left out by the caller.
- **Ratios per round.** A ratio between two variants is taken inside each round and summarised over rounds by its
  median with the min-max range as its interval (:func:`ratio_summary`); this cancels most of the machine's drift.
- **The machine.** Every result records where it ran (:func:`machine_info`: versions, CPU model and flags, threads,
  the device class) and the load before and after (:func:`load_average`), and the commit it measured
  (:func:`git_state`); :func:`run_header` gathers them.
- **Results.** JSON (:func:`write_json`, any dataclass or odd value serialised by :func:`json_default`) and Markdown
  (:func:`write_text`), written under ``benchmarks/results/`` unless ``--out`` says otherwise.

Scripts import it by module name (``from harness import ...``): a script's own folder is on ``sys.path``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"

T = TypeVar("T")

__all__ = ["RESULTS_DIR", "ROOT", "geomean", "git_state", "interleaved_rounds", "json_default", "load_average",
           "machine_info", "median", "ratio_summary", "rotated", "run_header", "write_json", "write_text"]


# ----------------------------------------------------------------------------------------------------- statistics
def median(values: Iterable[float]) -> float:
    """The median of ``values``; NaN when there are none."""
    values = list(values)
    return float(statistics.median(values)) if values else math.nan


def geomean(values: Iterable[float]) -> float:
    """The geometric mean of the finite, positive ``values``; NaN when there are none."""
    kept = [v for v in values if v and math.isfinite(v) and v > 0]
    return math.exp(sum(math.log(v) for v in kept) / len(kept)) if kept else math.nan


def ratio_summary(ratios: Sequence[float]) -> dict[str, float]:
    """Per-round ratios summarised: ``median`` with ``min``/``max`` (its interval) and the number of ``rounds``."""
    kept = [r for r in ratios if math.isfinite(r)]
    if not kept:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "rounds": 0}
    return {"median": median(kept), "min": min(kept), "max": max(kept), "rounds": len(kept)}


# ------------------------------------------------------------------------------------------------ interleaving
def rotated(order: Sequence[T], round_index: int) -> list[T]:
    """``order`` rotated by ``round_index`` places: the order of the variants in that round."""
    if not order:
        return []
    shift = round_index % len(order)
    return [*order[shift:], *order[:shift]]


def interleaved_rounds(variants: Mapping[str, Callable[[], T]], rounds: int,
                       on_round: Callable[[int, dict[str, T]], None] | None = None) -> dict[str, list[T]]:
    """Run every variant once per round, in rotating order, for ``rounds`` rounds.

    Args:
        variants: What one turn of each variant does (returns its measurement), by name.
        rounds: How many rounds (warm-up rounds included: the caller drops them).
        on_round: Called after each round with its index and that round's measurements (progress lines).

    Returns:
        Each variant's measurements, one per round, in round order.
    """
    results: dict[str, list[T]] = {name: [] for name in variants}
    for r in range(rounds):
        this_round: dict[str, T] = {}
        for name in rotated(list(variants), r):
            this_round[name] = variants[name]()
            results[name].append(this_round[name])
        if on_round is not None:
            on_round(r, this_round)
    return results


# ------------------------------------------------------------------------------------------------------ machine
def load_average() -> list[float]:
    """The 1/5/15-minute load averages, rounded (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def git_state() -> dict[str, Any]:
    """The commit measured (short hash; empty outside a git checkout) and whether tracked files differ from it."""
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def machine_info() -> dict[str, Any]:
    """Versions, CPU model and its BF16/FP16/AMX flags, thread counts and the device class of this machine."""
    import lightning
    import torch

    from lightning_comp.devices.cpu_features import cpu_features
    from lightning_comp.devices.device_classes import device_class

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
        "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cuda": torch.cuda.is_available(),
    }
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Core(s) per socket", "Thread(s) per core", "Flags"):
                value = value.strip()
                if key.strip() == "Flags":
                    value = " ".join(f for f in value.split() if "amx" in f or "bf16" in f or "fp16" in f)
                info[f"lscpu {key.strip()}"] = value
    except (OSError, subprocess.SubprocessError):
        pass
    features = cpu_features()
    for name in ("amx_tile", "avx512_bf16", "amx_fp16"):
        info[f"is_{name}_supported"] = name in features
    info["device_class"] = device_class("cuda" if torch.cuda.is_available() else "cpu").to_dict()
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda_capability"] = list(torch.cuda.get_device_capability())
    return info


def run_header(script: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What every result file starts with: date, command, commit, machine and the load at the start.

    Args:
        script: The script's file name (``"overhead.py"``): the command is written as ``python benchmarks/<script>``.
        argv: Its arguments (default: this process's).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    return {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(["python", f"benchmarks/{script}", *args]), **git_state(),
            "machine": machine_info(), "load_average_start": load_average()}


# ------------------------------------------------------------------------------------------------------ results
def json_default(value: Any) -> Any:
    """JSON for what ``json`` cannot write itself: dataclasses as dicts, sets as sorted lists, the rest as text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return str(value)


def write_json(path: Path, data: Any, indent: int = 1) -> Path:
    """Write ``data`` as JSON to ``path`` (folders created), ending with a newline; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=json_default) + "\n")
    return path


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` (a Markdown report) to ``path`` (folders created); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path
