"""Every private Lightning attribute the package touches, checked against the installed Lightning: an upgrade that
renames or moves one fails here, by name, instead of silently mis-steering a search."""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Any

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.strategies import DDPStrategy
from packaging.requirements import Requirement

from lightning_comp.adapters import lightning_internals as adapter
from tests.helpers.models import TinyMLP, regression_loader


class _Probe(Callback):
    """Calls each adapter function from inside a real fit and records what it saw."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.current_epoch == 1 and batch_idx == 1:
            self.seen["batches_this_epoch"] = adapter.batches_done_this_epoch(trainer)
            self.seen["batches_total"] = adapter.batches_done_in_total(trainer)
            self.seen["epoch_length"] = adapter.epoch_length(trainer)
            self.seen["val_check_batch"] = adapter.val_check_batch(trainer)
            self.seen["time_interval"] = adapter.val_check_time_interval(trainer)
            self.seen["loaders"] = adapter.train_dataloaders(trainer)
            adapter.set_sampler_epochs(trainer, trainer.current_epoch)
            adapter.set_val_check_batch(trainer, 2)  # validate after this batch
            adapter.set_epoch_length(trainer, 2)  # and end the epoch there

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            where = (trainer.current_epoch, adapter.batches_done_this_epoch(trainer))
            self.seen.setdefault("validated_at", []).append(where)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen.setdefault("epoch_batches", []).append(adapter.batches_done_this_epoch(trainer))
        if trainer.current_epoch == 1:
            adapter.set_epoch_length(trainer, 4)


def _fit(probe: _Probe, **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", max_epochs=3, callbacks=[probe], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, **kwargs)
    trainer.fit(TinyMLP(), regression_loader(n=64, batch_size=16), regression_loader(n=32, batch_size=16))
    return trainer


def test_progress_validation_schedule_and_epoch_length_steer_a_real_fit() -> None:
    probe = _Probe()
    trainer = _fit(probe)
    seen = probe.seen
    assert seen["batches_this_epoch"] == 2 and seen["batches_total"] == 6  # 4 in epoch 0, 2 started in epoch 1
    assert seen["epoch_length"] == 4 and seen["val_check_batch"] == 4 and seen["time_interval"] is None
    assert len(seen["loaders"]) == 1 and isinstance(seen["loaders"][0], torch.utils.data.DataLoader)
    assert seen["epoch_batches"] == [4, 2, 4]  # epoch 1 was cut after its second batch, epoch 2 is whole again
    assert (1, 2) in seen["validated_at"]  # the moved validation ran after batch 2 of epoch 1
    assert trainer.global_step == 10


def test_time_based_validation_interval_is_seen() -> None:
    try:
        trainer = pl.Trainer(accelerator="cpu", val_check_interval="00:00:00:10", logger=False)
    except (TypeError, ValueError):  # Lightning < 2.6 has no time-based val_check_interval; nothing to see then
        assert adapter.val_check_time_interval(pl.Trainer(accelerator="cpu", logger=False)) is None
        pytest.skip(f"lightning {lightning.__version__} has no time-based val_check_interval")
    assert adapter.val_check_time_interval(trainer) is not None


def test_limits_extend_max_epochs_and_max_steps() -> None:
    trainer = pl.Trainer(accelerator="cpu", max_epochs=3, max_steps=7, logger=False)
    adapter.set_max_epochs(trainer, 5)
    adapter.set_max_steps(trainer, 9)
    assert trainer.fit_loop.max_epochs == trainer.max_epochs == 5
    assert trainer.fit_loop.max_steps == trainer.max_steps == 9


def test_callback_list_can_be_replaced_and_read() -> None:
    es = EarlyStopping(monitor="val_loss")
    trainer = pl.Trainer(accelerator="cpu", callbacks=[es], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    before = adapter.callbacks(trainer)
    assert es in before
    adapter.set_callbacks(trainer, [cb for cb in before if cb is not es])
    assert es not in trainer.callbacks  # type: ignore[attr-defined]
    assert es in before  # a copy was returned
    adapter.set_callbacks(trainer, before)
    assert list(adapter.iter_stateful_callbacks(trainer)) == [es]  # EarlyStopping has a state_dict


def test_fused_optimizers_are_recognised_as_unscaling_themselves() -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    assert not adapter.optimizer_handles_unscaling(torch.optim.SGD(params, lr=0.1))
    fused = torch.optim.Adam(params, lr=0.1, fused=True)
    assert adapter.optimizer_handles_unscaling(fused) == bool(getattr(fused, "_step_supports_amp_scaling", False))


def test_ddp_hook_registration_the_half_precision_strategy_overrides_still_exists() -> None:
    """``HalfPrecisionDDPStrategy`` overrides ``DDPStrategy._register_ddp_hooks`` and reads its comm attributes."""
    assert callable(getattr(DDPStrategy, "_register_ddp_hooks", None))
    assert list(inspect.signature(DDPStrategy._register_ddp_hooks).parameters) == ["self"]
    state, hook = object(), (lambda state, bucket: None)
    strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)
    assert adapter.ddp_comm_state(strategy) is state and adapter.ddp_comm_hook(strategy) is hook
    assert hasattr(strategy, "_ddp_comm_wrapper")  # the slot HalfPrecisionDDPStrategy refuses to share


@pytest.mark.slow
def test_a_model_handed_to_fit_compiled_is_seen() -> None:
    from lightning.pytorch.utilities.compile import _maybe_unwrap_optimized
    from torch import nn

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

    unwrapped = _maybe_unwrap_optimized(torch.compile(Module()))  # what Trainer.fit does with a compiled model
    assert adapter.compiled_by_lightning(unwrapped) and not adapter.compiled_by_lightning(Module())


def test_the_installed_lightning_is_in_the_supported_range() -> None:
    declared = importlib.metadata.requires("lightning-comp") or []  # pyproject.toml's dependencies, as installed
    requirement = next(Requirement(r) for r in declared if Requirement(r).name == "lightning")
    assert requirement.specifier.contains(lightning.__version__), (lightning.__version__, str(requirement))


@pytest.mark.parametrize("name", adapter.__all__)
def test_every_adapter_function_is_exported_and_documented(name: str) -> None:
    function = getattr(adapter, name)
    assert callable(function) and function.__doc__




def test_fsdp_activation_checkpointing_is_applied_as_lightning_does() -> None:
    from lightning.pytorch.strategies import FSDPStrategy
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    adapter.setup_fsdp_activation_checkpointing(FSDPStrategy(activation_checkpointing_policy={nn.Linear}), model)
    assert "0._checkpoint_wrapped_module" in dict(model.named_modules())
    assert type(model[1]).__name__ == "ReLU"


def test_the_forward_redirection_and_fsdp1s_flat_parameters_exist_where_the_package_reads_them() -> None:
    """``training_step_through_wrapper`` reroutes through ``Strategy._forward_redirection`` (a callable on every
    strategy); ``fsdp1_flat_parameters`` reads ``FullyShardedDataParallel._flat_param``. (Both run for real in the
    2-process search tests, ``tests/integration/test_search_sharded.py``.)"""
    from lightning.pytorch.strategies.strategy import _ForwardRedirection
    from torch.distributed.fsdp import FullyShardedDataParallel

    assert callable(getattr(DDPStrategy(), "_forward_redirection", None))
    assert callable(_ForwardRedirection())
    source = inspect.getsource(FullyShardedDataParallel)
    assert "_flat_param" in source
    assert adapter.fsdp1_wrapper(None, TinyMLP()) is None
