"""Tests for the worker-aware learning-rate schedule (formula, Trainer path, composition, resume)."""

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_comp.distributed.lr_schedule import WorkerScaledLR, WorkerScaledLRConfig, worker_scaled_lr

LR0 = 0.01
BATCHES_PER_EPOCH = 4

# ---------------------------------------------------------------------------------------------- formula


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        (1, 1e-3 * 1 / 1.01),
        (8, 1e-3 * 8 / 1.08),
        (32, 1e-3 * 32 / 1.32),
        (100, 0.05),  # half of linear at N = n_half
        (1000, 1e-3 * 1000 / 11),
    ],
)
def test_formula_values(workers: int, expected: float) -> None:
    assert worker_scaled_lr(1e-3, workers) == pytest.approx(expected, rel=1e-12)


def test_formula_plateaus_at_lr_max() -> None:
    assert worker_scaled_lr(0.01, 1000) == pytest.approx(0.1)
    assert worker_scaled_lr(0.01, 10**6) == pytest.approx(0.1)
    assert worker_scaled_lr(0.01, 1000, lr_max=1.0) == pytest.approx(0.01 * 1000 / 11)  # below a looser cap


def test_formula_gamma_decay_per_epoch() -> None:
    base = worker_scaled_lr(1e-3, 8)
    assert [worker_scaled_lr(1e-3, 8, e, gamma=0.9) for e in range(4)] == pytest.approx(
        [base * 0.9**e for e in range(4)]
    )


def test_formula_linear_limit() -> None:
    assert worker_scaled_lr(1e-3, 32, n_half=math.inf) == pytest.approx(0.032)
    assert worker_scaled_lr(1e-3, 1000, n_half=math.inf) == pytest.approx(0.1)  # capped
    assert worker_scaled_lr(1e-3, 1000, n_half=math.inf, lr_max=math.inf) == pytest.approx(1.0)


@settings(max_examples=60, deadline=None)
@given(
    lr0=st.floats(1e-6, 1.0),
    n=st.integers(1, 10_000),
    n_half=st.floats(1.0, 1e4),
    epoch=st.integers(0, 50),
    gamma=st.floats(0.5, 1.0),
)
def test_formula_bounds_and_monotone(lr0: float, n: int, n_half: float, epoch: int, gamma: float) -> None:
    lr = worker_scaled_lr(lr0, n, 0, lr_max=0.1, n_half=n_half)
    assert lr <= 0.1 * (1 + 1e-12)
    assert lr <= lr0 * n * (1 + 1e-12)  # never above linear scaling
    assert worker_scaled_lr(lr0, n + 1, 0, lr_max=0.1, n_half=n_half) >= lr  # more workers never lower it
    assert worker_scaled_lr(lr0, n, epoch, lr_max=0.1, n_half=n_half, gamma=gamma) == pytest.approx(lr * gamma**epoch)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr0": 0.0}, "lr0"),
        ({"lr0": float("nan")}, "lr0"),
        ({"workers": 0}, "workers"),
        ({"workers": 2.5}, "workers"),
        ({"workers": True}, "workers"),
        ({"epoch": -1}, "epoch"),
        ({"lr_max": -0.1}, "lr_max"),
        ({"lr_max": 0.0}, "lr_max"),
        ({"n_half": 0}, "n_half"),
        ({"gamma": 1.5}, "gamma"),
        ({"gamma": 0.0}, "gamma"),
    ],
)
def test_formula_rejects_bad_arguments(kwargs: dict[str, Any], name: str) -> None:
    args: dict[str, Any] = {"lr0": 1e-3, "workers": 4, "epoch": 0} | kwargs
    with pytest.raises(ValueError, match=rf"{name}=.*expected"):
        worker_scaled_lr(**args)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 1.5}, "warmup_steps"),
        ({"workers": 0}, "workers"),
        ({"gamma": 2.0}, "gamma"),
        ({"n_half": -5}, "n_half"),
    ],
)
def test_callback_rejects_bad_arguments(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name}=.*expected"):
        WorkerScaledLR(**kwargs)


