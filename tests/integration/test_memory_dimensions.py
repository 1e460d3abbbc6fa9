"""Optimizer-state, master-weight and recompute dimensions through the real Lightning Trainer: training, the plan in
the checkpoint, and a bit-exact resume with every dimension in use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_comp import CoMPPrecision
from lightning_comp.errors import UnsupportedSetupError
from lightning_comp.numerics import ComputePrecision
from tests.helpers.models import WEIGHTS_ONLY
from tests.helpers.search_models import Classifier
from tests.scripts.fault_run import fixed_loaders


class Block(Classifier):
    """``l1`` (Linear 64->256) -> ``act`` (GELU) -> ``l2`` (Linear 256->256) -> ``norm`` -> ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(64, 256)
        self.act = nn.GELU()
        self.l2 = nn.Linear(256, 256)
        self.norm = nn.LayerNorm(256)
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.l2(self.act(self.l1(x)))))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


EVERY_DIMENSION = {
    "l1": {"compute": "bf16", "state": "8bit", "master": "bf16"},
    "act": {"compute": "bf16", "saved": "recompute"},
    "l2": {"compute": "bf16", "state": "bf16", "master": "bf16", "saved": "fp8"},
    "norm": {"master": "bf16"},  # computes in fp32, with fp32 copies of its bf16 parameters
    "head": {"state": "8bit", "master": "bf16"},  # the same, with 8-bit moments (too small: kept fp32)
}


def _trainer(root: Path, plugin: CoMPPrecision, **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("max_epochs", 1)
    return pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(root), num_sanity_val_steps=0,
                      limit_val_batches=2, **kwargs)


def _fit(root: Path, plan: Any, ckpt_path: Path | None = None, update_path: str = "auto",
         **kwargs: Any) -> tuple[pl.Trainer, Block]:
    pl.seed_everything(0)
    model = Block()
    trainer = _trainer(root, CoMPPrecision(plan, update_path=update_path), **kwargs)
    train, val = fixed_loaders(n_train=512, n_val=128, batch_size=64)  # the same batches after a resume
    trainer.fit(model, train, val, ckpt_path=ckpt_path, **WEIGHTS_ONLY)
    return trainer, model


