"""The decision record reaches every attached logger in that logger's own form (TensorBoard and CSV, on the real
Trainer path; the flat tables and hyperparameters also as pure functions)."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_comp import CoMPPrecision
from lightning_comp.search.record.loggers import OPERATOR_COLUMNS, TRIAL_COLUMNS, operator_rows, plan_hyperparameters
from tests.helpers.search_models import WideMLP, fixed_search, loaders


@pytest.mark.slow
def test_tensorboard_and_csv_loggers_get_the_record_in_their_own_form(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the TensorBoard logger needs the tensorboard package (dev extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pl.seed_everything(0)
    search = fixed_search()
    board = TensorBoardLogger(str(tmp_path), name="tb")
    table = CSVLogger(str(tmp_path), name="csv")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, plugins=[CoMPPrecision()], callbacks=[search],
                         logger=[board, table], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    record = search.record
    assert record is not None and record["trials"]

    events = EventAccumulator(board.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    metric = events.Scalars("comp/trials/metric")
    assert [e.step for e in metric] == list(range(len(record["trials"])))
    assert [e.value for e in metric] == pytest.approx([t["metric"] for t in record["trials"]])
    assert "comp/trials/median_step_ms" in tags["scalars"] and "comp/lowered_operators" in tags["scalars"]
    texts = set(tags["tensors"])  # the text plugin stores its Markdown as tensors
    assert {"comp/plan/text_summary", "comp/operators/text_summary"} <= texts, texts
    plan_text = events.Tensors("comp/plan/text_summary")[-1].tensor_proto.string_val[0].decode()
    for selector, precision in record["chosen_plan"]["entries"].items():
        assert f"| {selector} | {precision} |" in plan_text

    directory = Path(table.log_dir)
    with (directory / "comp_operators.csv").open() as handle:
        operators = list(csv.DictReader(handle))
    assert tuple(operators[0]) == OPERATOR_COLUMNS
    assert [row["operator"] for row in operators] == list(record["operators"])
    assert {row["operator"]: row["decision"] for row in operators} == {
        name: op["decision"] for name, op in record["operators"].items()}
    with (directory / "comp_trials.csv").open() as handle:
        trials = list(csv.DictReader(handle))
    assert tuple(trials[0]) == TRIAL_COLUMNS and [row["label"] for row in trials] == [
        t["label"] for t in record["trials"]]
    hparams = yaml.safe_load((directory / "hparams.yaml").read_text())
    for selector, precision in record["chosen_plan"]["entries"].items():
        assert hparams[f"comp/plan/{selector}"] == precision
    assert hparams["comp/low_precision"] == "bf16"


def test_plan_hyperparameters_are_flat_and_name_every_entry() -> None:
    record = {"chosen_plan": {"entries": {"l2": "bf16", "l3": "fp32"}, "default": "fp32"}, "low_precision": "bf16",
              "objective": "throughput", "chosen_trial": "group of 1 (trial 2)", "lowered_operators": ["l2"],
              "timing": {"clock": "wall"}}
    params = plan_hyperparameters(record)
    assert params["comp/plan/l2"] == "bf16" and params["comp/plan/l3"] == "fp32"
    assert params["comp/plan/<default>"] == "fp32" and params["comp/lowered_operators"] == 1
    assert all(not isinstance(v, (dict, list)) for v in params.values())
    assert plan_hyperparameters({})["comp/low_precision"] == "none"
    record["chosen_plan"]["saved"] = {"l2": "fp8"}  # a plan of the memory axis names its saved lowerings too
    assert plan_hyperparameters(record)["comp/saved/l2"] == "fp8"
    rows = operator_rows({"operators": {"l2": {"type": "Linear", "decision": "candidate",
                                               "saved": {"decision": "fp8", "reason": "pays"}}}})
    assert rows[0]["saved"] == "fp8" and rows[0]["saved_reason"] == "pays" and set(rows[0]) == set(OPERATOR_COLUMNS)


@pytest.mark.slow
@pytest.mark.parametrize("bar", [True, False])
def test_search_phases_show_on_the_progress_bar_and_stay_silent_without_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, bar: bool) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # tqdm fits its line to the terminal: give the descriptions room
    pl.seed_everything(0)
    search = fixed_search()
    # Lightning's default bar is Rich's where `rich` is installed; the search shows itself on the TQDM bar
    callbacks = [search, TQDMProgressBar()] if bar else [search]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, plugins=[CoMPPrecision()], callbacks=callbacks,
                         logger=False, enable_progress_bar=bar, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    out = capsys.readouterr()
    text = out.out + out.err
    assert search.record is not None and len(search.record["trials"]) >= 2
    if bar:
        assert "CoMP batch stage (" in text and "per operator, fp32/bf16" in text and "whole steps" in text
        assert "CoMP trial 1 of at most 13 (fp32 reference)" in text
        assert "CoMP trial 2 of at most 13 (all candidates)" in text
    else:  # (warnings may still name CoMPSearch, e.g. where BF16 is emulated)
        assert "CoMP batch stage" not in text and "CoMP trial" not in text