def test_config_is_frozen() -> None:
    cfg = WorkerScaledLRConfig()
    with pytest.raises(AttributeError):
        cfg.gamma = 0.5  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- Trainer path


class RecordingSGD(torch.optim.SGD):
    """SGD that records the learning rate each step actually uses (after the step pre-hooks ran)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.used: list[float] = []

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.used.append(float(self.param_groups[0]["lr"]))
        return super().step(closure)


class TinyModule(pl.LightningModule):
    def __init__(self, lr: float = LR0, step_lr_gamma: float | None = None) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.lr = lr
        self.step_lr_gamma = step_lr_gamma
        self.opt: RecordingSGD | None = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        self.opt = RecordingSGD(self.parameters(), lr=self.lr)
        if self.step_lr_gamma is None:
            return self.opt
        scheduler = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=self.step_lr_gamma)
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * BATCHES_PER_EPOCH, 4, generator=g), torch.randn(4 * BATCHES_PER_EPOCH, 2))
    return DataLoader(data, batch_size=4)


def _fit(
    callback: WorkerScaledLR,
    module: TinyModule,
    max_epochs: int = 2,
    ckpt_path: str | Path | None = None,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        **trainer_kwargs,
    )
    trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    return trainer


def test_trainer_applies_scaled_lr_and_epoch_decay() -> None:
    callback = WorkerScaledLR(workers=8, gamma=0.5)
    module = TinyModule()
    _fit(callback, module)
    scaled = worker_scaled_lr(LR0, 8)
    assert module.opt is not None
    assert module.opt.used == pytest.approx([scaled] * BATCHES_PER_EPOCH + [scaled * 0.5] * BATCHES_PER_EPOCH)
    assert callback.last_lrs == [[pytest.approx(scaled * 0.5)]]
    # Outside optimizer.step() the group keeps the configured (unscaled) rate.
    assert module.opt.param_groups[0]["lr"] == pytest.approx(LR0)


def test_default_workers_count_gradient_accumulation() -> None:
    callback = WorkerScaledLR()
    module = TinyModule()
    _fit(callback, module, max_epochs=1, accumulate_grad_batches=2)
    assert callback.workers == 2  # world_size 1 * accumulate 2
    assert module.opt is not None
    assert module.opt.used == pytest.approx([worker_scaled_lr(LR0, 2)] * (BATCHES_PER_EPOCH // 2))


def test_linear_warmup_from_lr0() -> None:
    callback = WorkerScaledLR(workers=8, warmup_steps=4)
    module = TinyModule()
    _fit(callback, module, max_epochs=2)
    s = worker_scaled_lr(LR0, 8) / LR0
    expected = [LR0 * (1 + (s - 1) * t / 4) for t in range(4)] + [LR0 * s] * 4
    assert module.opt is not None
    assert module.opt.used == pytest.approx(expected)
    assert callback.steps == [8]


def test_composes_multiplicatively_with_user_scheduler() -> None:
    callback = WorkerScaledLR(workers=32)
    module = TinyModule(step_lr_gamma=0.1)
    _fit(callback, module, max_epochs=3)
    scaled = worker_scaled_lr(LR0, 32)
    expected = [scaled * 0.1**e for e in range(3) for _ in range(BATCHES_PER_EPOCH)]
    assert module.opt is not None
    assert module.opt.used == pytest.approx(expected)
    # The scheduler saw only its own numbers: no compounding of the worker factor.
    assert module.opt.param_groups[0]["lr"] == pytest.approx(LR0 * 0.1**3)
    assert callback.base_lrs == [[pytest.approx(LR0)]]


def test_resume_restores_base_lr_and_schedule(tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {"workers": 8, "gamma": 0.5, "warmup_steps": 6}
    full_cb, full = WorkerScaledLR(**kwargs), TinyModule(step_lr_gamma=0.1)
    _fit(full_cb, full, max_epochs=2)

    first_cb, first = WorkerScaledLR(**kwargs), TinyModule(step_lr_gamma=0.1)
    trainer = _fit(first_cb, first, max_epochs=1)
    ckpt = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["callbacks"]["WorkerScaledLR"]
    assert saved == {"base_lrs": [[LR0]], "steps": [BATCHES_PER_EPOCH], "workers": 8}

    resumed_cb = WorkerScaledLR(**kwargs)
    resumed = TinyModule(lr=0.3, step_lr_gamma=0.1)  # a different configured rate must not leak in
    _fit(resumed_cb, resumed, max_epochs=2, ckpt_path=ckpt)
    assert resumed_cb.base_lrs == [[pytest.approx(LR0)]]
    assert resumed_cb.steps == [2 * BATCHES_PER_EPOCH]
    assert first.opt is not None and resumed.opt is not None and full.opt is not None
    assert first.opt.used + resumed.opt.used == pytest.approx(full.opt.used)


def test_restored_base_wins_over_current_group_lr() -> None:
    # A scheduler-moved rate at resume time must be scaled relative to the stored lr0, not to itself.
    callback = WorkerScaledLR(workers=8)
    callback.load_state_dict({"base_lrs": [[LR0]], "steps": [0], "workers": 8})
    module = TinyModule(lr=0.05)
    _fit(callback, module, max_epochs=1)
    assert module.opt is not None
    assert module.opt.used == pytest.approx([0.05 * worker_scaled_lr(LR0, 8) / LR0] * BATCHES_PER_EPOCH)


def test_rejects_non_positive_configured_lr() -> None:
    with pytest.raises(ValueError, match=r"param group 0 has learning rate 0\.0"):
        _fit(WorkerScaledLR(workers=2), TinyModule(lr=0.0), max_epochs=1)


class ManualModule(TinyModule):
    """Manual optimization: the user calls ``opt.step()`` themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


