"""Every private Lightning attribute lightning-comp reads or writes, in one place.

The search has to steer Lightning's fit loop (extend ``max_epochs``/``max_steps``, cut an epoch short, validate in
the middle of one, re-seed samplers after a rewind), the plugin has to know whether a fused optimizer unscales
itself and whether Lightning unwrapped a compiled model, and the half-precision DDP strategy registers its
communication hook where Lightning's own method would not (``DDPStrategy._register_ddp_hooks``, which it overrides).
Lightning has no public API for these, so each access is a small function here, and
``tests/unit/test_lightning_internals.py`` checks every one of them against the installed Lightning, so an upgrade
that moves one fails loudly in one named test instead of silently mis-steering a search. Supported range: see
``pyproject.toml`` (``lightning>=2.4,<2.7``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

__all__ = [
    "batches_done_this_epoch",
    "batches_done_in_total",
    "callbacks",
    "compiled_by_lightning",
    "ddp_comm_hook",
    "ddp_comm_state",
    "epoch_length",
    "fsdp1_flat_parameters",
    "fsdp1_wrapper",
    "iter_stateful_callbacks",
    "optimizer_handles_unscaling",
    "set_callbacks",
    "set_epoch_length",
    "set_max_epochs",
    "set_max_steps",
    "set_sampler_epochs",
    "set_val_check_batch",
    "setup_fsdp_activation_checkpointing",
    "training_step_through_wrapper",
    "train_dataloaders",
    "val_check_batch",
    "val_check_time_interval",
]


# ------------------------------------------------------------------------------------------------ fit loop limits
def set_max_epochs(trainer: pl.Trainer, max_epochs: int) -> None:
    """Set the fit loop's ``max_epochs`` (public attribute of ``FitLoop``)."""
    trainer.fit_loop.max_epochs = max_epochs


def set_max_steps(trainer: pl.Trainer, max_steps: int) -> None:
    """Set ``max_steps``: ``FitLoop.max_steps`` is a read-only view of the epoch loop's attribute."""
    trainer.fit_loop.epoch_loop.max_steps = max_steps


def epoch_length(trainer: pl.Trainer) -> int | float:
    """Batches the current epoch will run (``FitLoop.max_batches``, ``inf`` for an iterable without length)."""
    length = trainer.fit_loop.max_batches
    return float("inf") if length is None else length


def set_epoch_length(trainer: pl.Trainer, batches: int | float) -> None:
    """End the current epoch after ``batches`` batches (``FitLoop.max_batches``; reset at the next epoch)."""
    trainer.fit_loop.max_batches = batches


def batches_done_this_epoch(trainer: pl.Trainer) -> int:
    """Training batches started in the current epoch (``epoch_loop.batch_progress.current.ready``)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def batches_done_in_total(trainer: pl.Trainer) -> int:
    """Training batches started since the fit began (``epoch_loop.batch_progress.total.ready``)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)


# ------------------------------------------------------------------------------------------------------ validation
def val_check_batch(trainer: pl.Trainer) -> int | float | None:
    """After how many batches the epoch loop validates (``Trainer.val_check_batch``, set by the data connector)."""
    return trainer.val_check_batch


def set_val_check_batch(trainer: pl.Trainer, batches: int | float | None) -> None:
    """Validate after ``batches`` batches (``Trainer.val_check_batch``)."""
    trainer.val_check_batch = batches


def val_check_time_interval(trainer: pl.Trainer) -> Any:
    """``Trainer._val_check_time_interval`` (a time-based ``val_check_interval``), ``None`` where there is none."""
    return getattr(trainer, "_val_check_time_interval", None)


# ----------------------------------------------------------------------------------------------------- dataloaders
def train_dataloaders(trainer: pl.Trainer) -> list[Any]:
    """The fit loop's training dataloaders (``FitLoop._combined_loader.flattened``), empty before they exist."""
    loader = getattr(trainer.fit_loop, "_combined_loader", None)
    return list(getattr(loader, "flattened", None) or [])


def set_sampler_epochs(trainer: pl.Trainer, epoch: int) -> None:
    """Tell every training dataloader's (distributed) sampler the epoch, as Lightning does at an epoch start."""
    for dataloader in train_dataloaders(trainer):
        _set_sampler_epoch(dataloader, epoch)


