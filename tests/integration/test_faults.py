"""Faults lose nothing: non-finite trials and fp16 overflow are rejected and rewound bit for bit (model with BatchNorm
buffers, optimizer, LR scheduler, loss scaler), and a process SIGKILLed anywhere in the search resumes from its last
checkpoint to the same plan, epochs, steps and weights as an uninterrupted run. See ``docs/hardening.md``."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_comp import CoMPPrecision, CoMPSearch
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.search.rewind.snapshot import TrainingSnapshot
from tests.helpers.paths import SCRIPTS
from tests.helpers.warm_launch import run_warm
from tests.scripts.fault_run import MAX_EPOCHS, InfBNMLP, OverflowMLP, fixed_loaders

FAULT_RUN = SCRIPTS / "fault_run.py"


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """One intra-op thread, as in ``fault_run.py``: on a shared, oversubscribed machine a second spinning thread
    only slows these small models down. Results are exact either way; the setting is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer(tmp_path: Path, plugin: CoMPPrecision, callbacks: list[pl.Callback], max_epochs: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        plugins=[plugin],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
    )


class RewindProbe(pl.Callback):
    """Placed after ``CoMPSearch``: checks every rewind bit for bit and watches the fault poison the state.

    - At the start of every trial but the reference (each starts from the snapshot), the live model (parameters and
      BatchNorm buffers), optimizer, LR scheduler and loss scaler must equal the snapshot; a loss scaler that the
      snapshot did not have (it was taken while training in fp32) must be in its initial state.
    - When the search ends by going back to the end of the FP32 reference trial, the state at the next epoch start
      must equal the state captured there.
    - At each epoch's validation (before any end-of-epoch rewind) it records whether parameters and buffers are
      all finite.
    """

    def __init__(self, search: CoMPSearch) -> None:
        self.search = search
        self.rewinds: list[tuple[int, str, bool]] = []
        self.finite_at_end: dict[int, bool] = {}
        self.scaler_at_start: dict[int, dict[str, Any] | None] = {}
        self._trials_seen = 0
        self._reference_end: dict[str, Any] | None = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self.search.state
        scaler = trainer.precision_plugin.scaler
        self.scaler_at_start[trainer.current_epoch] = None if scaler is None else scaler.state_dict()
        trials = state.trials
        if len(trials) > self._trials_seen and len(trials) > 1 and state.snapshot is not None:
            snapshot = TrainingSnapshot.from_state(state.snapshot)
            exact = snapshot.matches(trainer, pl_module, scaler)
            if snapshot.scaler is None and scaler is not None:  # a fresh scaler for each fp16 trial
                exact = exact and scaler.state_dict() == torch.amp.GradScaler("cpu").state_dict()
            self.rewinds.append((trainer.current_epoch, trials[-1].label, exact))
        self._trials_seen = len(trials)
        self._check_back_to_reference(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        tensors = [t for t in pl_module.state_dict().values() if t.is_floating_point()]
        self.finite_at_end[trainer.current_epoch] = all(bool(torch.isfinite(t).all()) for t in tensors)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self.search.state
        if state.reference_end is not None and self._reference_end is None:  # the reference trial just ended
            self._reference_end = copy.deepcopy(state.reference_end)
        self._check_back_to_reference(trainer, pl_module)

    def _check_back_to_reference(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Once the search has gone back to the reference trial's end (at once if the fit ends, else at the next
        epoch start), the live state must equal the one captured when that trial ended."""
        state = self.search.state
        if self._reference_end is None or state.phase != "done":
            return
        if state.kept_trial != 0:  # the search ended another way
            self._reference_end = None
        elif state.pending_restore is None:
            snapshot = TrainingSnapshot.from_state(self._reference_end)
            exact = snapshot.matches(trainer, pl_module, trainer.precision_plugin.scaler)
            self.rewinds.append((trainer.current_epoch, "back to the reference's end", exact))
            self._reference_end = None


def _search(include: list[str], exclude: list[str], **kwargs: Any) -> CoMPSearch:
    kwargs.setdefault("low_precision", "bf16")  # pinned: the trials run on every CPU class
    return CoMPSearch(include=include, exclude=exclude, tolerance=0.05, measurement="quick", verbose=False, **kwargs)


def _all_but(include: list[str]) -> list[str]:
    """Exclude every other operator of ``InfBNMLP``: the candidates are then fixed whatever the machine measures
    (the batch stage may otherwise add every non-excluded operator when lowering all of them is faster)."""
    return [name for name in ("l1", "bn", "a1", "l2", "a2", "bad", "a3", "head") if name not in include]


def _trials(search: CoMPSearch) -> list[tuple[str, str, str]]:
    return [(t.label, t.verdict, t.reason) for t in search.state.trials]


# ------------------------------------------------------------------------------------- non-finite trials (bf16)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("include", "max_epochs"),
    [(["l2", "bad"], 2), (["bad"], 3), (["bad"], 2)],
    ids=["kept-trial", "back-to-reference", "back-to-reference-as-the-fit-ends"],
)
def test_inf_trial_is_rejected_and_every_state_is_rewound_bit_for_bit(tmp_path: Path, include: list[str],
                                                                       max_epochs: int) -> None:
    """``bad`` yields +Inf in bf16: the trial's loss is Inf, Adam turns every parameter and BatchNorm buffer into
    NaN, and the rewind must still restore model, optimizer, StepLR and BatchNorm state bit for bit. With
    ``max_epochs=2`` and only ``bad`` to trial, the rejected trial is the fit's last epoch: the rewind to the FP32
    reference's end must still happen (the fit must not return the rejected trial's NaN weights)."""
    pl.seed_everything(0)
    search = _search(include, exclude=_all_but(include))
    probe = RewindProbe(search)
    plugin = CoMPPrecision()
    trainer = _trainer(tmp_path, plugin, [search, probe], max_epochs=max_epochs)
    train, val = fixed_loaders()
    model = InfBNMLP(width=128)
    trainer.fit(model, train, val)

    trials = _trials(search)
    inf_trials = [t for t in trials if t[1] == "fail"]
    assert inf_trials and all(reason == "NaN/Inf loss or metric" for _, _, reason in inf_trials), trials
    poisoned = [epoch for epoch, finite in probe.finite_at_end.items() if not finite]
    assert poisoned, "the Inf trial should have poisoned the parameters (otherwise the rewind proves nothing)"
    assert probe.rewinds and all(exact for _, _, exact in probe.rewinds), probe.rewinds
    assert plugin.plan.of("compute", "bad", torch.nn.Linear) is ComputePrecision.FP32
    if include == ["bad"]:  # no candidate converged: training goes on from the end of the FP32 reference trial
        assert search.state.finish_reason == "no candidate converged"
        assert plugin.plan.is_all_fp32 and probe.rewinds[-1][1] == "back to the reference's end"
    else:  # l2 passed; bad was inferred unsafe without a trial of its own; the l2 trial's progress is kept
        assert plugin.plan.of("compute", "l2", torch.nn.Linear) is ComputePrecision.BF16
        assert search.record is not None and search.record["trials"][-1]["kept"]
    # training went on: finite weights, and exactly the user's epochs of kept progress (StepLR counts them)
    assert all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())
    if trainer.current_epoch - 1 not in poisoned:  # the last epoch trained (rather than ended a rejected trial)
        assert math.isfinite(float(trainer.callback_metrics["val_loss"]))
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == max_epochs
    assert trainer.current_epoch == max_epochs + search.state.extension_epochs


# ----------------------------------------------------------------------------------------------- fp16 overflow
@pytest.mark.slow
def test_fp16_overflow_skipped_steps_and_inf_reject_trials_and_each_trial_gets_a_fresh_scaler(
    tmp_path: Path,
) -> None:
    """``big``'s fp16 activations exceed 65504 (Inf loss); ``hot``'s fp16 gradients overflow so the scaler skips
    every step (finite loss): both are rejected. ``l2`` is safe. Every fp16 trial starts from a fresh scaler: a
    scaler left backed-off by a rejected trial would let ``hot`` pass (its overflow needs scale < ~1)."""
    pl.seed_everything(0)
    search = _search(["big", "hot", "l2"], exclude=["l1", "a?", "head"], low_precision="fp16")
    probe = RewindProbe(search)
    plugin = CoMPPrecision(allow_slow_fp16=True)
    trainer = _trainer(tmp_path, plugin, [search, probe], max_epochs=2)
    train, val = fixed_loaders(n_train=256)
    trainer.fit(OverflowMLP(), train, val)

    trials = {tuple(c.operator for c in t.group or ()): t for t in search.state.trials}
    labels = [t.label for t in search.state.trials]  # several groups of 1: the labels still tell them apart
    assert len(set(labels)) == len(labels), labels
    record = search.record
    assert record is not None and record["chosen_trial"] == trials[("l2",)].label
    assert trials[("big",)].verdict == "fail" and trials[("big",)].reason == "NaN/Inf loss or metric"
    for group in (("hot", "l2"), ("hot",)):
        trial = trials[group]
        assert trial.verdict == "fail" and trial.reason == "fp16 loss scaler skipped 100% of steps", trial
        assert trial.steps is not None and trial.skipped_steps == trial.steps > 0
    assert trials[("l2",)].verdict == "pass" and trials[("l2",)].skipped_steps == 0
    resolved = plugin.plan.resolve(trainer.lightning_module)
    assert {n: p.value for n, p in resolved.items() if n in ("big", "hot", "l2")} == \
        {"big": "fp32", "hot": "fp32", "l2": "fp16"}
    assert probe.rewinds and all(exact for _, _, exact in probe.rewinds), probe.rewinds
    fresh = torch.amp.GradScaler("cpu").state_dict()
    fp16_trial_starts = [e for e, _, _ in probe.rewinds]
    assert all(probe.scaler_at_start[e] == fresh for e in fp16_trial_starts), probe.scaler_at_start
    assert math.isfinite(float(trainer.callback_metrics["val_loss"]))


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_warm([sys.executable, str(FAULT_RUN), "--root", str(root), *args], timeout=300)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The result of ``fault_run.py`` without a kill (the reference the resumed runs must reproduce)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    done = _run(tmp, "--out", str(tmp / "result.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads((tmp / "result.json").read_text())
    assert result["trials"] == [["fp32 reference", "pass"], ["all candidates", "fail"],
                                ["group of 1 (trial 2)", "pass"]]
    assert result["current_epoch"] == MAX_EPOCHS + 2 and result["plan"]["l2"] == "bf16"
    assert result["plan"]["l3"] == "fp32"
    return result


@pytest.mark.slow
def test_sigkill_anywhere_in_the_search_resumes_to_the_same_result(tmp_path: Path,
                                                                   uninterrupted: dict[str, Any]) -> None:
    """One run killed (SIGKILL) four times at different points and resumed from ``last.ckpt`` after each kill
    must end with the same plan, trials, epoch, global step, metric and bit-identical weights as the
    uninterrupted run: no epoch lost or counted twice."""
    expected = uninterrupted
    root = tmp_path / "killed"
    ref, all_ = "fp32 reference", "all candidates"
    # (kill point, the state where it died, the state in last.ckpt: epoch, phase, trials)
    points = [
        ("profile:5", {"where": "profile", "epoch": 1, "phase": "measuring", "profile_done": False},
         (0, "pending", [])),
        ("batch:2:3", {"where": "batch", "epoch": 2, "phase": "searching", "trials": [[ref, "pass"], [all_, None]]},
         (1, "searching", [[ref, "pass"]])),
        ("epoch_start:3", {"where": "epoch_start", "epoch": 3, "trials": [[ref, "pass"], [all_, "fail"]]},
         (2, "searching", [[ref, "pass"], [all_, "fail"]])),  # the checkpoint written as that trial ended
        ("batch:4:2", {"where": "batch", "epoch": 4, "phase": "done"},
         (3, "done", [[ref, "pass"], [all_, "fail"], ["group of 1 (trial 2)", "pass"]])),  # after the search finished
    ]
    resume: list[str] = []
    for point, where, in_checkpoint in points:
        killed = _run(root, "--kill", point, *resume)
        assert killed.returncode == -9, f"{point}: rc={killed.returncode}\n{killed.stderr[-3000:]}"
        info = json.loads((root / "killed.json").read_text())
        assert {k: info[k] for k in where} == where, (point, info)
        (root / "killed.json").unlink()
        ckpt = torch.load(root / "ckpt" / "last.ckpt", weights_only=True)
        state = ckpt["callbacks"]["CoMPSearch"]
        trials = [[t["label"], t["verdict"]] for t in state["trials"]]
        assert (ckpt["epoch"], state["phase"], trials) == in_checkpoint, point
        resume = ["--resume"]
    finished = _run(root, "--resume", "--out", str(tmp_path / "resumed.json"))
    assert finished.returncode == 0, finished.stderr[-3000:]
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    # the clock of a batch stage re-run after the profile:5 kill depends on the machine's load at that moment
    assert {k: v for k, v in resumed.items() if k != "timing"} == {k: v for k, v in expected.items() if k != "timing"}


@pytest.mark.slow
def test_sigkill_after_a_mid_epoch_checkpoint_resumes_to_the_same_plan_and_epochs(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    """Checkpoints every 3 steps; killed in the middle of the kept trial's epoch, 2 steps after a checkpoint.

    The search resumes and ends with the same plan, trials, epochs and steps. The weights are *not* compared:
    Lightning cannot resume a plain (non-stateful) DataLoader mid-epoch; it restarts the data and says so."""
    expected = uninterrupted
    root = tmp_path / "killed"
    killed = _run(root, "--kill", "batch:3:4", "--every-n-train-steps", "3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    info = json.loads((root / "killed.json").read_text())
    assert info["epoch"] == 3 and info["trials"][-1] == ["group of 1 (trial 2)", None]  # the trial that will be kept
    assert info["global_step"] % 3 == 2  # two steps after the last checkpoint: those are redone after resuming
    resumed = _run(root, "--resume", "--every-n-train-steps", "3", "--out", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from a checkpoint that ended before the epoch ended" in resumed.stderr
    result = json.loads((tmp_path / "resumed.json").read_text())
    for key in ("plan", "phase", "trials", "current_epoch", "global_step", "max_epochs", "extension_epochs"):
        assert result[key] == expected[key], key


@pytest.mark.slow
def test_crash_with_a_pending_rewind_in_the_checkpoint_resumes_to_the_same_weights(tmp_path: Path) -> None:
    """The last trial is rejected and the search goes back to the FP32 reference's end at the next epoch start;
    the run crashes right after the checkpoint that holds the rejected trial's weights and the pending rewind.
    Resuming applies the rewind: final weights equal the uninterrupted run's bit for bit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.scripts.fault_run import param_digest

    class Crash(pl.Callback):
        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.current_epoch == 3:
                raise RuntimeError("simulated crash")

    def run(root: Path, crash: bool, ckpt_path: Path | None = None) -> tuple[pl.Trainer, CoMPSearch, InfBNMLP]:
        pl.seed_everything(0)
        search = _search(["bad"], exclude=_all_but(["bad"]))
        callbacks: list[pl.Callback] = [Crash()] if crash else []
        callbacks += [search, ModelCheckpoint(dirpath=root / "ckpt", save_last=True)]
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, plugins=[CoMPPrecision()],
                             callbacks=callbacks, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(root), num_sanity_val_steps=0)
        model = InfBNMLP(width=128)
        train, val = fixed_loaders()
        trainer.fit(model, train, val, ckpt_path=ckpt_path)
        return trainer, search, model

    expected_trainer, _, expected_model = run(tmp_path / "a", crash=False)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path / "b", crash=True)
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    state = torch.load(last, weights_only=True)["callbacks"]["CoMPSearch"]
    assert state["phase"] == "done" and state["pending_restore"] == "reference_end"
    weights = torch.load(last, weights_only=True)["state_dict"]
    assert not all(bool(torch.isfinite(t).all()) for t in weights.values() if t.is_floating_point())
    trainer, search, model = run(tmp_path / "b", crash=False, ckpt_path=last)
    assert search.state.pending_restore is None
    assert (trainer.current_epoch, trainer.global_step) == (expected_trainer.current_epoch,
                                                            expected_trainer.global_step)
    assert param_digest(model) == param_digest(expected_model)
