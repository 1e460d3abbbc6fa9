"""Where the memory plan's training step spends its time, in Lightning: FP32, the plan's saved levers alone, its state
levers alone, and the whole plan, each a fresh Trainer of 11 steps (3 warm-up steps dropped), rounds interleaved.

    PYTHONPATH=. python benchmarks/results/issue34_avx2/ninth_pass/training_phases_probe.py PLAN_JSON [ROUNDS]

Prints each configuration's median phases (ms): forward (from ``on_train_batch_start``), backward, the gap to
``on_before_optimizer_step``, the optimizer step and the rest, and the whole batch.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
from compare_suite import SUITE  # type: ignore[import-not-found]  # noqa: E402
from compare_workers import _build  # type: ignore[import-not-found]  # noqa: E402

from lightning_comp import CoMPPrecision, PrecisionPlan  # noqa: E402


class Phases(pl.Callback):
    """Marks each batch at its hooks; one row of phase times (ms) per batch."""

    def __init__(self) -> None:
        self.rows: list[list[float]] = []
        self.marks: list[float] = []

    def _mark(self, *_: Any) -> None:
        self.marks.append(time.perf_counter())

    def on_train_batch_start(self, *_: Any) -> None:
        self.marks = [time.perf_counter()]

    on_before_backward = _mark
    on_after_backward = _mark
    on_before_optimizer_step = _mark

    def on_train_batch_end(self, *_: Any) -> None:
        self._mark()
        self.rows.append([(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])])


def main(plan_path: str, rounds: int) -> None:
    full = json.loads(Path(plan_path).read_text())

    def keeping(*dimensions: str) -> dict[str, Any]:
        return {**full, **{d: {} for d in ("saved", "state", "master") if d not in dimensions}}

    configs = {"fp32": keeping(), "saved": keeping("saved"), "state": keeping("state", "master"), "plan": full}
    spec = SUITE["gpt"]
    build = {"model": spec.model, "model_kwargs": spec.model_kwargs, "data": spec.data, "data_kwargs": spec.data_kwargs}
    rows: dict[str, list[list[float]]] = {name: [] for name in configs}
    torch.manual_seed(0)
    for _ in range(rounds):
        for name, plan in configs.items():
            model, data = _build(build, 0)
            phases = Phases()
            trainer = pl.Trainer(max_steps=11, accelerator="cpu", logger=False, enable_progress_bar=False,
                                 enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                                 plugins=[CoMPPrecision(plan=PrecisionPlan.from_dict(plan))], callbacks=[phases])
            trainer.fit(model, data)
            rows[name] += phases.rows[3:]
    print("phase medians (ms): forward, backward, after backward, optimizer step and rest, batch")
    for name, measured in rows.items():
        medians = [statistics.median(column) for column in zip(*measured)]
        print(f"{name:6s}", " ".join(f"{m:7.1f}" for m in medians), f"{statistics.median(map(sum, measured)):7.1f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
