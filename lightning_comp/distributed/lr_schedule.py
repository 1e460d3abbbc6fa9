"""Learning rate that follows the number of data-parallel workers (Svyatkovskiy et al., 2017).

Synchronous data-parallel SGD over ``N`` workers with a per-worker batch ``b`` computes the same update as one
worker with a batch ``N * b``. A larger batch averages out gradient noise, so the step can grow; growing it linearly
with ``N`` (Goyal et al., 2017) eventually diverges. The FRNN code of the paper uses a saturating rule::

    lr(N, epoch) = min(lr_max, lr0 * N / (1 + N / n_half)) * gamma ** epoch

which is linear for ``N << n_half``, equals ``lr0 * n_half / 2`` at ``N = n_half`` and never exceeds ``lr_max``
or ``lr0 * n_half`` (the asymptote for ``N -> inf``). ``gamma`` is a per-epoch exponential decay.

:func:`worker_scaled_lr` is the pure formula; :class:`WorkerScaledLR` is the Lightning callback that applies it to
every optimizer step of any optimizer.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.hooks import RemovableHandle

from lightning_comp.errors import ConfigError

__all__ = ["WorkerScaledLR", "WorkerScaledLRConfig", "worker_scaled_lr"]


def _check_positive(name: str, value: float, *, allow_inf: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and not math.isnan(value)
    if ok and math.isinf(value) and not allow_inf:
        ok = False
    if not ok:
        valid = "a positive number (math.inf allowed)" if allow_inf else "a finite positive number"
        raise ConfigError(f"{name}={value!r} is invalid; expected {valid}.")


def _check_int(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r} is invalid; expected an integer >= {minimum}.")


def worker_scaled_lr(
    lr0: float,
    workers: int,
    epoch: int = 0,
    lr_max: float = 0.1,
    n_half: float = 100.0,
    gamma: float = 1.0,
) -> float:
    """Worker-aware learning rate ``min(lr_max, lr0 * N / (1 + N / n_half)) * gamma ** epoch``.

    Args:
        lr0: Learning rate tuned for one worker (positive, finite).
        workers: ``N``, the number of gradient contributions averaged per update (integer >= 1).
        epoch: Completed epochs (integer >= 0) for the ``gamma ** epoch`` decay.
        lr_max: Upper bound of the scaled rate before decay (positive; ``math.inf`` disables the cap).
        n_half: Worker count at which the scaling has fallen to half of linear (positive; ``math.inf`` gives
            plain linear scaling ``lr0 * N`` capped at ``lr_max``).
        gamma: Per-epoch decay factor in ``(0, 1]``; the paper uses 0.9 to 0.985.

    Returns:
        The effective learning rate.

    Raises:
        ConfigError: If an argument is outside the ranges above; the message names it.

    Example:
        >>> round(worker_scaled_lr(1e-3, 100), 6)
        0.05
        >>> worker_scaled_lr(1e-3, 10_000)  # plateau at lr_max
        0.1
    """
    _check_positive("lr0", lr0)
    _check_int("workers", workers, 1)
    _check_int("epoch", epoch, 0)
    _check_positive("lr_max", lr_max, allow_inf=True)
    _check_positive("n_half", n_half, allow_inf=True)
    _check_gamma(gamma)
    return min(lr_max, lr0 * workers / (1.0 + workers / n_half)) * gamma**epoch


def _check_gamma(gamma: float) -> None:
    if not isinstance(gamma, (int, float)) or isinstance(gamma, bool) or not 0.0 < gamma <= 1.0:
        raise ConfigError(f"gamma={gamma!r} is invalid; expected a number in (0, 1] (the paper uses 0.9 to 0.985).")


@dataclass(frozen=True)
class WorkerScaledLRConfig:
    """Validated settings of :class:`WorkerScaledLR` (see its docstring for the meaning of each field)."""

    lr_max: float = 0.1
    n_half: float = 100.0
    gamma: float = 1.0
    warmup_steps: int = 0
    workers: int | None = None

    def __post_init__(self) -> None:
        _check_positive("lr_max", self.lr_max, allow_inf=True)
        _check_positive("n_half", self.n_half, allow_inf=True)
        _check_gamma(self.gamma)
        _check_int("warmup_steps", self.warmup_steps, 0)
        if self.workers is not None:
            _check_int("workers", self.workers, 1)


class WorkerScaledLR(Callback):
    """Scale every optimizer's learning rate with the number of data-parallel workers.

    For each param group the callback remembers ``lr0``, the configured learning rate (``group["initial_lr"]`` if
    an LR scheduler has set it, else ``group["lr"]`` at the first optimizer step), and makes every optimizer step
    use::

        lr = lr_user(t) * worker_scaled_lr(lr0, N, epoch, lr_max, n_half, gamma) / lr0 * warmup(t)

    where ``lr_user(t)`` is whatever sits in ``group["lr"]`` at that moment: ``lr0`` when there is no scheduler.

    **Composition with your own LR scheduler (multiplicative).** The factor is applied in a
    ``torch.optim.Optimizer.register_step_pre_hook`` and removed again in a step post-hook, so ``group["lr"]``
    outside ``optimizer.step()`` always holds *your* scheduler's value, and any scheduler (closed-form, chained,
    ``ReduceLROnPlateau``) keeps working on its own numbers without compounding. Consequences: the optimizer state
    in checkpoints holds the unscaled rate, and ``LearningRateMonitor`` logs the unscaled rate; the rate actually
    used is in :attr:`last_lrs` (and logged as ``worker_scaled_lr/opt{i}-pg{j}`` with ``log_lr=True``). The
    ``lr_max`` cap applies to the scaled base ``lr0 * N / (1 + N / n_half)``, not to ``lr_user(t)``.

    **Why N counts gradient accumulation.** By default ``N = trainer.world_size * trainer.accumulate_grad_batches``:
    accumulating ``k`` micro-batches before a step averages ``k`` times more samples per update, exactly like ``k``
    times more workers, so the batch-size argument for scaling the rate applies equally. Pass ``workers=`` to fix
    ``N`` yourself (e.g. to keep single-worker rates while accumulating for memory).

    **Warm-up.** With ``warmup_steps = W > 0`` the factor grows linearly over the first ``W`` optimizer steps of
    each optimizer, from 1 (that is, ``lr0``, the rate a single worker is known to tolerate) to the full scaled
    value: step ``t`` (0-based) uses ``1 + (s - 1) * t / W`` where ``s`` is the full factor (Goyal et al.'s gradual
    warm-up). The paper's code instead uses a single worker's gradient for the first steps; scaling the rate is
    the equivalent that needs no change to the all-reduce.

    The remembered ``lr0`` values and the step counters are saved under the constant :attr:`state_key`, so
    ``fit(ckpt_path=...)`` resumes with the same bases and warm-up position even when a scheduler has moved
    ``group["lr"]`` away from ``lr0``. ``N`` is recomputed on resume, so a job restarted on a different number of
    workers gets the rate for its new size.

    Args:
        lr_max: Cap on the scaled rate before decay (> 0; ``math.inf`` = no cap).
        n_half: Worker count where the scaling reaches half of linear (> 0; ``math.inf`` = linear scaling).
        gamma: Per-epoch decay in ``(0, 1]``.
        warmup_steps: Optimizer steps of linear warm-up (integer >= 0).
        workers: Fixed ``N`` (integer >= 1); ``None`` derives it from the trainer.
        log_lr: Log the effective rate of every param group after each training batch.

    Raises:
        ConfigError: For an argument outside these ranges, or at the first step for a param group whose ``lr0`` is
            not positive.
    """

    def __init__(
        self,
        lr_max: float = 0.1,
        n_half: float = 100.0,
        gamma: float = 1.0,
        warmup_steps: int = 0,
        workers: int | None = None,
        log_lr: bool = False,
    ) -> None:
        super().__init__()
        self.config = WorkerScaledLRConfig(
            lr_max=lr_max, n_half=n_half, gamma=gamma, warmup_steps=warmup_steps, workers=workers
        )
        self.log_lr = log_lr
        self.base_lrs: list[list[float]] = []
        """``lr0`` per optimizer, per param group."""
        self.steps: list[int] = []
        """Optimizer steps taken, per optimizer (drives the warm-up)."""
        self.last_lrs: list[list[float]] = []
        """Effective rate used by the latest step, per optimizer, per param group."""
        self._workers = 1
        self.checkpoint_workers: int | None = None
        """``N`` of the run a loaded checkpoint was written by (``None`` without one)."""
        self._trainer: pl.Trainer | None = None
        self._handles: list[RemovableHandle] = []
        self._unscaled: dict[int, list[float]] = {}

    @property
    def state_key(self) -> str:
        """Constant key, so a checkpoint stays loadable whatever the constructor arguments."""
        return "WorkerScaledLR"

    @property
    def workers(self) -> int:
        """``N`` used for the current fit."""
        return self._workers

    def resolve_workers(self, trainer: "pl.Trainer") -> int:
        """``N``: the ``workers`` argument, else ``trainer.world_size * trainer.accumulate_grad_batches``."""
        if self.config.workers is not None:
            return self.config.workers
        return int(trainer.world_size) * int(trainer.accumulate_grad_batches)

    def factor(self, optimizer_idx: int, group_idx: int, epoch: int) -> float:
        """Multiplier applied to ``group["lr"]`` at the next step of that optimizer (warm-up included)."""
        lr0 = self.base_lrs[optimizer_idx][group_idx]
        cfg = self.config
        full = worker_scaled_lr(lr0, self._workers, epoch, cfg.lr_max, cfg.n_half, cfg.gamma) / lr0
        step = self.steps[optimizer_idx]
        if step < cfg.warmup_steps:
            return 1.0 + (full - 1.0) * step / cfg.warmup_steps
        return full

    # ------------------------------------------------------------------ Lightning hooks

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Resolve ``N`` and attach the step hooks to every optimizer."""
        self._trainer = trainer
        self._workers = self.resolve_workers(trainer)
        if self.checkpoint_workers is not None and self.checkpoint_workers != self._workers:
            rank_zero_warn(
                f"WorkerScaledLR: the checkpoint was trained with N={self.checkpoint_workers} workers, this run has"
                f" N={self._workers} (world_size x accumulate_grad_batches), so its learning rate changes. Pass"
                f" WorkerScaledLR(workers={self.checkpoint_workers}) to keep the checkpoint's schedule."
            )
        self._remove_hooks()
        for idx, optimizer in enumerate(trainer.optimizers):
            self._handles.append(optimizer.register_step_pre_hook(self._make_pre_hook(idx)))
            self._handles.append(optimizer.register_step_post_hook(self._make_post_hook(idx)))

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the effective rates when ``log_lr`` is set."""
        if not self.log_lr:
            return
        for i, group_lrs in enumerate(self.last_lrs):
            for j, lr in enumerate(group_lrs):
                pl_module.log(f"worker_scaled_lr/opt{i}-pg{j}", lr, on_step=True, on_epoch=False)

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Detach the step hooks."""
        self._remove_hooks()

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Detach the step hooks even if fit stopped with an exception."""
        self._remove_hooks()

    def state_dict(self) -> dict[str, Any]:
        """Plain-python state (safe for ``weights_only`` loading)."""
        return {
            "base_lrs": [list(b) for b in self.base_lrs],
            "steps": list(self.steps),
            "workers": self._workers,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the remembered ``lr0`` values, step counters and the ``N`` the checkpoint trained with.

        A fit resumed with another number of workers warns (at its start): its learning rate differs from the one
        the checkpoint's run used.
        """
        self.base_lrs = [[float(lr) for lr in group] for group in state_dict.get("base_lrs", [])]
        self.steps = [int(s) for s in state_dict.get("steps", [0] * len(self.base_lrs))]
        workers = state_dict.get("workers")
        self.checkpoint_workers = None if workers is None else int(workers)

    # ------------------------------------------------------------------ optimizer hooks

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _remember_bases(self, idx: int, optimizer: torch.optim.Optimizer) -> None:
        while len(self.base_lrs) <= idx:
            self.base_lrs.append([])
        while len(self.steps) < len(self.base_lrs):
            self.steps.append(0)
        while len(self.last_lrs) < len(self.base_lrs):
            self.last_lrs.append([])
        bases = self.base_lrs[idx]
        for j in range(len(bases), len(optimizer.param_groups)):
            group = optimizer.param_groups[j]
            lr0 = float(group.get("initial_lr", group["lr"]))
            if not (lr0 > 0 and math.isfinite(lr0)):
                raise ConfigError(
                    f"Optimizer {idx} param group {j} has learning rate {lr0!r}; WorkerScaledLR needs a finite "
                    "positive configured rate to scale."
                )
            bases.append(lr0)

    def _make_pre_hook(self, idx: int) -> Callable[..., None]:
        def pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if idx in self._unscaled:  # the previous step raised before the post-hook: undo it first
                _set_lrs(optimizer, self._unscaled.pop(idx))
            self._remember_bases(idx, optimizer)
            epoch = self._trainer.current_epoch if self._trainer is not None else 0
            unscaled = [float(group["lr"]) for group in optimizer.param_groups]
            effective = [lr * self.factor(idx, j, epoch) for j, lr in enumerate(unscaled)]
            _set_lrs(optimizer, effective)
            self._unscaled[idx] = unscaled
            self.last_lrs[idx] = effective

        return pre_hook

    def _make_post_hook(self, idx: int) -> Callable[..., None]:
        def post_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            unscaled = self._unscaled.pop(idx, None)
            if unscaled is None:
                return
            _set_lrs(optimizer, unscaled)
            self.steps[idx] += 1

        return post_hook


def _set_lrs(optimizer: torch.optim.Optimizer, lrs: list[float]) -> None:
    """Write one rate per param group, in place for tensor rates (capturable/fused optimizers)."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
