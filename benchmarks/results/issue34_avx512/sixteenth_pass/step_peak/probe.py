"""What a training step's peak holds, and where it is.

Run from the repository root: ``python .../step_peak/probe.py timeline|categories PLAN_JSON|- PRECISION MODEL``
(``-``: no plugin, Lightning's ``PRECISION``; MODEL a key of ``benchmarks/compare_suite.py``'s suite). Step 5 of a fit
is probed. ``timeline``: glibc's heap in use after every dispatched op, with the phase (forward, backward,
optimizer) and the innermost module running; the peak and the jumps that lead to it. ``categories``: torch.profiler's
memory profile, live tensor bytes by category at the step's peak.
"""

from __future__ import annotations

import collections
import json
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_comp.zoo as zoo
from lightning_comp import CoMPPrecision
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.measurement.process_memory import heap_in_use, set_malloc_thresholds

sys.path.insert(0, "benchmarks")
from compare_suite import SUITE  # noqa: E402

STACK: list[str] = []
NAMES: dict[int, str] = {}
MIB = 2**20


def _pre(module: torch.nn.Module, args: Any) -> None:
    STACK.append(NAMES.get(id(module), type(module).__name__))


def _post(module: torch.nn.Module, args: Any, out: Any) -> None:
    if STACK:
        STACK.pop()


class Probe(TorchDispatchMode):
    """Samples the heap after every op."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[tuple[int, str, str]] = []
        self.phase = "fwd"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(getattr(func, "overloadpacket", func).__name__)
        self.samples.append((heap_in_use() or 0, self.phase, f"{name}@{STACK[-1] if STACK else '-'}"))
        return out


class StepProbe(pl.Callback):
    """Probes batch 4 and stops the fit."""

    def __init__(self) -> None:
        self.probe: Probe | None = None
        self.base = 0

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, i: int) -> None:
        if i == 4:
            self.probe, self.base = Probe(), heap_in_use() or 0
            self.probe.__enter__()

    def on_before_backward(self, trainer: pl.Trainer, module: pl.LightningModule, loss: Any) -> None:
        if self.probe:
            self.probe.phase = "bwd"

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, opt: Any) -> None:
        if self.probe:
            self.probe.phase = "opt"

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, out: Any, batch: Any,
                           i: int) -> None:
        if not self.probe:
            return
        self.probe.__exit__(None, None, None)
        s, self.probe = self.probe.samples, None

        def mib(value: int) -> float:
            return round((value - self.base) / MIB, 2)

        peak = max(range(len(s)), key=lambda k: s[k][0])
        fwd_end = max((k for k in range(len(s)) if s[k][1] == "fwd"), default=0)
        print("ops", len(s), "peak at op", peak, s[peak][1], s[peak][2], "rise MiB", mib(s[peak][0]),
              "| at forward end", mib(s[fwd_end][0]), "| max in bwd", mib(max(x[0] for x in s if x[1] == "bwd")))
        jumps = [(k, s[k][2], round((s[k][0] - s[k - 1][0]) / MIB, 2), mib(s[k][0])) for k in range(1, peak + 1)
                 if abs(s[k][0] - s[k - 1][0]) > 0.4 * MIB]
        print("jumps to the peak:", jumps[-25:])
        trainer.should_stop = True


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


def main(what: str, plan_path: str, precision: str, key: str) -> None:
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
    probe: pl.Callback = StepProfile()
    if what == "timeline":
        set_malloc_thresholds()
        torch.nn.modules.module.register_module_forward_pre_hook(_pre)
        torch.nn.modules.module.register_module_forward_hook(_post)
        NAMES.update({id(m): n for n, m in model.named_modules()})
        probe = StepProbe()
    trainer = pl.Trainer(max_steps=6, plugins=plugins, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[probe], **kwargs)
    trainer.fit(model, data)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], args[2] if len(args) > 2 else "bf16-mixed", args[3] if len(args) > 3 else "gpt")
