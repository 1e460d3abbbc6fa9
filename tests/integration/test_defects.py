"""Defects found by reading the search and the plugin, each pinned by a test that failed before its fix."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

from lightning_comp import CoMPPrecision, PlanError, PrecisionPlan
from lightning_comp.devices.device_classes import DeviceClass
from lightning_comp.distributed import WorkerScaledLR
from lightning_comp.errors import UnsupportedSetupError
from lightning_comp.execution.emulation import check_plan_device
from tests.helpers.models import TinyMLP, regression_loader
from tests.helpers.search_models import WideMLP, fixed_search, loaders, search_trainer


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
    state = {"version": 1, "plan": PrecisionPlan().to_dict(), "scaler": None, "skipped_steps": 0,
             "optimizer_steps": 0, "rounding": None}
    plugin.load_state_dict(state)  # the current version loads
    with pytest.raises(PlanError, match=r"missing keys \['skipped_steps'\]"):
        plugin.load_state_dict({k: v for k, v in state.items() if k != "skipped_steps"})  # one format: every key
    with pytest.raises(PlanError, match=r"CoMPPrecision state of version 7.*reads 1"):
        plugin.load_state_dict({**state, "version": 7})
    with pytest.raises(PlanError, match=r"Unknown keys \['extra'\] in a CoMPPrecision state"):
        plugin.load_state_dict({**state, "extra": 1})


def test_worker_scaled_lr_loads_the_workers_it_saved_and_warns_when_they_change(
        fast_trainer_kwargs: dict[str, Any]) -> None:
    state = {"base_lrs": [[0.05]], "steps": [3], "workers": 8}  # what a run on 8 workers saved
    resumed = WorkerScaledLR()
    resumed.load_state_dict(state)
    assert resumed.checkpoint_workers == 8
    trainer = pl.Trainer(max_steps=1, callbacks=[resumed], **fast_trainer_kwargs)
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


# ---------------------------------------------------------------------------------------- the user's own limits
@pytest.mark.slow
def test_a_second_fit_on_the_same_trainer_does_not_extend_twice(tmp_path: Path) -> None:
    pl.seed_everything(0)
    search = fixed_search()  # "all candidates" fails on l3: one epoch is given back through max_epochs
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=CoMPPrecision())
    train, val = loaders(n_train=512, n_val=128)
    model = WideMLP(width=64)
    trainer.fit(model, train, val)
    record = search.record
    assert record is not None and record["extension_epochs"] >= 1
    extended, steps = trainer.max_epochs, trainer.global_step
    assert extended == 3 + record["extension_epochs"]
    trainer.fit(model, train, val)  # nothing left to train: the user asked for 3 epochs, the search gave back its own
    assert trainer.max_epochs == extended and trainer.global_step == steps


# -------------------------------------------------------------------------------------------- copies of models
def test_a_deep_copy_of_a_hooked_model_computes_with_its_own_weights() -> None:
    """An EMA or teacher model deep-copied during training carries the plan's hooks: they must use its weights."""
    model = TinyMLP()
    plugin = CoMPPrecision({"type:Linear": "bf16"})
    plugin.convert_module(model)
    x = torch.randn(4, 8)
    with plugin.train_step_context():
        teacher = copy.deepcopy(model)
        with torch.no_grad():
            for param in teacher.parameters():
                param.zero_()
        out = teacher(x)
    assert torch.equal(out, torch.zeros_like(out))  # the original's weights would give a non-zero output
    assert all(p.abs().sum() > 0 for p in model.parameters())


def test_the_model_returned_by_fit_carries_no_hooks(fast_trainer_kwargs: dict[str, Any]) -> None:
    model = TinyMLP()
    plugin = CoMPPrecision({"type:Linear": "bf16"})
    pl.Trainer(max_steps=2, plugins=[plugin], **fast_trainer_kwargs).fit(model, regression_loader())
    copy_ = copy.deepcopy(model)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in (*model.modules(), *copy_.modules()))
    assert plugin.executor.precisions()["net.0"].is_low  # the plan is still there to inspect
    x = torch.randn(4, 8)
    assert torch.equal(model(x), copy_(x))


# ------------------------------------------------------------------------------------------- profiled memory
class _BigWeights(WideMLP):
    """512-wide layers on batches of 8: a bf16 weight copy (512 KiB) dwarfs the activations saved for backward."""

    def __init__(self) -> None:
        super().__init__(width=512, offset=False)


