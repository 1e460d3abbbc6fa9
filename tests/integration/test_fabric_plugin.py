"""The Fabric plugin on the plan runtime it shares with the Trainer's: a checkpoint's plan comes back unless the
user's own is given (which wins, with the Trainer's warning naming both), a bf16-state step, a plan the model
rejects leaving the previous one."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_comp import CoMPFabricPrecision
from lightning_comp.errors import PlanMismatchError
from lightning_comp.numerics.precision import ComputePrecision


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))


def _fit(plugin: CoMPFabricPrecision, steps: int = 2, path: Path | None = None,
         load: Path | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = _model()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    if load is not None:
        fabric.load(load, {"model": model, "optimizer": optimizer, "comp": plugin})
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=data)
        fabric.backward(model(x).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    if path is not None:
        fabric.save(path, {"model": model, "optimizer": optimizer, "comp": plugin})
    return model, optimizer


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A Fabric checkpoint of two steps whose plan lowers the first Linear."""
    path = tmp_path / "fabric.ckpt"
    _fit(CoMPFabricPrecision({"0": "bf16"}), path=path)
    return path


def test_a_fabric_checkpoints_plan_comes_back_without_a_plan_of_the_users_own(checkpoint: Path) -> None:
    restored = CoMPFabricPrecision()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*checkpoint holds the plan.*")
        _fit(restored, steps=1, load=checkpoint)
    assert restored.plan["compute"].entries == (("0", ComputePrecision.BF16),)
    assert restored.optimizer_steps == 3 and restored.executor.precisions()["0"] is ComputePrecision.BF16


@pytest.mark.parametrize("how", ["constructor", "set_plan"])
def test_the_users_own_plan_wins_over_a_fabric_checkpoints_with_a_warning_naming_both(checkpoint: Path,
                                                                                      how: str) -> None:
    mine = {"2": "bf16"}
    plugin = CoMPFabricPrecision(mine) if how == "constructor" else CoMPFabricPrecision()
    if how == "set_plan":
        plugin.set_plan(mine)
    with pytest.warns(UserWarning, match="CoMPFabricPrecision: the checkpoint holds the plan") as caught:
        _fit(plugin, steps=1, load=checkpoint)
    message = next(str(w.message) for w in caught if "the checkpoint holds the plan" in str(w.message))
    assert "{'0': 'bf16', '<default>': 'fp32'}" in message and "{'2': 'bf16', '<default>': 'fp32'}" in message
    assert "is kept. Pass CoMPFabricPrecision() without a plan" in message
    assert plugin.plan["compute"].entries == (("2", ComputePrecision.BF16),)
    assert plugin.executor.precisions()["0"] is ComputePrecision.FP32 and plugin.optimizer_steps == 3


def test_the_same_plan_as_the_checkpoints_resumes_without_a_warning(checkpoint: Path) -> None:
    plugin = CoMPFabricPrecision({"0": "bf16"})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*checkpoint holds the plan.*")
        _fit(plugin, steps=1, load=checkpoint)


def test_bf16_state_is_stepped_by_the_runtime_under_fabric() -> None:
    plugin = CoMPFabricPrecision({"0": {"compute": "bf16", "state": "bf16"}})
    model, optimizer = _fit(plugin)
    first = next(iter(model.parameters()))
    assert optimizer.state[first]["exp_avg"].dtype == torch.bfloat16
    assert plugin.optimizer_steps == 2 and plugin.scaler is None and plugin.skipped_steps == 0


def test_a_plan_the_model_rejects_leaves_the_previous_one() -> None:
    plugin = CoMPFabricPrecision({"0": "bf16"})
    _fit(plugin, steps=1)
    with pytest.raises(PlanMismatchError):
        plugin.set_plan({"no_such_module": "bf16"})
    assert plugin.plan["compute"].entries == (("0", ComputePrecision.BF16),)
