"""CoMPSearch(trial_batches=N): trials of N batches judged by a validation inside the epoch, on the real Trainer.

Rejected trials cut their epoch short and are rewound bit for bit; the kept trial trains on to its epoch's end, so
the kept progress equals a plain run's; the plan found equals the whole-epoch search's on the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_comp import CoMPPrecision, CoMPSearch
from lightning_comp.errors import SearchConfigError
from lightning_comp.search import SearchConfig
from lightning_comp.search.stages.trials import trial_batches
from tests.helpers.search_models import TOLERANCE, SearchProbe, WideMLP, fixed_search, loaders, search_trainer

BATCHES = 3  # of 8 per epoch (2048 samples, batch 256)


def _search(**kwargs: Any) -> CoMPSearch:
    kwargs.setdefault("measurement", {"profile_steps": 2})
    kwargs.setdefault("trial_batches", BATCHES)
    return fixed_search(**kwargs)


@pytest.fixture(scope="module")
def batch_trials(tmp_path_factory: pytest.TempPathFactory, plain_wide_mlp: pl.Trainer) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("trial_batches")
    pl.seed_everything(0)
    search = _search()
    probe = SearchProbe(search)
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp, [search, probe], max_epochs=4, plugin=plugin)
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    plain = plain_wide_mlp
    return {"search": search, "probe": probe, "plugin": plugin, "trainer": trainer, "plain": plain,
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "fp32_val_loss": float(plain.callback_metrics["val_loss"])}


@pytest.mark.slow
def test_trials_of_batches_find_the_unsafe_operator_and_keep_a_plain_runs_progress(
        batch_trials: dict[str, Any]) -> None:
    search, trainer, plain = batch_trials["search"], batch_trials["trainer"], batch_trials["plain"]
    record = search.record
    assert record is not None
    precisions = {n: p.value for n, p in batch_trials["plugin"].plan.resolve(trainer.lightning_module).items()}
    assert precisions["l3"] == "fp32" and precisions["l2"] == "bf16" and precisions["l4"] == "bf16", record
    trials = record["trials"]
    rejected = [t for t in trials if not t["kept"]]
    assert rejected and all(t["batches"] == BATCHES for t in trials)
    # every rejected trial trained exactly BATCHES batches and its epoch ended there; every other epoch is whole
    batches = batch_trials["probe"].batches
    assert sorted(batches) == sorted([BATCHES] * len(rejected) + [8] * (len(batches) - len(rejected)))
    assert record["extension_epochs"] == len(rejected) and trainer.current_epoch == 4 + len(rejected)
    # the kept progress is a plain run's: its optimizer steps plus the rewound trials' steps
    assert trainer.global_step == plain.global_step + BATCHES * len(rejected)
    assert all(batch_trials["probe"].rewinds_exact) and batch_trials["probe"].rewinds_exact
    assert batch_trials["val_loss"] <= batch_trials["fp32_val_loss"] * (1 + TOLERANCE)
    # every trial, the FP32 reference included, was judged after BATCHES optimizer steps, not a whole epoch's 8
    assert all(t.steps == BATCHES for t in search.state.trials)


@pytest.mark.slow
def test_when_no_candidate_converges_training_goes_on_in_fp32_from_the_snapshot(batch_trials: dict[str, Any],
                                                                                tmp_path: Path) -> None:
    pl.seed_everything(0)
    search = _search(include=["l3"], exclude=["l1", "l2", "l4", "head", "a?"])
    probe = SearchProbe(search)
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp_path, [search, probe], max_epochs=4, plugin=plugin)
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    record = search.record
    assert record is not None and plugin.plan.is_all_fp32
    assert [t["verdict"] for t in record["trials"]] == ["pass", "fail"]
    # the reference of 3 batches is not continued: both trials are given back, FP32 restarts from the snapshot
    assert record["extension_epochs"] == 2 and probe.batches == [8, BATCHES, BATCHES, 8, 8, 8]
    assert trainer.global_step == batch_trials["plain"].global_step + 2 * BATCHES
    assert all(probe.rewinds_exact)
    # and the result is the plain FP32 run's, bit for bit (same snapshot, same batches, same arithmetic)
    plain = batch_trials["plain"].lightning_module
    assert all(torch.equal(a, b) for a, b in zip(trainer.lightning_module.parameters(), plain.parameters()))


@pytest.mark.slow
def test_trial_longer_than_the_epoch_is_a_whole_epoch_trial(tmp_path: Path) -> None:
    pl.seed_everything(0)
    search = _search(trial_batches=100, include=["l2", "l4"])
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=CoMPPrecision())
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    record = search.record
    assert record is not None
    assert all(t["batches"] is None for t in record["trials"])
    rejected = sum(not t["kept"] for t in record["trials"])
    assert rejected >= 1 and trainer.current_epoch == 3 + rejected  # whole rejected epochs given back


@pytest.mark.slow
def test_killed_during_trials_of_batches_resumes_to_the_same_plan(batch_trials: dict[str, Any],
                                                                  tmp_path: Path) -> None:
    class Crash(Callback):
        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.current_epoch == 3:
                raise RuntimeError("simulated crash")

    pl.seed_everything(0)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = search_trainer(tmp_path, [_search(), Crash(), checkpoint], max_epochs=4, plugin=CoMPPrecision())
    train, val = loaders()
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.fit(WideMLP(), train, val)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["callbacks"]["CoMPSearch"]["phase"] == "searching"
    search, plugin = _search(), CoMPPrecision()
    resumed = search_trainer(tmp_path, [search, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
                             max_epochs=4, plugin=plugin)
    train, val = loaders()
    resumed.fit(WideMLP(), train, val, ckpt_path=str(last))
    assert search.phase == "done"
    assert plugin.plan["compute"].entries == batch_trials["plugin"].plan["compute"].entries
    assert resumed.current_epoch == batch_trials["trainer"].current_epoch


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"trial_batches": 0}, "trial_batches"), ({"trial_batches": 2.5}, "trial_batches"),
     ({"trial_batches": 4, "trial_epochs": 2}, "trial_epochs=1")],
)
def test_bad_trial_batches_name_the_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SearchConfigError, match=message):
        CoMPSearch(**kwargs)


def test_trial_batches_need_validation_at_every_epoch(tmp_path: Path) -> None:
    trainer = search_trainer(tmp_path, [_search()], max_epochs=2, plugin=CoMPPrecision(), check_val_every_n_epoch=2)
    train, val = loaders(n_train=512, n_val=64)
    with pytest.raises(SearchConfigError, match=r"trial_batches=3.*check_val_every_n_epoch=2"):
        trainer.fit(WideMLP(), train, val)


@pytest.mark.slow
@pytest.mark.parametrize(("trial_batches", "given_back"), [(BATCHES, 2 * BATCHES), (None, 8)])
def test_max_steps_budget_gets_the_rewound_trials_steps_back(batch_trials: dict[str, Any], tmp_path: Path,
                                                             trial_batches: int | None, given_back: int) -> None:
    # Both trials fail or are rewound. Trials of batches: both are given back. Whole epochs: the FP32 reference's
    # epoch is kept (training goes on from its end), the rejected candidate's 8 steps are given back.
    pl.seed_everything(0)
    search = _search(include=["l3"], exclude=["l1", "l2", "l4", "head", "a?"], trial_batches=trial_batches)
    plugin = CoMPPrecision()
    plain_steps = batch_trials["plain"].global_step
    trainer = search_trainer(tmp_path, [search], max_epochs=-1, plugin=plugin, max_steps=plain_steps)
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    assert trainer.global_step == plain_steps + given_back
    plain = batch_trials["plain"].lightning_module
    assert all(torch.equal(a, b) for a, b in zip(trainer.lightning_module.parameters(), plain.parameters()))


@pytest.mark.parametrize(("wanted", "epoch", "expected"),
                         [(0.25, 45, 11), (12, 45, 12), (1.0, 8, None), (100, 8, None), (0.01, 8, 1), (None, 8, None),
                          (4, float("inf"), None)])
def test_trial_length_as_a_count_or_a_fraction_of_the_epoch(wanted: Any, epoch: Any, expected: int | None) -> None:
    assert trial_batches(SearchConfig(trial_batches=wanted), epoch) == expected


def test_trial_length_is_whole_optimizer_steps_under_gradient_accumulation() -> None:
    assert trial_batches(SearchConfig(trial_batches=3), 16, accumulate=2) == 4
    assert trial_batches(SearchConfig(trial_batches=0.25), 45, accumulate=4) == 12
    assert trial_batches(SearchConfig(trial_batches=7), 8, accumulate=4) is None  # rounds up to the whole epoch


@pytest.mark.slow
def test_trials_of_batches_with_gradient_accumulation_end_on_an_optimizer_step(tmp_path: Path) -> None:
    pl.seed_everything(0)
    search = _search(include=["l2", "l3"], exclude=["l1", "l4", "head", "a?"])
    probe = SearchProbe(search)
    trainer = search_trainer(tmp_path, [search, probe], max_epochs=3, plugin=CoMPPrecision(),
                             accumulate_grad_batches=2)
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    record = search.record
    assert record is not None and all(t["batches"] == 4 for t in record["trials"])  # 3 rounded up to 2 steps
    rejected = [t for t in record["trials"] if not t["kept"]]
    assert all(t.steps == 2 for t in search.state.trials)  # every trial was judged after 2 optimizer steps
    assert sorted(probe.batches) == sorted([4] * len(rejected) + [8] * (len(probe.batches) - len(rejected)))
    assert probe.rewinds_exact and all(probe.rewinds_exact)


@pytest.mark.slow
def test_trials_of_batches_with_the_users_own_validation_inside_the_epoch(batch_trials: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    # The user validates every 4 batches; a trial validates at its 3rd, and afterwards the user's schedule is back.
    seen: list[tuple[int, int]] = []

    class ValidationLog(Callback):
        def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if not trainer.sanity_checking:
                seen.append((trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.ready))

    pl.seed_everything(0)
    search = _search()
    trainer = search_trainer(tmp_path, [search, ValidationLog()], max_epochs=4, plugin=CoMPPrecision(),
                             val_check_interval=0.5)
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    assert search.phase == "done"
    assert search.chosen_plan is not None
    assert search.chosen_plan["compute"].entries == batch_trials["search"].chosen_plan["compute"].entries
    trial_epochs = {t.start_epoch for t in search.state.trials}
    for epoch in range(trainer.current_epoch):
        at = [ready for e, ready in seen if e == epoch]
        assert (BATCHES in at) == (epoch in trial_epochs), (epoch, at)  # a trial's own validation
        if epoch not in trial_epochs:
            assert at == [4, 8]  # the user's schedule, untouched
