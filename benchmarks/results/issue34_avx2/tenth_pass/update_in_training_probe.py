"""The managed update as training runs it, beside what the search's per-group timing forecasts (default example's
model, the memory plan's optimizer-state entries alone, on an AVX2 EPYC).

    PYTHONPATH=. python benchmarks/results/issue34_avx2/tenth_pass/update_in_training_probe.py PLAN_JSON

Prints three things:

1. Per Lightning step (3 fresh Trainers of 11 steps, one after another): the managed loop's time (the plugin's
   ``OptimizerStates.step`` up to the optimizer's own step), the optimizer's own step (the unmanaged parameters), the
   compiled calls and their time, and the whole phase from ``on_before_optimizer_step`` to ``on_train_batch_end``;
   then the search's per-group timing (:func:`time_updates`, 8-bit, on the last Trainer's optimizer), summed.
2. The user's own AdamW step (FP32) over the same groups: one call per group (as the search times it) against one
   call over every group (as training runs it), and one call over a one-element parameter.
3. The update phase of FP32 and of the state plan in Lightning, quiet and beside one busy process.
"""

from __future__ import annotations

import json
import statistics
import subprocess
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
from lightning_comp.execution import optimizer_states, update_path  # noqa: E402
from lightning_comp.numerics.precision import StatePrecision  # noqa: E402
from lightning_comp.search.measurement.clocks import WallClock  # noqa: E402
from lightning_comp.search.measurement.optimizer_timing import (  # noqa: E402
    UpdateConfig,
    UpdateVariant,
    time_updates,
)

SPEC = SUITE["gpt"]
BUILD = {"model": SPEC.model, "model_kwargs": SPEC.model_kwargs, "data": SPEC.data, "data_kwargs": SPEC.data_kwargs}
COUNTED = ("managed_ms", "own_step_ms", "compiled_calls", "compiled_ms", "phase_ms")


class StepLog:
    """Wraps the plugin's managed step and the compiled calls to time them, one row per optimizer step."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.row: dict[str, float] = {}
        self._step = optimizer_states.OptimizerStates.step
        self._call = update_path.CompiledUpdates.step
        log = self

        def call(updates: Any, *args: Any, **kwargs: Any) -> bool:
            start = time.perf_counter()
            done = log._call(updates, *args, **kwargs)
            if done:
                log.row["compiled_calls"] += 1
                log.row["compiled_ms"] += (time.perf_counter() - start) * 1e3
            return done

        def step(states: Any, optimizer: torch.optim.Optimizer, own_step: Any) -> Any:
            log.row.update(compiled_calls=0.0, compiled_ms=0.0)
            marks: dict[str, float] = {"start": time.perf_counter()}

            def own() -> Any:
                marks["own"] = time.perf_counter()
                out = own_step()
                marks["end"] = time.perf_counter()
                return out

            out = log._step(states, optimizer, own)
            log.row["managed_ms"] = (marks["own"] - marks["start"]) * 1e3
            log.row["own_step_ms"] = (marks["end"] - marks["own"]) * 1e3
            return out

        optimizer_states.OptimizerStates.step = step  # type: ignore[method-assign]
        update_path.CompiledUpdates.step = call  # type: ignore[method-assign]

    def restore(self) -> None:
        """Put the plugin's own step and compiled calls back."""
        optimizer_states.OptimizerStates.step = self._step  # type: ignore[method-assign]
        update_path.CompiledUpdates.step = self._call  # type: ignore[method-assign]


class Phase(pl.Callback):
    """The update phase (``on_before_optimizer_step`` to ``on_train_batch_end``) and the rest of each batch."""

    def __init__(self, log: StepLog | None = None) -> None:
        self.step_log = log
        self.rows: list[tuple[float, float]] = []

    def on_train_batch_start(self, *_: Any) -> None:
        self.start = time.perf_counter()

    def on_before_optimizer_step(self, *_: Any) -> None:
        self.before = time.perf_counter()

    def on_train_batch_end(self, *_: Any) -> None:
        end = time.perf_counter()
        self.rows.append(((self.before - self.start) * 1e3, (end - self.before) * 1e3))
        if self.step_log is not None:
            self.step_log.rows.append({**self.step_log.row, "phase_ms": self.rows[-1][1]})
            self.step_log.row = {}


