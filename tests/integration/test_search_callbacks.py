"""CoMPSearch next to the user's EarlyStopping: the search's trials are not judged by it.

Without the pause, EarlyStopping(check_finite=True) stops the fit on the NaN validation of a trial that the search
rejects anyway, and the model ends with the rejected trial's weights; with ``patience`` it counts rewound trials.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint

from lightning_comp import CoMPPrecision, CoMPSearch
from lightning_comp.search.rewind.pause import CallbackPause
from tests.helpers.search_models import FragileMLP, WideMLP, fixed_search, loaders, search_trainer


class _EarlyStoppingProbe(Callback):
    """Per validation outside the sanity check: epoch, metric, search phase, and whether ``es`` is in the Trainer."""

    def __init__(self, search: CoMPSearch, es: EarlyStopping) -> None:
        self.search, self.es = search, es
        self.rows: list[dict[str, Any]] = []
        self.best_at_epoch_start: list[float] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.best_at_epoch_start.append(float(self.es.best_score))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.rows.append({"epoch": trainer.current_epoch, "val_loss": float(trainer.callback_metrics["val_loss"]),
                          "phase": self.search.phase, "es_active": self.es in trainer.callbacks})


@pytest.mark.slow
@pytest.mark.parametrize("trial_batches", [None, 2])
def test_early_stopping_does_not_stop_the_fit_on_a_rejected_nan_trial(tmp_path: Path,
                                                                     trial_batches: int | None) -> None:
    pl.seed_everything(0)
    search = fixed_search(include=["l2", "bad"], exclude=["l1", "head", "a?"], trial_batches=trial_batches)
    es = EarlyStopping(monitor="val_loss", mode="min", patience=1, check_finite=True)
    probe = _EarlyStoppingProbe(search, es)
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp_path, [search, es, probe], max_epochs=3, plugin=plugin)
    order = list(trainer.callbacks)
    train, val = loaders()
    trainer.fit(FragileMLP(), train, val)
    record = search.record
    assert record is not None, "the fit ended before the search did"
    assert any(t["verdict"] == "fail" and "NaN" in t["reason"] for t in record["trials"])
    assert plugin.plan.of("compute", "bad", torch.nn.Linear).value == "fp32"
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
    # the fit ran its epochs, extended by the rejected trials: nothing stopped it early
    assert es.stopped_epoch == 0 and not trainer.should_stop
    assert trainer.current_epoch == 3 + record["extension_epochs"]
    # EarlyStopping saw the warm-up and the epochs after the search, never a trial's NaN
    nan_rows = [r for r in probe.rows if not math.isfinite(r["val_loss"])]
    assert nan_rows and not any(r["es_active"] for r in nan_rows)
    assert probe.rows[0]["es_active"] and probe.rows[-1]["es_active"]
    assert math.isfinite(float(es.best_score))
    # and the Trainer got its callbacks back in their order
    assert trainer.callbacks == order


@pytest.mark.slow
def test_early_stopping_state_survives_a_crash_inside_the_search(tmp_path: Path) -> None:
    """Lightning writes no state for a paused callback; the search carries it in its own and hands it back."""
    pl.seed_everything(0)
    es = EarlyStopping(monitor="val_loss", mode="min", patience=5)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)

    class Crash(Callback):
        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.current_epoch == 2:
                raise RuntimeError("simulated crash")

    trainer = search_trainer(tmp_path, [fixed_search(), es, Crash(), checkpoint], max_epochs=4,
                             plugin=CoMPPrecision())
    order = list(trainer.callbacks)
    train, val = loaders(n_train=1024)
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.fit(WideMLP(width=256), train, val)
    assert trainer.callbacks == order  # handed back after the exception too
    warmup_best = float(es.best_score)
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    search_state = ckpt["callbacks"]["CoMPSearch"]
    assert search_state["phase"] == "searching" and es.state_key not in ckpt["callbacks"]
    assert float(search_state["paused_callbacks"][es.state_key]["best_score"]) == warmup_best

    resumed_es = EarlyStopping(monitor="val_loss", mode="min", patience=5)
    search = fixed_search()
    probe = _EarlyStoppingProbe(search, resumed_es)
    resumed = search_trainer(tmp_path, [search, resumed_es, probe], max_epochs=4, plugin=CoMPPrecision())
    train, val = loaders(n_train=1024)
    resumed.fit(WideMLP(width=256), train, val, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert search.phase == "done"
    assert probe.best_at_epoch_start[0] == warmup_best  # not a fresh EarlyStopping (inf)
    assert resumed_es in resumed.callbacks


class _Named(Callback):
    def __init__(self, name: str, value: int = 0) -> None:
        self.name, self.value = name, value

    @property
    def state_key(self) -> str:
        return self.name

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = state_dict["value"]


class _FakeTrainer:
    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = callbacks


def test_callback_pause_takes_out_and_puts_back_in_place() -> None:
    a, b, c = _Named("a"), _Named("b", value=1), _Named("c")
    trainer: Any = _FakeTrainer([a, b, c])
    before = trainer.callbacks
    pause = CallbackPause(lambda cb: getattr(cb, "name", "") == "b")
    pause.pause(trainer, states={"b": {"value": 7}, "other": {"value": 9}})
    assert trainer.callbacks == [a, c] and before == [a, b, c]  # a new list: a running hook loop keeps its own
    assert pause.active and pause.paused == [b] and b.value == 7
    assert pause.states() == {"b": {"value": 7}}
    pause.pause(trainer)  # already paused: nothing changes
    assert trainer.callbacks == [a, c]
    d = _Named("d")
    trainer.callbacks = [*trainer.callbacks, d]
    pause.resume(trainer)
    assert trainer.callbacks == [a, b, c, d] and not pause.active and pause.states() == {}
    pause.resume(trainer)  # nothing paused: nothing changes
    assert trainer.callbacks == [a, b, c, d]


def test_callback_pause_without_a_match_leaves_the_list_alone() -> None:
    trainer: Any = _FakeTrainer([_Named("a")])
    before = trainer.callbacks
    pause = CallbackPause(lambda cb: isinstance(cb, EarlyStopping))
    pause.pause(trainer)
    assert trainer.callbacks is before and not pause.active


@pytest.mark.slow
def test_a_fit_stopped_inside_the_search_warns_that_the_trial_is_unjudged(tmp_path: Path) -> None:
    class StopInTrial(Callback):
        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.current_epoch == 2:  # the first candidate trial (epoch 1 is the FP32 reference)
                trainer.should_stop = True

    pl.seed_everything(0)
    search = fixed_search()
    es = EarlyStopping(monitor="val_loss", patience=5)
    trainer = search_trainer(tmp_path, [search, es, StopInTrial()], max_epochs=4, plugin=CoMPPrecision())
    order = list(trainer.callbacks)
    train, val = loaders(n_train=1024)
    with pytest.warns(UserWarning, match="training stopped during the search.*in or after trial 'all candidates'"):
        trainer.fit(WideMLP(width=256), train, val)
    assert search.phase == "searching" and search.record is None
    assert trainer.callbacks == order


def test_a_fit_that_ends_before_the_search_starts_says_that_nothing_was_searched(tmp_path: Path) -> None:
    pl.seed_everything(0)
    search = fixed_search()  # warmup_epochs=1: the search would start at the second epoch
    trainer = search_trainer(tmp_path, [search], max_epochs=1, plugin=CoMPPrecision())
    train, val = loaders(n_train=256)
    with pytest.warns(UserWarning, match=r"CoMPSearch did not run: the fit ended after 1 epoch.*warmup_epochs=1"):
        trainer.fit(WideMLP(width=64), train, val)
    assert search.phase == "pending" and search.record is None and search.chosen_plan is None