class Dtypes(pl.Callback):
    """The parameters' dtypes while training."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.seen = {name: p.dtype for name, p in pl_module.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("update_path", ["eager", "compiled", "native"])
def test_every_dimension_trains_through_the_trainer(tmp_path: Path, update_path: str) -> None:
    dtypes = Dtypes()
    trainer, model = _fit(tmp_path / "comp", EVERY_DIMENSION, max_epochs=2, callbacks=[dtypes],
                          update_path=update_path)
    assert dtypes.seen["l1.weight"] == torch.bfloat16 and dtypes.seen["l2.bias"] == torch.bfloat16
    assert dtypes.seen["head.weight"] == torch.bfloat16 and dtypes.seen["norm.weight"] == torch.bfloat16
    assert trainer.precision_plugin.plan.of("compute", "head") is ComputePrecision.FP32
    # the model handed back computes in fp32 again, with the bf16 values it trained to
    assert model.l1.weight.dtype == torch.float32
    assert torch.equal(model.l1.weight, model.l1.weight.bfloat16().float())
    state = trainer.optimizers[0].state
    assert state[model.l1.weight]["exp_avg"].dtype == torch.uint8
    assert state[model.l2.weight]["exp_avg"].dtype == torch.bfloat16
    assert state[model.head.weight]["exp_avg"].dtype == torch.float32  # 2560 elements: too small to quantise
    assert state[model.norm.weight]["exp_avg"].dtype == torch.float32  # state not named
    reference, _ = _fit(tmp_path / "fp32", None, max_epochs=2)
    ours, fp32 = float(trainer.callback_metrics["val_loss"]), float(reference.callback_metrics["val_loss"])
    assert ours < 0.9 * 2.3026  # it learned (chance is ln 10)
    assert ours == pytest.approx(fp32, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("update_path", ["eager", "compiled", "native"])
def test_resume_with_every_dimension_is_bit_exact(tmp_path: Path, update_path: str) -> None:
    """Four epochs straight, against two epochs, a checkpoint, and two more in a fresh Trainer and model: the same
    weights (bf16 masters included), optimizer states (8-bit codes and scales) and stochastic-rounding stream, on
    every update path (the compiled and native ones' rounding is a function of the step the optimizer state holds)."""
    straight_trainer, straight = _fit(tmp_path / "straight", EVERY_DIMENSION, max_epochs=4, update_path=update_path)
    updates = straight_trainer.precision_plugin._runtime.optimizer_states.updates
    assert (updates.compiled_steps > 0) == (update_path == "compiled")
    assert (updates.native_steps > 0) == (update_path == "native")
    first, _ = _fit(tmp_path / "first", EVERY_DIMENSION, max_epochs=2, update_path=update_path)
    ckpt = tmp_path / "first.ckpt"
    first.save_checkpoint(ckpt)
    stored = torch.load(ckpt, weights_only=True)
    assert stored["lightning_comp"]["plan"]["master"] == {"l1": "bf16", "l2": "bf16", "norm": "bf16", "head": "bf16"}
    assert stored["lightning_comp"]["rounding"]  # the generator that rounds bf16 masters
    resumed_trainer, resumed = _fit(tmp_path / "resumed", None, ckpt_path=ckpt, max_epochs=4, update_path=update_path)
    assert resumed_trainer.precision_plugin.plan["state"] == straight_trainer.precision_plugin.plan["state"]
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    ours, theirs = resumed_trainer.optimizers[0].state, straight_trainer.optimizers[0].state
    for a, b in zip(straight.parameters(), resumed.parameters()):
        for key, value in theirs[a].items():
            assert torch.equal(value, ours[b][key]), key


def test_other_optimizers_are_refused_by_name(tmp_path: Path) -> None:
    class WithSGD(Block):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    pl.seed_everything(0)
    trainer = _trainer(tmp_path, CoMPPrecision({"l1": {"state": "8bit"}}), max_steps=1)
    train, val = fixed_loaders(n_train=128, n_val=64, batch_size=64)
    with pytest.raises(UnsupportedSetupError, match="SGD steps parameter 'l1.weight'"):
        trainer.fit(WithSGD(), train, val)


@pytest.mark.parametrize("update_path", ["eager", "native", pytest.param("compiled", marks=pytest.mark.slow)])
def test_a_fabric_loop_trains_and_resumes_bit_exactly_with_state_and_master_precisions(tmp_path: Path,
                                                                                        update_path: str) -> None:
    """Fabric loads the checkpoint before the plugin meets the optimizer: the load casts the 8-bit and BF16 moments
    to the parameters' dtype, and the first step after it must put them back losslessly and take the path (and the
    random bits) the uninterrupted run took there."""
    from lightning.fabric import Fabric

    from lightning_comp import CoMPFabricPrecision

    plan = {"0": {"compute": "bf16", "state": "8bit", "master": "bf16"}, "2": {"state": "bf16"}}
    data = torch.Generator().manual_seed(3)
    batches = [(torch.randn(32, 64, generator=data), torch.randint(0, 10, (32,), generator=data)) for _ in range(6)]

    def setup(plugin: CoMPFabricPrecision) -> tuple[Fabric, Any, Any]:
        torch.manual_seed(0)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))
        model = fabric.setup_module(net)
        return fabric, model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))

    def train(fabric: Fabric, model: Any, optimizer: Any, steps: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in steps:
            fabric.backward(nn.functional.cross_entropy(model(x).float(), y))
            optimizer.step()
            optimizer.zero_grad()

    plugin = CoMPFabricPrecision(plan, update_path=update_path)
    fabric, model, optimizer = setup(plugin)
    train(fabric, model, optimizer, batches)
    assert optimizer.state[model.module[0].weight]["exp_avg"].dtype == torch.uint8
    assert model.module[0].weight.dtype == torch.bfloat16

    first_plugin = CoMPFabricPrecision(plan, update_path=update_path)
    first, first_model, first_optimizer = setup(first_plugin)
    train(first, first_model, first_optimizer, batches[:3])
    first.save(tmp_path / "fabric.ckpt", {"model": first_model, "optimizer": first_optimizer, "comp": first_plugin})
    restored = CoMPFabricPrecision(update_path=update_path)  # the checkpoint's plan comes back
    second, second_model, second_optimizer = setup(restored)
    second.load(tmp_path / "fabric.ckpt", {"model": second_model, "optimizer": second_optimizer, "comp": restored})
    train(second, second_model, second_optimizer, batches[3:])
    for a, b in zip(model.parameters(), second_model.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    updates = restored._runtime.optimizer_states.updates
    steps = {path: getattr(updates, f"{path}_steps") for path in ("native", "compiled")}
    assert {path for path, count in steps.items() if count} == ({update_path} - {"eager"})  # resumed on its path


def test_an_optimizer_that_needs_its_closure_keeps_it_when_no_parameter_is_managed(tmp_path: Path) -> None:
    """LBFGS evaluates the closure inside ``step``: a plan without state/master entries goes Lightning's own way."""
    class WithLBFGS(Block):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)

    pl.seed_everything(0)
    trainer = _trainer(tmp_path, CoMPPrecision({"l1": "bf16"}), max_steps=2)
    train, val = fixed_loaders(n_train=128, n_val=64, batch_size=64)
    trainer.fit(WithLBFGS(), train, val)
    assert trainer.global_step == 2
