"""Where the managed update's time goes in training with the native 8-bit step (issue 34, eleventh pass).

The default example's CharGPT (3.32 M parameters) with every ``Linear`` and both embeddings in 8-bit state
(``{"type:Linear": {"state": "8bit"}, "type:Embedding": {"state": "8bit"}}``, FP32 compute, ``update_path="auto"``,
the default), 3 fresh Trainers of 11 steps one after another, medians over steps 4-11 of each (ms): the plugin's whole
``OptimizerStates.step`` (the managed loop and the optimizer's own step of the rest), of it the native calls and the
eager steps (tensors too small to quantise keep FP32 moments and step eagerly), and the phase from
``on_before_optimizer_step`` to ``on_train_batch_end``; then the same with ``torch.optim.AdamW`` alone (no plugin).

    PYTHONPATH=. python benchmarks/results/issue34_avx2/eleventh_pass/native_update_in_training_probe.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
from compare_suite import SUITE  # type: ignore[import-not-found]  # noqa: E402
from compare_workers import _build  # type: ignore[import-not-found]  # noqa: E402

from lightning_comp import CoMPPrecision  # noqa: E402
from lightning_comp.execution import native_adam, optimizer_states  # noqa: E402

PLAN = {"type:Linear": {"state": "8bit"}, "type:Embedding": {"state": "8bit"}}
STEPS, WARMUP = 11, 3


class Timers:
    """Wraps the functions whose time is split out; ``ms[name]`` holds one total per optimizer step."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {}
        self.calls: dict[str, int] = {}
        self.current: dict[str, float] = {}
        self._restore: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)
        timers = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers.current[name] = timers.current.get(name, 0.0) + (time.perf_counter() - started) * 1e3
                timers.calls[name] = timers.calls.get(name, 0) + 1

        setattr(owner, attribute, timed)
        self._restore.append((owner, attribute, original))

    def close_step(self) -> None:
        for name, value in self.current.items():
            self.ms.setdefault(name, []).append(value)
        self.current = {}

    def restore(self) -> None:
        for owner, attribute, original in reversed(self._restore):
            setattr(owner, attribute, original)


class Phase(pl.Callback):
    def __init__(self, timers: Timers) -> None:
        self.timers, self.update_ms, self.started = timers, [], 0.0

    def on_before_optimizer_step(self, *_: Any) -> None:
        self.timers.current = {}
        self.started = time.perf_counter()

    def on_train_batch_end(self, *_: Any) -> None:
        self.update_ms.append((time.perf_counter() - self.started) * 1e3)
        self.timers.close_step()


def _fit(plugins: list[Any], callback: pl.Callback) -> None:
    model, datamodule = _build(SUITE["gpt"], 0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=plugins, callbacks=[callback])
    trainer.fit(model, datamodule=datamodule)


def _median(values: list[float]) -> float:
    return statistics.median(values[WARMUP:])


def run(label: str, plugins: Callable[[], list[Any]], managed: bool) -> None:
    for turn in range(3):
        timers = Timers()
        if managed:
            timers.wrap(optimizer_states.OptimizerStates, "step", "managed step (whole)")
            timers.wrap(native_adam.NativeAdam, "step_8bit", "native 8-bit calls")
            timers.wrap(native_adam.NativeAdam, "step_dense", "native dense calls")
            timers.wrap(optimizer_states, "adam_step", "eager steps")
        phase = Phase(timers)
        try:
            _fit(plugins(), phase)
        finally:
            timers.restore()
        cells = [f"update phase {_median(phase.update_ms):.2f}"]
        for name, values in timers.ms.items():
            if len(values) <= WARMUP:
                cells.append(f"{name}: in the first {len(values)} step(s) only ({timers.calls[name]} calls)")
                continue
            calls = timers.calls[name] / len(values)
            cells.append(f"{name} {_median(values):.2f} ({calls:.0f} calls/step)")
        print(f"{label} turn {turn}: " + ", ".join(cells), flush=True)


def main() -> None:
    from dataclasses import asdict

    global SUITE
    SUITE = {key: asdict(spec) for key, spec in SUITE.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    run("8-bit state, auto (native)", lambda: [CoMPPrecision(PLAN)], managed=True)
    run("torch AdamW (no plugin)", lambda: [], managed=False)


if __name__ == "__main__":
    main()
