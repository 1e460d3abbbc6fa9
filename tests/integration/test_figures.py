"""The search's figures on the real Trainer path: the plan and the trials are written as PNG beside ``plan.json``
and reach the TensorBoard logger as images (what they show is checked on the record they are drawn from, not in
pixels)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_comp import CoMPPrecision
from lightning_comp.search.record.figures import FRONTIER_FIGURE, PLAN_FIGURE, TRIALS_FIGURE
from tests.helpers.search_models import WideMLP, fixed_search, loaders


@pytest.mark.slow
def test_plan_and_trials_figures_are_written_and_logged_to_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the figures need matplotlib (the figures extra)")
    pytest.importorskip("tensorboard", reason="the TensorBoard logger needs the tensorboard package (dev extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pl.seed_everything(0)
    search = fixed_search()
    board = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, plugins=[CoMPPrecision()], callbacks=[search],
                         logger=board, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    record = search.record
    assert record is not None and {t["verdict"] for t in record["trials"]} == {"pass", "fail"}

    directory = Path(board.log_dir)  # the record's directory: beside plan.json
    assert (directory / "plan.json").is_file()
    for name in (PLAN_FIGURE, TRIALS_FIGURE):
        assert (directory / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not (directory / FRONTIER_FIGURE).exists()  # objective throughput: no memory levers were spent
    # what the figures are drawn from is in the record read back
    written = json.loads((directory / "search_record.json").read_text())
    assert written["metric_bound"] == pytest.approx(record["trials"][0]["metric"] * (1 + record["tolerance"]))
    assert all(t["metrics"] and list(t["metrics"].values())[-1] == t["metric"] for t in written["trials"])

    events = EventAccumulator(board.log_dir, size_guidance={"images": 0})
    events.Reload()
    images = events.Tags()["images"]
    assert {"comp/precision_plan", "comp/trials"} <= set(images), images
    # logged once, when the search ended (at the step the plan was chosen), not again at the fit's end
    assert len(events.Images("comp/trials")) == 1
    assert events.Images("comp/trials")[0].width > 0
