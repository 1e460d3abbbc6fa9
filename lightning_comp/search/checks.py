"""Set-up checks of ``CoMPSearch``: everything that can be wrong is reported before an epoch is spent."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_comp.adapters import lightning_internals as lightning
from lightning_comp.devices.device_classes import DeviceClass, model_device
from lightning_comp.devices.emulation_speed import why_compute_stays_fp32
from lightning_comp.devices.lowering import Lowering, fp8_refusal, lowering_for
from lightning_comp.errors import PlanMismatchError, SearchConfigError, UnsupportedSetupError
from lightning_comp.numerics.precision import ComputePrecision, SavedPrecision
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.selectors import Selectors
from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.search.config import LowPrecision, SearchConfig
from lightning_comp.search.decisions.objectives import policy_for

__all__ = ["check_low_precision", "check_monitor", "check_optimization", "check_selectors", "check_trainer",
           "no_validation_at_trial_end", "nothing_to_search"]


def check_trainer(trainer: pl.Trainer, config: SearchConfig) -> CoMPPrecision:
    """The Trainer's CoMPPrecision plugin, once the Trainer is known to support a search.

    Raises:
        UnsupportedSetupError: without the plugin, or under a strategy whose state a search cannot rewind
            (DeepSpeed, XLA); FSDP1 and FSDP2 are searched.
        SearchConfigError: where validation cannot judge the trials.
    """
    plugin = trainer.precision_plugin
    if not isinstance(plugin, CoMPPrecision):
        raise UnsupportedSetupError(
            f"CoMPSearch needs the CoMPPrecision plugin, but the Trainer uses {type(plugin).__name__}"
            f" (precision={trainer.precision!r}). Use Trainer(plugins=[CoMPPrecision()], callbacks=[CoMPSearch()])"
            " and leave Trainer(precision=...) unset."
        )
    strategy = type(trainer.strategy).__name__
    if any(bad in strategy for bad in ("DeepSpeed", "XLA")):
        raise UnsupportedSetupError(
            f"CoMPSearch cannot run under {strategy}: it rewinds every trial to a snapshot of the model, optimizer and"
            " loop, which that strategy's state does not allow here. Use strategy='auto', 'ddp', FSDPStrategy (FSDP1)"
            " or ModelParallelStrategy (FSDP2) to search, then train with the plan it chose (saved in the checkpoint"
            " and as plan.json)."
        )
    if trainer.limit_val_batches == 0:
        raise SearchConfigError(
            f"CoMPSearch judges trials by a validation metric (monitor={config.monitor!r}), but"
            f" Trainer(limit_val_batches={trainer.limit_val_batches!r}) disables validation. Use"
            " limit_val_batches > 0 (a fraction or a number of batches)."
        )
    if config.trial_batches is not None and (
            trainer.check_val_every_n_epoch != 1 or lightning.val_check_time_interval(trainer) is not None):
        raise SearchConfigError(
            f"CoMPSearch(trial_batches={config.trial_batches}) validates inside the epoch and needs"
            f" Trainer(check_val_every_n_epoch=1) with a batch-count or fractional val_check_interval, not"
            f" check_val_every_n_epoch={trainer.check_val_every_n_epoch!r} /"
            f" val_check_interval={trainer.val_check_interval!r}. Or use whole-epoch trials (trial_batches=None)."
        )
    if trainer.check_val_every_n_epoch is not None and config.trial_epochs % trainer.check_val_every_n_epoch:
        raise SearchConfigError(
            f"CoMPSearch(trial_epochs={config.trial_epochs}) must be a multiple of"
            f" Trainer(check_val_every_n_epoch={trainer.check_val_every_n_epoch}), so each trial ends with a"
            " validation run."
        )
    return plugin


def check_optimization(pl_module: pl.LightningModule) -> None:
    """Refuse manual optimization: the batch stage runs ``training_step`` repeatedly on one batch, which under
    manual optimization would step the user's optimizers (and move ``global_step``) with every measurement.

    Raises:
        UnsupportedSetupError: naming the model and what works instead.
    """
    if not pl_module.automatic_optimization:
        raise UnsupportedSetupError(
            f"CoMPSearch cannot search {type(pl_module).__name__}: it uses manual optimization"
            " (automatic_optimization=False), and the search's batch stage runs training_step repeatedly, which"
            " would step your optimizers with every measurement. Train it with a fixed plan instead,"
            " Trainer(plugins=[CoMPPrecision(plan)]) without CoMPSearch, or use automatic optimization."
        )


def check_low_precision(config: SearchConfig, low: ComputePrecision | None, device: DeviceClass, plugin: CoMPPrecision,
                        starting: bool, where: torch.device | str) -> None:
    """Refuse FP16 where it is slow (unless the user insists); warn when an explicit precision is emulated; say why
    ``"auto"`` keeps compute in FP32 and searches the memory dimensions alone (``where``: the model's device).

    Raises:
        SearchConfigError: for ``low_precision='fp16'`` on a device without fast FP16.
    """
    if low is ComputePrecision.FP16 and not (plugin.allow_slow_fp16 or device.is_native(ComputePrecision.FP16)):
        raise SearchConfigError(
            f"CoMPSearch(low_precision='fp16') on {device.describe()}, which has no fast fp16 (a CPU's fp16"
            " convolution backward is ~100x slower than fp32). Use low_precision='auto' or 'bf16', or pass"
            " CoMPPrecision(allow_slow_fp16=True) to insist."
        )
    if low is not None and not device.is_native(low) and starting:
        rank_zero_warn(
            f"CoMPSearch(low_precision={config.low_precision.value!r}) on {device.describe()}, where"
            f" {low} is emulated: its trials run slower than fp32 and the batch stage will most likely"
            " keep fp32. low_precision='auto' skips the search on such a device."
        )
    if config.low_precision is LowPrecision.AUTO and low is ComputePrecision.FP32 and starting:
        rank_zero_info(f"CoMPSearch(objective={config.objective.value!r}): {why_compute_stays_fp32(device, where)}.")


def check_compiled(config: SearchConfig, plugin: CoMPPrecision) -> None:
    """Refuse an explicit request to search saved-for-backward precisions on a model compiled with ``torch.compile``
    (AOTAutograd decides what a compiled graph saves; ``precisions={"saved": "auto"}`` just leaves them out there).

    Raises:
        SearchConfigError: for ``precisions={"saved": "bf16"/"fp8"}`` or ``include_dimensions={"saved": [...]}``
            with a compiled model.
    """
    if not plugin.compiled or not policy_for(config).saved_options:
        return
    saved, forced = config.precisions[Dimension.SAVED], config.include_dimensions.get(Dimension.SAVED)
    if saved in (SavedPrecision.BF16, SavedPrecision.FP8) or forced:
        asked = (f"precisions={{'saved': {str(saved)!r}}}" if not forced
                 else f"include_dimensions={{'saved': {list(forced)!r}}}")
        raise SearchConfigError(
            f"CoMPSearch({asked}) on a model compiled with torch.compile: the precision of tensors saved for"
            " backward cannot be chosen inside a compiled graph (AOTAutograd decides what it saves). Use"
            " precisions={'saved': 'auto'} or 'off' (the search then leaves saved tensors as computed), or train"
            " the model uncompiled."
        )


def check_selectors(config: SearchConfig, pl_module: pl.LightningModule) -> None:
    """Fail on ``include``/``include_dimensions``/``exclude``/``include_fp8`` selectors that match no operator (a
    typo must not lower a layer), and on ``include_fp8`` selectors naming operators fp8 cannot compute.

    Raises:
        SearchConfigError: naming the selectors and the model's operators.
    """
    named = [("include", config.include), ("exclude", config.exclude), ("include_fp8", config.include_fp8)]
    named += [(f"include_dimensions[{str(d)!r}]", tuple(s)) for d, s in config.include_dimensions.items()]
    for name, given in named:
        if not given:
            continue
        try:
            Selectors.of(given).validate(pl_module)
        except PlanMismatchError as err:
            raise SearchConfigError(f"CoMPSearch({name}={list(given)!r}): {err}") from None
    if config.include_fp8:
        selectors = Selectors.of(config.include_fp8)
        refused = [f"{n} ({why})" for n, m in iter_operators(pl_module) if selectors.matches(n, m)
                   for why in (fp8_refusal(m),) if why is not None]
        if refused:
            raise SearchConfigError(f"CoMPSearch(include_fp8={list(config.include_fp8)!r}) names operators fp8 cannot"
                                    f" compute: {'; '.join(refused)}.")


def nothing_to_search(config: SearchConfig, low: ComputePrecision, pl_module: pl.LightningModule) -> str | None:
    """Why no operator can ever be a candidate (``None`` if some can)."""
    device = model_device(pl_module)
    operators = list(iter_operators(pl_module))
    if low is ComputePrecision.FP32:  # low_precision="off": the memory dimensions of any operator
        return None if operators else f"{type(pl_module).__name__} has no operator"
    lowerable = [(n, m) for n, m in operators if lowering_for(m, low, device) not in (None, Lowering.NONE)]
    if not lowerable:
        shown = ", ".join(f"{n or '<root>'} ({type(m).__name__})" for n, m in operators[:8])
        more = f", ... ({len(operators)} in all)" if len(operators) > 8 else ""
        return (f"{type(pl_module).__name__} has no operator that {low} can apply to on {device}"
                f" (its operators: {shown + more if shown else 'none'})")
    if all(config.excluded.matches(n, m) for n, m in lowerable):
        return f"every operator that {low} can apply to is excluded by CoMPSearch(exclude={list(config.exclude)!r})"
    return None


def check_monitor(config: SearchConfig, trainer: pl.Trainer) -> None:
    """Raise if the monitored metric was not logged in validation.

    Raises:
        SearchConfigError: naming the metrics that were logged.
    """
    metrics = trainer.callback_metrics
    if config.monitor not in metrics:
        available = sorted(k for k in metrics)
        raise SearchConfigError(
            f"CoMPSearch(monitor={config.monitor!r}) was not logged during validation; logged metrics are"
            f" {available or '(none)'}. Log it in validation_step with self.log({config.monitor!r}, ...)"
            " or set monitor= to one of those."
        )


def no_validation_at_trial_end(config: SearchConfig, trainer: pl.Trainer, last_epoch: int) -> SearchConfigError:
    """The error for a trial whose last epoch ended without the validation that judges it."""
    return SearchConfigError(
        f"CoMPSearch judges each trial by the validation metric {config.monitor!r} at the end of the"
        f" trial's last epoch, but no validation ran at the end of epoch {last_epoch}. Pass val_dataloaders"
        " to trainer.fit, keep Trainer(limit_val_batches) > 0 and validate at the end of every trial"
        f" (check_val_every_n_epoch must divide trial_epochs={config.trial_epochs}). Metrics logged so"
        f" far: {sorted(trainer.callback_metrics) or '(none)'}."
    )
