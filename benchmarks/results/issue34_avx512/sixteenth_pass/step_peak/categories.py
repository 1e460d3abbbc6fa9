"""Live tensor bytes by category (torch.profiler's memory profile) at a training step's peak.

Run from the repository root: ``python .../step_peak/categories.py PLAN_JSON|- PRECISION MODEL`` (as ``timeline.py``).
"""

from __future__ import annotations

import collections
import json
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch.profiler import ProfilerActivity, profile

import lightning_comp.zoo as zoo
from lightning_comp import CoMPPrecision
from lightning_comp.plan.plan import PrecisionPlan

sys.path.insert(0, "benchmarks")
from compare_suite import SUITE  # noqa: E402

MIB = 2**20


class StepProfile(pl.Callback):
    """Profiles batch 4 with memory and stops the fit."""

    def __init__(self) -> None:
        self.prof: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, i: int) -> None:
        if i == 4:
            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                                with_stack=True)
            self.prof.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, out: Any, batch: Any,
                           i: int) -> None:
        if not self.prof:
            return
        self.prof.__exit__(None, None, None)
        memory = self.prof._memory_profile()
        live: collections.Counter[str] = collections.Counter()
        best: tuple[int, dict[str, int]] = (0, {})
        for _, action, (key, version), size in memory.timeline:
            category = memory._categories.get(key, version)
            name = category.name if category is not None else "UNKNOWN"
            if action.name == "INCREMENT_VERSION":
                old = memory._categories.get(key, version - 1)
                live[old.name if old is not None else "UNKNOWN"] -= size
                live[name] += size
            elif action.name in ("PREEXISTING", "CREATE"):
                live[name] += size
            elif action.name == "DESTROY":
                live[name] -= size
            total = sum(live.values())
            if total > best[0]:
                best = (total, dict(live))
        print("peak MiB", round(best[0] / MIB, 2), {k: round(v / MIB, 2) for k, v in sorted(best[1].items()) if v})
        self.prof = None
        trainer.should_stop = True


def main(plan_path: str, precision: str, key: str) -> None:
    spec = SUITE[key]
    torch.manual_seed(0)
    model = getattr(zoo, spec.model)(**spec.model_kwargs)
    data = getattr(zoo, spec.data)(**spec.data_kwargs)
    plugins: list[Any] = []
    kwargs: dict[str, Any] = {}
    if plan_path != "-":
        with open(plan_path) as f:
            plugins = [CoMPPrecision(PrecisionPlan.from_dict(json.load(f)))]
    else:
        kwargs["precision"] = precision
    trainer = pl.Trainer(max_steps=6, plugins=plugins, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[StepProfile()], **kwargs)
    trainer.fit(model, data)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "bf16-mixed", sys.argv[3] if len(sys.argv) > 3 else "gpt")
