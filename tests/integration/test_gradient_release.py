"""CoMPPrecision(release_gradients_after_step=...): gradients are freed right after each optimizer step (not held
through the next step's forward), training bit-identical either way, gradient accumulation included."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_comp import CoMPPrecision
from lightning_comp.errors import ConfigError
from tests.helpers.models import TinyMLP

_PLANS: dict[str, dict[str, Any]] = {
    "bf16 compute": {"type:Linear": "bf16"},
    "managed state and masters": {"net.0": {"compute": "bf16", "state": "8bit", "master": "bf16"},
                                  "net.2": {"state": "bf16"}},
}


class _AdamMLP(TinyMLP):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _GradientWatch(pl.Callback):
    """Which parameters hold a gradient when each training batch starts, and before each optimizer step."""

    def __init__(self) -> None:
        self.at_batch_start: list[int] = []
        self.before_step: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.at_batch_start.append(sum(p.grad is not None for p in pl_module.parameters()))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.before_step.append(sum(p.grad is not None for p in pl_module.parameters()))


def _fit(model: TinyMLP, loader: Any, trainer_kwargs: dict[str, Any], plan: dict[str, Any], release: bool,
         accumulate: int = 1) -> _GradientWatch:
    watch = _GradientWatch()
    plugin = CoMPPrecision(plan, release_gradients_after_step=release)
    pl.Trainer(max_steps=4, accumulate_grad_batches=accumulate, plugins=[plugin], callbacks=[watch],
               **trainer_kwargs).fit(model, loader)
    return watch


@pytest.mark.parametrize("plan", list(_PLANS), ids=list(_PLANS))
def test_gradients_are_released_after_each_step_and_training_is_bit_identical(
        plan: str, make_regression_loader: Any, fast_trainer_kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    released = _AdamMLP()
    kept = copy.deepcopy(released)
    params = len(list(released.parameters()))
    watch_released = _fit(released, make_regression_loader(), fast_trainer_kwargs, _PLANS[plan], release=True)
    watch_kept = _fit(kept, make_regression_loader(), fast_trainer_kwargs, _PLANS[plan], release=False)

    assert watch_released.at_batch_start == [0, 0, 0, 0]  # nothing held into the next forward
    assert watch_kept.at_batch_start == [0, params, params, params]  # Lightning's own loop: held until zero_grad
    assert watch_released.before_step == watch_kept.before_step == [params] * 4  # the step sees every gradient
    for (name, a), b in zip(released.state_dict().items(), kept.state_dict().values()):
        assert torch.equal(a, b), name


def test_accumulated_gradients_survive_until_the_step(make_regression_loader: Any,
                                                      fast_trainer_kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    released = _AdamMLP()
    kept = copy.deepcopy(released)
    params = len(list(released.parameters()))
    watch = _fit(released, make_regression_loader(), fast_trainer_kwargs, _PLANS["bf16 compute"], release=True,
                 accumulate=2)
    _fit(kept, make_regression_loader(), fast_trainer_kwargs, _PLANS["bf16 compute"], release=False, accumulate=2)

    # micro-batches 0, 2, 4, 6 start a step's accumulation; 1, 3, 5, 7 add to the gradients of the one before
    assert watch.at_batch_start == [0, params] * 4
    assert watch.before_step == [params] * 4
    for (name, a), b in zip(released.state_dict().items(), kept.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_release_gradients_after_step_must_be_a_bool(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"release_gradients_after_step=.*True or False"):
        CoMPPrecision(release_gradients_after_step=bad)
