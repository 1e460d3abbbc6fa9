"""What every measuring stage works with, held once: the run, the plugin, the settings, the step, the clock."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import lightning.pytorch as pl
from torch import nn

from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.decisions.objectives import ObjectivePolicy, policy_for
from lightning_comp.search.measurement.clocks import Clock
from lightning_comp.search.ranks import agree, reduce_mean
from lightning_comp.search.record.progress import SearchProgress

__all__ = ["Step", "StageContext"]

Step = Callable[[], None]  # one forward and backward of the user's training step on the stage's batch
T = TypeVar("T")


@dataclass(frozen=True)
class StageContext:
    """One batch stage's run, shared by the stages it calls (the saved and parameter stages).

    Attributes:
        trainer: the Trainer (every decision is agreed across its ranks).
        pl_module: the model.
        plugin: the plugin that puts each measured plan into effect.
        config: the search's settings.
        low: the 16-bit precision searched.
        step: one training step on the stage's batch.
        clock: the clock the stage measures with.
        modules: the model's operators by name.
        progress: where measured rounds are shown (``None``: nowhere).
        policy: the objective's policy (from ``config``).
    """

    trainer: pl.Trainer
    pl_module: pl.LightningModule
    plugin: CoMPPrecision
    config: SearchConfig
    low: ComputePrecision
    step: Step
    clock: Clock
    modules: dict[str, nn.Module]
    progress: SearchProgress | None = None
    policy: ObjectivePolicy = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", policy_for(self.config))

    @property
    def first_rounds(self) -> int:
        """The rounds of a first measurement, warm-up ones included."""
        return self.config.measurement.profile_warmup + self.config.measurement.profile_steps

    def agree(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        return agree(self.trainer, obj)

    def reduce_mean(self, value: float) -> float:
        """The mean of ``value`` over the ranks."""
        return reduce_mean(self.trainer, value)

    def measured(self, plan: PrecisionPlan, *, calibrated: bool = True) -> Callable[[], Any]:
        """What puts ``plan`` into effect for one measured step (see :meth:`CoMPPrecision.measured_step`)."""
        return functools.partial(self.plugin.measured_step, plan, calibrated=calibrated)

    def show_rounds(self, rounds: int, what: str) -> Callable[[], None] | None:
        """Extend the progress bar by ``rounds`` and return what to call after each round of ``what``."""
        if self.progress is None:
            return None
        self.progress.extend_stage(rounds)
        return functools.partial(self.progress.round_done, what)
