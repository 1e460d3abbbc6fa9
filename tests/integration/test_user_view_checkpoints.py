"""Checkpoints that mean what they say (issue 37, point 3): while the search's trials run, ``ModelCheckpoint``
writes no top-k file (none can hold a trial the search later rewinds, so ``best_model_path`` never names one), its
``last.ckpt`` goes on (a run killed inside the search resumes from it), and the search's snapshots travel only in
checkpoints written inside the search."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_comp import CoMPPrecision
from tests.helpers.search_models import WideMLP, fixed_search, loaders, search_trainer


def _search_state(path: str | Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)["callbacks"]["CoMPSearch"]  # type: ignore[no-any-return]


class _LastProbe(Callback):
    """At each epoch start: the phase in ``last.ckpt`` and its size (what the previous epoch wrote)."""

    def __init__(self, last: Path) -> None:
        self.last = last
        self.seen: list[tuple[str, bool, int]] = []  # (phase, holds a snapshot, bytes)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.last.exists():
            state = _search_state(self.last)
            snapshots = state["snapshot"] is not None or state["reference_end"] is not None
            self.seen.append((state["phase"], snapshots, self.last.stat().st_size))


@pytest.mark.slow
def test_no_trial_that_the_search_rewinds_becomes_a_best_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    # every validation it scores is kept (save_top_k=-1): every file it writes is on the trajectory the run kept
    scored = ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=-1, save_last=True,
                             filename="{epoch}-{step}")
    probe = _LastProbe(directory / "last.ckpt")
    search = fixed_search()
    pl.seed_everything(0)
    trainer = search_trainer(tmp_path, [search, probe, scored], max_epochs=4, plugin=CoMPPrecision())
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    record = search.record
    assert record is not None
    rejected = [t for t in record["trials"] if not t["kept"]]
    assert rejected, "the test needs a rewound trial (WideMLP's l3 is unsafe in bf16)"

    files = sorted(p for p in directory.glob("epoch=*.ckpt"))
    assert files and scored.best_model_path and Path(scored.best_model_path) in files
    assert set(scored.best_k_models) == {str(p) for p in files}
    for path in files:  # written before the search, or once the model held its final state
        state = _search_state(path)
        assert state["phase"] in ("pending", "done") and state["pending_restore"] is None, (path, state["phase"])
        assert state["snapshot"] is None and state["reference_end"] is None  # and no snapshot inside
    assert not scored.best_model_path.endswith("last.ckpt")
    assert scored.save_last is True and "_save_topk_checkpoint" not in vars(scored)  # handed back

    # last.ckpt was written inside the search (a resume point), with its snapshots; once done, without
    during = [size for phase, snapshots, size in probe.seen if snapshots]
    after = [size for phase, snapshots, size in probe.seen if phase == "done" and not snapshots]
    assert during and after and min(during) > max(after)


@pytest.mark.slow
def test_the_kept_trials_own_validation_is_scored_when_the_search_ends_on_it(tmp_path: Path) -> None:
    """A safe model: the first candidate trial passes and is kept; the fit ends right after it, and its end is the
    best checkpoint (its validation was held while it ran, and scored when the search kept it)."""
    directory = tmp_path / "ckpt"
    scored = ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=1, filename="{epoch}-{step}")
    search = fixed_search(warmup_epochs=0)
    pl.seed_everything(0)
    trainer = search_trainer(tmp_path, [search, scored], max_epochs=2, plugin=CoMPPrecision())
    train, val = loaders()
    trainer.fit(WideMLP(offset=False), train, val)
    record = search.record
    assert record is not None and record["trials"][-1]["kept"], record["trials"]
    assert scored.best_model_path, "the kept trial's end was not scored"
    state = _search_state(scored.best_model_path)
    assert state["phase"] == "done" and state["kept_trial"] == len(record["trials"]) - 1
    assert torch.load(scored.best_model_path, weights_only=True)["global_step"] == trainer.global_step


def test_a_hold_shadows_topk_saving_and_gives_everything_back(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from lightning_comp.search.rewind.checkpoints import CheckpointHold

    linked = ModelCheckpoint(dirpath=tmp_path, save_last="link")
    plain = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss")
    trainer: Any = SimpleNamespace(callbacks=[Callback(), linked, plain], global_step=7)
    hold = CheckpointHold()
    hold.hold(trainer)
    hold.hold(trainer)  # idempotent (a resume inside the search holds again)
    assert hold.active and hold.held == [linked, plain]
    assert linked.save_last is True  # nothing of the search's to link to: last.ckpt is written as a file
    plain._save_topk_checkpoint(trainer, {})  # held: no file, but the step counts as saved (so last.ckpt follows)
    assert plain._last_global_step_saved == 7 and not list(tmp_path.iterdir())
    hold.release(trainer)
    assert not hold.active and linked.save_last == "link"
    assert "_save_topk_checkpoint" not in vars(linked) and "_save_topk_checkpoint" not in vars(plain)
