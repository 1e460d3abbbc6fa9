"""The managed update in training, one native call per parameter against one for all of them (issue 34, twelfth
pass).

The default example's CharGPT (3.32 M parameters), FP32 compute, ``update_path="auto"`` (native on a CPU), with two
plans: every ``Linear`` and both embeddings in 8-bit state (the state entries of the default memory search's plan:
19 tensors 8-bit, 17 too small to quantise keep FP32 moments), and every ``Linear`` with BF16 moments. Each
configuration trains in a fresh process (one Trainer of 16 steps, medians over steps 4-15, ms), the package imported
from the checkout given for it, so the code before and after the change runs side by side, interleaved, the order
rotating every round; ``torch.optim.AdamW`` alone (no plugin) runs beside them. Reported per process: the update phase
(``on_before_optimizer_step`` to ``on_train_batch_end``), the plugin's whole ``OptimizerStates.step`` (the managed
update and the optimizer's own step of the rest), the native calls within it, and the whole batch.

    python benchmarks/results/issue34_avx2/twelfth_pass/batched_update_probe.py BEFORE_CHECKOUT AFTER_CHECKOUT [ROUNDS]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PLANS = {"8bit": {"type:Linear": {"state": "8bit"}, "type:Embedding": {"state": "8bit"}},
         "bf16": {"type:Linear": {"state": "bf16"}}}
STEPS, WARMUP = 16, 4


def child(plan_name: str) -> None:
    import lightning.pytorch as pl

    sys.path.insert(0, str(Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]) / "benchmarks"))
    from dataclasses import asdict

    from compare_suite import SUITE  # type: ignore[import-not-found]
    from compare_workers import _build  # type: ignore[import-not-found]

    from lightning_comp import CoMPPrecision
    from lightning_comp.execution import native_adam, optimizer_states

    timed: dict[str, float] = {}
    calls: dict[str, int] = {}

    def wrap(owner: Any, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timed[name] = timed.get(name, 0.0) + (time.perf_counter() - started) * 1e3
                calls[name] = calls.get(name, 0) + 1

        setattr(owner, attribute, timed_call)

    phases: dict[str, list[float]] = {}

    class Phase(pl.Callback):
        def on_train_batch_start(self, *_: Any) -> None:
            self.batch = time.perf_counter()

        def on_before_optimizer_step(self, *_: Any) -> None:
            timed.clear()
            calls.clear()
            self.update = time.perf_counter()

        def on_train_batch_end(self, *_: Any) -> None:
            now = time.perf_counter()
            row = {"update phase": (now - self.update) * 1e3, "batch": (now - self.batch) * 1e3, **timed}
            row.update({f"{name} calls": float(count) for name, count in calls.items()})
            for name, value in row.items():
                phases.setdefault(name, []).append(value)

    plugins = []
    if plan_name != "adamw":
        wrap(optimizer_states.OptimizerStates, "step", "managed step")
        native_calls = [a for a in ("step", "step_8bit", "step_dense") if hasattr(native_adam.NativeAdam, a)]
        for attribute in native_calls:  # before the change: step_8bit and step_dense, one call per parameter
            wrap(native_adam.NativeAdam, attribute, "native calls")
        plugins = [CoMPPrecision(PLANS[plan_name])]
    spec = {key: asdict(value) for key, value in SUITE.items()}["gpt"]
    model, datamodule = _build(spec, 0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=plugins, callbacks=[Phase()])
    trainer.fit(model, datamodule=datamodule)
    print("RESULT " + json.dumps({name: statistics.median(values[WARMUP:]) for name, values in phases.items()
                                  if len(values) > WARMUP}), flush=True)


def main() -> None:
    before, after = (str(Path(p).resolve()) for p in sys.argv[1:3])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    configs = [("adamw", "adamw", after)] + [(f"{plan}/{label}", plan, tree) for plan in PLANS
                                             for label, tree in (("before", before), ("after", after))]
    print(f"before: {before}\nafter: {after}\n{len(configs)} configurations, {rounds} rounds, fresh processes",
          flush=True)
    results: dict[str, list[dict[str, float]]] = {}
    for index in range(rounds):
        order = configs[index % len(configs):] + configs[:index % len(configs)]
        for label, plan, tree in order:
            env = {**os.environ, "PYTHONPATH": tree, "PYTHONWARNINGS": "ignore"}
            done = subprocess.run([sys.executable, __file__, "--child", plan], env=env, capture_output=True,
                                  text=True, check=True, cwd=tree)
            row = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
            results.setdefault(label, []).append(row)
            cells = ", ".join(f"{name} {value:.2f}" for name, value in sorted(row.items()))
            print(f"round {index} {label}: {cells}", flush=True)
    print("\nmedian over rounds (ms): update phase / managed step / native calls (calls per step) / batch")
    for label, rows in results.items():
        cells = [_median(rows, name) for name in ("update phase", "managed step", "native calls", "native calls calls",
                                                  "batch")]
        print(f"{label}: {cells[0]} / {cells[1]} / {cells[2]} ({cells[3]}) / {cells[4]}")


def _median(rows: list[dict[str, float]], name: str) -> str:
    values = [row[name] for row in rows if name in row]
    return f"{statistics.median(values):.2f}" if values else "-"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        main()
