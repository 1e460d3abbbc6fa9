"""``saved="recompute"`` on the real Lightning Trainer path: the forward runs in ``train_step_context``, backward in
the plugin's ``backward`` after it; training ends at the same weights as without recompute."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_comp import CoMPPrecision
from tests.helpers.models import MixedNet, TinyMLP, regression_loader, token_loader


class _CountCalls(pl.Callback):
    """Counts the forwards of some modules (recomputations in backward included) and what steps save."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.calls = dict.fromkeys(names, 0)
        self._handles: list[Any] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        modules = dict(pl_module.named_modules())
        for name in self.names:
            self._handles.append(modules[name].register_forward_hook(self._count(name)))

    def _count(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.calls[name] += 1

        return hook

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()


def _fit(model: pl.LightningModule, plan: dict[str, Any], loader: Any, kwargs: dict[str, Any],
         names: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], _CountCalls]:
    counter = _CountCalls(names)
    trainer = pl.Trainer(plugins=[CoMPPrecision(plan)], max_steps=3, callbacks=[counter], **kwargs)
    trainer.fit(model, loader)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, counter


def test_a_recomputed_relu_trains_to_the_same_weights(fast_trainer_kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    first = TinyMLP()
    second = copy.deepcopy(first)
    plain, _ = _fit(first, {}, regression_loader(), fast_trainer_kwargs, ("net.1",))
    recomputed, counter = _fit(second, {"net.1": {"saved": "recompute"}}, regression_loader(), fast_trainer_kwargs,
                               ("net.1",))
    assert counter.calls["net.1"] == 3 * 2  # each step's forward, and one recomputation in its backward
    assert plain.keys() == recomputed.keys() and all(torch.equal(plain[k], recomputed[k]) for k in plain)


@pytest.mark.slow
def test_a_recomputed_norm_and_activation_in_bf16_train_to_the_same_weights(
        fast_trainer_kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    first = MixedNet()
    second = copy.deepcopy(first)
    plan: dict[str, Any] = {"type:Module": "bf16"}
    recompute = {**plan, "bn": {"compute": "bf16", "saved": "recompute"},
                 "act": {"compute": "bf16", "saved": "recompute"}, "ln": {"compute": "bf16", "saved": "recompute"}}
    plain, _ = _fit(first, plan, token_loader(), fast_trainer_kwargs)
    recomputed, counter = _fit(second, recompute, token_loader(), fast_trainer_kwargs, ("bn", "act", "ln"))
    # The first step hands every output on in fp32 (its cast boundaries are being traced) and each consumer casts
    # it down again: those casts are recipes too ("recompute, then cast"), so every step's backward recomputes each
    # operator once (bn as act's input, ln for head, act for fc through Flatten's reshape and for its own backward).
    assert counter.calls == {"bn": 3 * 2, "act": 3 * 2, "ln": 3 * 2}
    assert plain.keys() == recomputed.keys()
    assert all(torch.equal(plain[k], recomputed[k]) for k in plain)  # the BatchNorm's running statistics too
    assert int(recomputed["bn.num_batches_tracked"]) == 3
