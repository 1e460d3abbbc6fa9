"""Defects found by reading the search and the plugin, each pinned by a test that failed before its fix."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import TinyMLP, regression_loader
from lightning.pytorch.utilities import rank_zero_only
from search_models import WideMLP, fixed_search, loaders, search_trainer
from torch import nn

from lightning_comp import CoMPPrecision, PlanError, PrecisionPlan, WorkerScaledLR
from lightning_comp.devices import DeviceClass
from lightning_comp.errors import UnsupportedSetupError
from lightning_comp.portability import check_plan_device


def _quiet(**kwargs: Any) -> dict[str, Any]:
    return dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False, **kwargs)


# ------------------------------------------------------------------------------------------ manual optimization
class _Manual(WideMLP):
    def __init__(self) -> None:
        super().__init__(width=32)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_manual_optimization_is_refused_at_setup_before_any_step(tmp_path: Path) -> None:
    """The batch stage would call training_step (which steps the optimizer) once per measurement."""
    model = _Manual()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = search_trainer(tmp_path, [fixed_search(warmup_epochs=0)], max_epochs=2, plugin=CoMPPrecision())
    train, val = loaders(n_train=128, n_val=64, batch_size=32)
    with pytest.raises(UnsupportedSetupError, match=r"_Manual: it uses manual optimization .*CoMPPrecision\(plan\)"):
        trainer.fit(model, train, val)
    assert trainer.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# --------------------------------------------------------------------------------------------- state versions
def test_plugin_state_of_another_version_or_with_unknown_keys_is_refused() -> None:
    plugin = CoMPPrecision()
    state = {"version": 1, "plan": PrecisionPlan().to_dict(), "scaler": None}
    plugin.load_state_dict(state)  # the current version loads
    with pytest.raises(PlanError, match=r"CoMPPrecision state of version 7.*reads 1"):
        plugin.load_state_dict({**state, "version": 7})
    with pytest.raises(PlanError, match=r"Unknown keys \['extra'\] in a CoMPPrecision state"):
        plugin.load_state_dict({**state, "extra": 1})


def test_worker_scaled_lr_loads_the_workers_it_saved_and_warns_when_they_change() -> None:
    saved = WorkerScaledLR(workers=8)
    saved._workers = 8  # as after a fit on 8 workers
    state = saved.state_dict()
    resumed = WorkerScaledLR()
    resumed.load_state_dict(state)
    assert resumed.checkpoint_workers == 8
    trainer = pl.Trainer(max_steps=1, callbacks=[resumed], **_quiet())
    with pytest.warns(UserWarning, match=r"trained with N=8 workers, this run has N=1 .*workers=8"):
        trainer.fit(TinyMLP(), regression_loader())


# ------------------------------------------------------------------------------------------- rank-zero warnings
def test_plan_warnings_are_raised_on_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DDP every rank applies the plan: its warnings must not be printed once per rank."""
    emulated = DeviceClass("cpu", name="test", capability="AVX2", emulated=frozenset({"bf16", "fp16"}))
    model = TinyMLP()
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        message = check_plan_device(PrecisionPlan.for_model(model, {"net.2": "bf16"}), model, emulated)
    assert message is not None and "emulated" in message  # decided on every rank, printed on rank 0 only
    assert not [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    with pytest.warns(UserWarning, match="emulated"):
        check_plan_device(PrecisionPlan.for_model(model, {"net.0": "bf16"}), model, emulated)