@pytest.mark.slow
def test_profiled_saved_bytes_exclude_weight_copies_that_training_recasts(tmp_path: Path) -> None:
    pl.seed_everything(0)
    search = fixed_search(include=["l2"], exclude=["l1", "l3", "l4", "head", "a?"], warmup_epochs=0,
                          measurement={"profile_steps": 1, "profile_warmup": 0})
    trainer = search_trainer(tmp_path, [search], max_epochs=1, plugin=CoMPPrecision(), limit_train_batches=4)
    train, val = loaders(n_train=64, n_val=16, batch_size=8)
    trainer.fit(_BigWeights(), train, val)
    record = search.record
    assert record is not None
    l2 = record["operators"]["l2"]
    weight_copy = 512 * 512 * 2
    # in bf16, l2 saves its bf16 input (8 x 512 x 2 bytes), not a 512 KiB weight copy: training re-casts the
    # weight in backward (recast_weights_in_backward), so the profile must not charge it. (Its input stays bf16 from
    # the ReLU before it, which saves the same tensor first: what l2 saves itself is its own_saved_bytes.)
    assert 0 < l2["low"]["own_saved_bytes"] < weight_copy / 4, l2
    assert l2["low"]["saved_bytes"] < weight_copy / 4, l2


# ------------------------------------------------------------------------------------------------ DDP agreement
class _TwoRanks:
    """A stand-in for a 2-rank strategy: ``reduce(mean)`` averages with the other rank's values."""

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other
        self.root_device = torch.device("cpu")

    def reduce(self, values: torch.Tensor, reduce_op: str) -> torch.Tensor:
        assert reduce_op == "mean"
        return (values + self.other) / 2


def test_profiles_are_averaged_over_ranks_bytes_included() -> None:
    """Under objective="memory" ranks decide from saved bytes: they must see the same numbers, or they pick
    different candidates and then time different plans (mismatched collectives)."""
    from lightning_comp.search.measurement.profiling import OperatorMeasurement, ProfileResult
    from lightning_comp.search.ranks import reduce_profile

    mine = ProfileResult({"a": OperatorMeasurement(forward_ms=1.0, backward_ms=2.0, compute_ms=0.5, saved_bytes=100)})
    other = torch.tensor([[3.0, 4.0, 1.5, 300.0]], dtype=torch.float64)  # forward, backward, compute, bytes
    trainer = type("T", (), {"world_size": 2, "strategy": _TwoRanks(other)})()
    reduce_profile(trainer, {"low": mine})  # type: ignore[arg-type]
    m = mine.operators["a"]
    assert (m.forward_ms, m.backward_ms, m.compute_ms, m.saved_bytes) == (2.0, 3.0, 1.0, 200)


# ------------------------------------------------------------------------------------ activation checkpointing
class _Checkpointed(pl.LightningModule):
    """``head(checkpoint(l2(act(l1(x)))))``: the block is re-run in backward; it records its dtypes each time."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.act, self.l2, self.head = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 1)
        self.seen: list[tuple[torch.dtype, ...]] = []

    def block(self, x: torch.Tensor) -> torch.Tensor:
        h1 = self.l1(x)
        h2 = self.act(h1)
        h3 = self.l2(h2)
        self.seen.append((h1.dtype, h2.dtype, h3.dtype))
        return h3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_activation_checkpointing_recomputes_the_dtypes_of_the_forward(
        fast_trainer_kwargs: dict[str, Any]) -> None:
    model = _Checkpointed()
    plugin = CoMPPrecision({"l1": "bf16", "act": "bf16", "l2": "bf16"})
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # the recompute runs the whole block
        pl.Trainer(max_steps=3, plugins=[plugin], **fast_trainer_kwargs).fit(model, regression_loader())
    dtypes = model.seen
    assert len(dtypes) == 6  # forward and recompute of 3 steps
    for forward, recompute in zip(dtypes[0::2], dtypes[1::2]):
        assert forward == recompute, dtypes
    # after the calibrating first step, l1 -> act -> l2 chain in bf16 inside the block; l2 hands fp32 to the head
    bf16, fp32 = torch.bfloat16, torch.float32
    assert dtypes[2] == dtypes[4] == (bf16, bf16, fp32)
    assert all(p.grad is None or p.grad.dtype == fp32 for p in model.parameters())