def test_manual_optimization() -> None:
    callback = WorkerScaledLR(workers=8, gamma=0.5)
    module = ManualModule()
    _fit(callback, module)
    scaled = worker_scaled_lr(LR0, 8)
    assert module.opt is not None
    assert module.opt.used == pytest.approx([scaled] * BATCHES_PER_EPOCH + [scaled * 0.5] * BATCHES_PER_EPOCH)


def test_tensor_learning_rate_is_updated_in_place() -> None:
    callback = WorkerScaledLR(workers=32)
    module = TinyModule(lr=torch.tensor(LR0))  # type: ignore[arg-type]
    _fit(callback, module, max_epochs=1)
    assert module.opt is not None
    lr = module.opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and float(lr) == pytest.approx(LR0)
    assert module.opt.used == pytest.approx([worker_scaled_lr(LR0, 32)] * BATCHES_PER_EPOCH)


def test_log_lr_logs_effective_rate() -> None:
    callback = WorkerScaledLR(workers=8, log_lr=True)
    trainer = _fit(callback, TinyModule(), max_epochs=1)
    assert float(trainer.callback_metrics["worker_scaled_lr/opt0-pg0"]) == pytest.approx(worker_scaled_lr(LR0, 8))


class FailingOnceSGD(RecordingSGD):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail = True

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.fail:
            self.fail = False
            raise RuntimeError("boom")
        return super().step(closure)


def test_failed_step_does_not_compound_the_factor() -> None:
    # Without a Trainer: on_fit_start only needs the optimizers, world size, accumulation and the epoch.
    opt = FailingOnceSGD(nn.Linear(2, 1).parameters(), lr=LR0)
    callback = WorkerScaledLR(workers=8)
    fake_trainer = SimpleNamespace(optimizers=[opt], world_size=1, accumulate_grad_batches=1, current_epoch=0)
    callback.on_fit_start(fake_trainer, None)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(worker_scaled_lr(LR0, 8))  # post-hook never ran
    opt.step()
    assert opt.used == [pytest.approx(worker_scaled_lr(LR0, 8))]
    assert opt.param_groups[0]["lr"] == pytest.approx(LR0)
    assert callback.steps == [1]
    callback.on_fit_end(fake_trainer, None)  # type: ignore[arg-type]
    opt.step()
    assert opt.used[-1] == pytest.approx(LR0)  # hooks detached
