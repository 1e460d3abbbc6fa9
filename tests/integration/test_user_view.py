"""What a Lightning user sees and keeps of a plan: a warning where no plan will ever come, the plan in the logger's
hyperparameters, and what ``trainer.precision`` / ``precision_label`` report (issue 37, points 1 and 2)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.fabric import Fabric
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_comp import CoMPFabricPrecision, CoMPPrecision, CoMPSearch

NO_PLAN = "was given no plan"
WEIGHTS_ONLY = {"weights_only": True}


def _fit(plugin: CoMPPrecision, make_mlp: Any, loader: Any, kwargs: dict[str, Any], *,
         callbacks: list[Any] | None = None, ckpt_path: Path | None = None, max_epochs: int = 1,
         **trainer: Any) -> tuple[pl.Trainer, list[str]]:
    """Fit a tiny MLP; return the Trainer and the messages of the warnings it gave."""
    settings = {**kwargs, **trainer}
    fit = pl.Trainer(max_epochs=max_epochs, plugins=[plugin], callbacks=callbacks or [], **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(make_mlp(), loader, ckpt_path=ckpt_path, **(WEIGHTS_ONLY if ckpt_path else {}))
    return fit, [str(w.message) for w in caught]


def _no_plan(messages: list[str]) -> list[str]:
    return [m for m in messages if NO_PLAN in m]


# ------------------------------------------------------------------------------------ point 1: the warning
def test_a_fit_without_plan_or_search_warns_once_that_it_trains_in_fp32(
        make_mlp: Any, make_regression_loader: Any, fast_trainer_kwargs: dict[str, Any]) -> None:
    _, messages = _fit(CoMPPrecision(), make_mlp, make_regression_loader(), fast_trainer_kwargs, max_epochs=2)
    found = _no_plan(messages)
    assert len(found) == 1, messages
    assert "CoMPSearch" in found[0] and "fp32" in found[0] and "CoMPPrecision({})" in found[0]


@pytest.mark.parametrize("plan", [{}, {"type:Linear": "bf16"}], ids=["explicit-fp32", "bf16"])
def test_a_plan_of_the_users_own_even_all_fp32_gets_no_warning(
        plan: dict[str, str], make_mlp: Any, make_regression_loader: Any, fast_trainer_kwargs: dict[str, Any]) -> None:
    _, messages = _fit(CoMPPrecision(plan), make_mlp, make_regression_loader(), fast_trainer_kwargs)
    assert not _no_plan(messages)


def test_a_search_in_the_callbacks_silences_the_warning(
        make_mlp: Any, make_regression_loader: Any, fast_trainer_kwargs: dict[str, Any]) -> None:
    search = CoMPSearch(monitor="val_loss", warmup_epochs=5, verbose=False)  # still warming up when the fit ends
    loader = make_regression_loader()
    fit = pl.Trainer(max_epochs=1, plugins=[CoMPPrecision()], callbacks=[search], **fast_trainer_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(make_mlp(), loader, loader)
    assert not _no_plan([str(w.message) for w in caught])


def test_resuming_from_a_checkpoint_that_holds_a_plan_gets_no_warning_and_one_without_does(
        tmp_path: Path, make_mlp: Any, make_regression_loader: Any, fast_trainer_kwargs: dict[str, Any]) -> None:
    loader = make_regression_loader()
    planned, unplanned = tmp_path / "planned.ckpt", tmp_path / "unplanned.ckpt"
    first, _ = _fit(CoMPPrecision({"type:Linear": "bf16"}), make_mlp, loader, fast_trainer_kwargs)
    first.save_checkpoint(planned)
    second, _ = _fit(CoMPPrecision(), make_mlp, loader, fast_trainer_kwargs)
    second.save_checkpoint(unplanned)

    resumed = CoMPPrecision()
    _, messages = _fit(resumed, make_mlp, loader, fast_trainer_kwargs, ckpt_path=planned, max_epochs=2)
    assert not _no_plan(messages) and resumed.precision_label == "comp-mixed"
    # an all-fp32 plan nobody made (the run was given none) is no plan to follow: the resumed fit says so again
    _, messages = _fit(CoMPPrecision(), make_mlp, loader, fast_trainer_kwargs, ckpt_path=unplanned, max_epochs=2)
    assert len(_no_plan(messages)) == 1


def _fabric_steps(plugin: CoMPFabricPrecision, load: Path | None = None, save: Path | None = None) -> list[str]:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1e-2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if load is not None:
            fabric.load(load, {"model": model, "optimizer": optimizer, "comp": plugin})
        for _ in range(2):
            fabric.backward(model(torch.randn(4, 8)).float().pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
    if save is not None:
        fabric.save(save, {"model": model, "optimizer": optimizer, "comp": plugin})
    return [str(w.message) for w in caught]


def test_fabric_warns_at_the_first_training_forward_only_where_no_plan_was_ever_given(tmp_path: Path) -> None:
    found = _no_plan(_fabric_steps(CoMPFabricPrecision()))
    assert len(found) == 1 and "CoMPFabricPrecision({})" in found[0]
    assert not _no_plan(_fabric_steps(CoMPFabricPrecision({})))
    path = tmp_path / "fabric.ckpt"
    assert not _no_plan(_fabric_steps(CoMPFabricPrecision({"0": "bf16"}), save=path))
    restored = CoMPFabricPrecision()
    assert not _no_plan(_fabric_steps(restored, load=path))  # the checkpoint's plan, loaded before the first forward
    assert restored.precision_label == "comp-mixed"


# ------------------------------------------------------------------------------------ point 2: the logs
def test_trainer_precision_stays_lightnings_literal_and_the_label_says_mixed(
        make_mlp: Any, make_regression_loader: Any, fast_trainer_kwargs: dict[str, Any]) -> None:
    plugin = CoMPPrecision({"type:Linear": "bf16"})
    trainer, _ = _fit(plugin, make_mlp, make_regression_loader(), fast_trainer_kwargs)
    assert trainer.precision == "32-true" and plugin.precision_label == "comp-mixed"
    assert CoMPPrecision({}).precision_label == "32-true"


def test_a_given_plan_reaches_the_loggers_hyperparameters_at_fit_start(
        tmp_path: Path, make_mlp: Any, make_regression_loader: Any, fast_trainer_kwargs: dict[str, Any]) -> None:
    logger = CSVLogger(str(tmp_path), name="csv")
    plugin = CoMPPrecision({"type:Linear": "bf16", "net.4": "fp32"})
    _fit(plugin, make_mlp, make_regression_loader(), fast_trainer_kwargs, logger=logger)
    hparams = yaml.safe_load((Path(logger.log_dir) / "hparams.yaml").read_text())
    assert hparams["comp/precision"] == "comp-mixed"
    assert hparams["comp/plan/type:Linear"] == "bf16" and hparams["comp/plan/net.4"] == "fp32"
    assert hparams["comp/plan/<default>"] == "fp32"
    lowered = sum(1 for p in plugin.executor.precisions().values() if p.is_low)
    assert hparams["comp/lowered_operators"] == lowered > 0
    assert hparams["comp/operators"] == len(plugin.executor.precisions())
    assert hparams["comp/device_class"].startswith("cpu")
    assert len(hparams["comp/plan_fingerprint"]) == 16 and hparams["comp/model_fingerprint"]
    assert hparams["comp/plan_fingerprint"] == plugin.plan_hyperparameters()["comp/plan_fingerprint"]


@pytest.mark.slow
def test_a_searchs_chosen_plan_and_its_trials_reach_the_logger_under_their_own_names(tmp_path: Path) -> None:
    from tests.helpers.search_models import WideMLP, fixed_search, loaders

    pl.seed_everything(0)
    search = fixed_search()
    logger = CSVLogger(str(tmp_path), name="csv")
    plugin = CoMPPrecision()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, plugins=[plugin], callbacks=[search],
                         logger=logger, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    record = search.record
    assert record is not None and len(record["trials"]) >= 2
    hparams = yaml.safe_load((Path(logger.log_dir) / "hparams.yaml").read_text())
    assert hparams["comp/precision"] == plugin.precision_label
    assert hparams["comp/plan_fingerprint"] == plugin.plan_hyperparameters()["comp/plan_fingerprint"]
    assert hparams["comp/device_class"].startswith("cpu") and hparams["comp/low_precision"] == "bf16"
    import csv

    with (Path(logger.log_dir) / "metrics.csv").open() as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("comp/trials/passed")]
    assert [int(row["step"]) for row in rows] == list(range(len(record["trials"])))
    assert [float(row["comp/trials/metric"]) for row in rows] == pytest.approx([t["metric"] for t in record["trials"]])
    assert [float(row["comp/trials/passed"]) for row in rows] == [
        1.0 if t["verdict"] == "pass" else 0.0 for t in record["trials"]]