# --------------------------------------------------------------------------------------------------------- callbacks
def callbacks(trainer: pl.Trainer) -> list[Callback]:
    """A copy of ``trainer.callbacks`` (set in ``Trainer.__init__``; unknown to type checkers)."""
    return list(trainer.callbacks)  # type: ignore[attr-defined]


def set_callbacks(trainer: pl.Trainer, new: list[Callback]) -> None:
    """Replace ``trainer.callbacks`` (a hook loop that is running keeps iterating the list it started with)."""
    trainer.callbacks = new  # type: ignore[attr-defined]


def iter_stateful_callbacks(trainer: pl.Trainer) -> Iterator[Callback]:
    """The Trainer's callbacks that have state of their own (a non-empty ``state_dict()``)."""
    for callback in callbacks(trainer):
        if callback.state_dict():
            yield callback


# ------------------------------------------------------------------------------------------------------- precision
def optimizer_handles_unscaling(optimizer: Any) -> bool:
    """Whether ``optimizer`` unscales gradients itself (a fused optimizer with ``_step_supports_amp_scaling``)."""
    return bool(_optimizer_handles_unscaling(optimizer))


def compiled_by_lightning(module: Any) -> bool:
    """Whether Lightning unwrapped ``module`` from ``torch.compile`` when it was handed to ``fit`` compiled (it keeps
    the compile settings in ``LightningModule._compiler_ctx``)."""
    return getattr(module, "_compiler_ctx", None) is not None


# ------------------------------------------------------------------------------------------------------------- DDP
def ddp_comm_hook(strategy: DDPStrategy) -> Any:
    """The communication hook handed to ``DDPStrategy(ddp_comm_hook=...)`` (``DDPStrategy._ddp_comm_hook``)."""
    return strategy._ddp_comm_hook


def ddp_comm_state(strategy: DDPStrategy) -> Any:
    """The state handed to ``DDPStrategy(ddp_comm_state=...)`` (``DDPStrategy._ddp_comm_state``)."""
    return strategy._ddp_comm_state


def setup_fsdp_activation_checkpointing(strategy: Any, model: Any) -> None:
    """Apply an ``FSDPStrategy``'s activation checkpointing to its wrapped ``model`` as Lightning's own model set-up
    does (``lightning.pytorch.strategies.fsdp._setup_activation_checkpointing`` with the strategy's
    ``_activation_checkpointing_kwargs``)."""
    from lightning.pytorch.strategies.fsdp import _setup_activation_checkpointing

    _setup_activation_checkpointing(model, strategy._activation_checkpointing_kwargs)


def training_step_through_wrapper(trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> Any:
    """``pl_module.training_step(*args)`` run through the strategy's wrapped model, as Lightning's own training step
    runs it (``Strategy._forward_redirection``: the wrapper's ``forward`` is entered, so FSDP1 unshards its flat
    parameters around the step and reduce-scatters their gradients in backward)."""
    strategy = trainer.strategy
    redirect = getattr(strategy, "_forward_redirection", None)
    if redirect is None:
        from lightning.pytorch.strategies.strategy import _ForwardRedirection

        redirect = _ForwardRedirection()
    return redirect(strategy.model, pl_module, "training_step", *args)  # type: ignore[arg-type]


def fsdp1_wrapper(trainer: pl.Trainer | None, pl_module: Any) -> Any:
    """The FSDP1 ``FullyShardedDataParallel`` wrapping ``pl_module`` in ``trainer``'s strategy, or ``None``."""
    if trainer is None:
        return None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - a torch without distributed
        return None
    model = getattr(getattr(trainer, "strategy", None), "model", None)  # (a stand-in Trainer may have no strategy)
    return model if isinstance(model, FullyShardedDataParallel) else None


def fsdp1_flat_parameters(wrapper: Any) -> dict[str, Any]:
    """The flat parameters of every FSDP1 unit in ``wrapper`` (``FullyShardedDataParallel._flat_param``, private
    in torch), by the unit's module name: between steps, each holds this rank's shard of the parameters it flattens."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = {id(m): name for name, m in wrapper.named_modules() if isinstance(m, FullyShardedDataParallel)}
    return {f"{units[id(unit)]}._flat_param": unit._flat_param
            for unit in FullyShardedDataParallel.fsdp_modules(wrapper) if unit._flat_param is not None}