def _fit(plan: dict[str, Any], callback: pl.Callback) -> tuple[pl.Trainer, Any, CoMPPrecision]:
    model, data = _build(BUILD, 0)
    plugin = CoMPPrecision(plan=PrecisionPlan.from_dict(plan))
    trainer = pl.Trainer(max_steps=11, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                         plugins=[plugin], callbacks=[callback])
    trainer.fit(model, data)
    return trainer, model, plugin


def in_training(state_plan: dict[str, Any]) -> None:
    log = StepLog()
    for trainer_index in range(3):
        log.rows.clear()
        trainer, model, plugin = _fit(state_plan, Phase(log))
        print(f"trainer {trainer_index}, steps 1-11, and the median of steps 4-11 (ms):")
        for key in COUNTED:
            values = [row.get(key, 0.0) for row in log.rows]
            median = statistics.median(values[3:])
            print(f"  {key:15s}", " ".join(f"{v:7.1f}" for v in values), f"  median {median:.2f}")
    log.restore()
    groups = {name: list(module.parameters(recurse=False)) for name, module in model.named_modules()
              if name in state_plan["state"]}
    updates = plugin._runtime.optimizer_states.updates
    times = time_updates(trainer.optimizers[0], groups, {UpdateVariant.INT8: UpdateConfig(StatePrecision.INT8)},
                         WallClock(), 7, 2, updates)
    total = sum(statistics.median(series[UpdateVariant.INT8]) for series in times.values())
    print(f"the search's per-group timing, 8-bit, {len(times)} groups: the sum of their medians {total:.2f} ms")


def own_step_calls() -> None:
    model, _ = _build(BUILD, 0)
    groups = [[p for p in m.parameters(recurse=False) if p.requires_grad] for m in model.modules()]
    groups = [g for g in groups if g and sum(p.numel() for p in g) >= 4096]

    def optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for copy in copies:
            copy.grad = torch.randn_like(copy) * 1e-3
        made = torch.optim.AdamW(copies, lr=1e-3)
        made.step()
        return made

    each = [optimizer(g) for g in groups]
    whole = optimizer([p for g in groups for p in g])
    one = optimizer([torch.nn.Parameter(torch.zeros(1))])
    rows: dict[str, list[float]] = {"one call per group, summed": [], "one call over every group": [],
                                    "one call, one element": []}
    for _ in range(12):
        total = 0.0
        for made in each:
            start = time.perf_counter()
            made.step()
            total += time.perf_counter() - start
        rows["one call per group, summed"].append(total * 1e3)
        for key, made in (("one call over every group", whole), ("one call, one element", one)):
            start = time.perf_counter()
            made.step()
            rows[key].append((time.perf_counter() - start) * 1e3)
    print(f"AdamW's own FP32 step over the {len(groups)} groups (median of rounds 3-12, ms):")
    for key, values in rows.items():
        print(f"  {key:28s} {statistics.median(values[2:]):.3f}")


def beside_a_busy_process(full: dict[str, Any], state_plan: dict[str, Any]) -> None:
    configs = {"fp32": {**full, "saved": {}, "state": {}, "master": {}}, "state": state_plan}
    busy = None
    try:
        for condition in ("quiet", "busy"):
            if condition == "busy":
                busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            rows: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
            for _ in range(2):
                for name, plan in configs.items():
                    phase = Phase()
                    _fit(plan, phase)
                    rows[name] += phase.rows[3:]
            for name, measured in rows.items():
                print(f"{condition:5s} {name:5s} forward+backward {statistics.median(r[0] for r in measured):7.1f} ms,"
                      f" update phase {statistics.median(r[1] for r in measured):6.1f} ms")
    finally:
        if busy is not None:
            busy.kill()


def main(plan_path: str) -> None:
    full = json.loads(Path(plan_path).read_text())
    state_plan = {**full, "saved": {}, "master": {}}
    own_step_calls()
    beside_a_busy_process(full, state_plan)
    in_training(state_plan)  # last: it wraps the plugin's step


if __name__ == "__main__":
    main(sys.argv[1])
