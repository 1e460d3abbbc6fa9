"""``LightningCLI``: the plugin and the search configured as ``class_path``/``init_args``, in YAML and on the
command line, and a resume with ``--ckpt_path`` that restores the chosen plan without searching again.

Runs ``examples/cli.py``'s ``main`` in-process (the example is the code under test). Needs the ``cli`` extra
(``jsonargparse``); skipped without it.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jsonargparse", reason="LightningCLI needs the 'cli' extra: pip install -e '.[cli]'")

from lightning_comp import CoMPPrecision, CoMPSearch, SearchConfig  # noqa: E402
from lightning_comp.plan.dimensions import Dimension  # noqa: E402
from lightning_comp.search import MeasurementConfig, Objective, Timing  # noqa: E402
from lightning_comp.search.config import MEASUREMENT_PRESETS  # noqa: E402
from lightning_comp.search.measurement.clocks import single_intra_op_thread  # noqa: E402
from tests.helpers.paths import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "examples"))
from cli import main  # type: ignore[import-not-found]  # noqa: E402

EXAMPLE_CONFIG = REPO / "examples" / "cli.yaml"

# deterministic candidates (include/exclude), BF16 pinned so trials run on every CPU class
CONFIG = """
seed_everything: 0
model:
  class_path: lightning_comp.zoo.NarrowMLP
  init_args: {width: 32, depth: 4}
data:
  class_path: lightning_comp.zoo.MNIST1DDataModule
  init_args: {num_samples: 1000, batch_size: 64}
trainer:
  max_epochs: 2
  accelerator: cpu
  devices: 1
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  plugins:
    - class_path: lightning_comp.CoMPPrecision
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true}
    - class_path: lightning_comp.CoMPSearch
      init_args:
        low_precision: bf16
        warmup_epochs: 0
        include: [body.2]
        exclude: [body.0, body.4, body.6, head]
        tolerance: 0.05
        verbose: false
"""


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    with single_intra_op_thread():  # tiny models run faster on one thread of a shared machine; restored after
        yield


def _search(trainer: Any) -> CoMPSearch:
    found = [c for c in trainer.callbacks if isinstance(c, CoMPSearch)]
    assert len(found) == 1, trainer.callbacks
    return found[0]


def _fit(tmp_path: Path, *args: str) -> Any:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    return main(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path / "run"), *args])


@pytest.mark.slow
def test_plugin_and_search_from_yaml_train_and_resume_with_the_plan_restored(tmp_path: Path) -> None:
    cli = _fit(tmp_path)
    trainer = cli.trainer
    assert isinstance(trainer.precision_plugin, CoMPPrecision)
    search = _search(trainer)
    assert search.config.low_precision == "bf16" and search.config.include == ("body.2",)
    assert search.phase == "done"
    chosen = search.chosen_plan
    assert chosen is not None
    entries = dict(chosen["compute"].entries)
    assert {k: v.value for k, v in entries.items()} == {"body.2": "bf16"}, search.record
    trials = [(t.label, t.verdict) for t in search.state.trials]
    extension = search.state.extension_epochs  # the rejected trial epochs the search added to max_epochs
    assert trainer.current_epoch == 2 + extension
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert last.exists()

    resumed = _fit(tmp_path, "--ckpt_path", str(last), "--trainer.max_epochs", "3")  # one more user epoch
    again = _search(resumed.trainer)
    assert again.phase == "done" and [(t.label, t.verdict) for t in again.state.trials] == trials  # no new search
    assert dict(resumed.trainer.precision_plugin.plan["compute"].entries) == entries  # the plan came back from its ckpt
    assert resumed.trainer.current_epoch == 3 + extension  # the extension is carried over, not added twice


@pytest.mark.slow
def test_plugin_and_search_from_the_command_line(tmp_path: Path) -> None:
    cli = main([
        "fit", "--model", "lightning_comp.zoo.NarrowMLP", "--model.width", "32", "--model.depth", "4",
        "--data", "lightning_comp.zoo.MNIST1DDataModule", "--data.num_samples", "1000",
        "--trainer.max_epochs", "2", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.plugins=lightning_comp.CoMPPrecision",
        "--trainer.callbacks+=lightning_comp.CoMPSearch",
        "--trainer.callbacks.low_precision=bf16", "--trainer.callbacks.warmup_epochs=0",
        "--trainer.callbacks.include=[body.2]", "--trainer.callbacks.exclude=[body.0, body.4, body.6, head]",
        "--trainer.callbacks.tolerance=0.05", "--trainer.callbacks.verbose=false",
    ])
    assert isinstance(cli.trainer.precision_plugin, CoMPPrecision)
    search = _search(cli.trainer)
    assert search.config.exclude == ("body.0", "body.4", "body.6", "head") and search.phase == "done"
    assert (tmp_path / "search_record.json").exists()


def test_the_example_config_parses_with_the_plugin_and_the_search() -> None:
    cli = main(["--config", str(EXAMPLE_CONFIG)], run=False)
    assert isinstance(cli.trainer.precision_plugin, CoMPPrecision)
    search = _search(cli.trainer)
    assert search.config.trial_batches == 0.25 and search.config.warmup_epochs == 1


def test_every_setting_has_one_spelling_init_args_name_and_measurement_name() -> None:
    """One rule: every SearchConfig field is ``init_args.<name>``, every measurement knob
    ``init_args.measurement.<name>`` (or a preset's name); choices are spelled by value."""
    assert list(inspect.signature(CoMPSearch).parameters) == list(SearchConfig.setting_names())
    cli = main([
        "--model", "lightning_comp.zoo.NarrowMLP", "--data", "lightning_comp.zoo.MNIST1DDataModule",
        "--trainer.plugins=lightning_comp.CoMPPrecision", "--trainer.callbacks+=lightning_comp.CoMPSearch",
        "--trainer.callbacks.tolerance=0.05", "--trainer.callbacks.objective=memory",
        "--trainer.callbacks.precisions={saved: fp8, master: 'off'}",
        "--trainer.callbacks.include_dimensions={state: [body.0]}",
        "--trainer.callbacks.measurement.timing=cpu", "--trainer.callbacks.measurement.profile_steps=2",
    ], run=False)
    config = _search(cli.trainer).config
    assert (config.objective, config.measurement.timing, config.measurement.profile_steps, config.tolerance) == (
        Objective.MEMORY, Timing.CPU, 2, 0.05)
    assert config.measurement.extra_profile_time == MeasurementConfig().extra_profile_time  # the rest: "default"
    assert config.precisions == {Dimension.SAVED: "fp8", Dimension.STATE: "auto", Dimension.MASTER: "off"}
    assert config.included(Dimension.STATE).selectors == ("body.0",)
    preset = main([
        "--model", "lightning_comp.zoo.NarrowMLP", "--data", "lightning_comp.zoo.MNIST1DDataModule",
        "--trainer.plugins=lightning_comp.CoMPPrecision", "--trainer.callbacks+=lightning_comp.CoMPSearch",
        "--trainer.callbacks.measurement=thorough",
    ], run=False)
    assert _search(preset.trainer).config.measurement == MEASUREMENT_PRESETS["thorough"]


@pytest.mark.slow
def test_the_readme_command_runs(tmp_path: Path) -> None:
    """``python examples/cli.py fit --config examples/cli.yaml`` as README shows it, shortened to 2 epochs."""
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "cli.py"), "fit", "--config", str(EXAMPLE_CONFIG),
         "--trainer.max_epochs=2", "--data.num_samples=1000", f"--trainer.default_root_dir={tmp_path}",
         "--trainer.enable_progress_bar=false"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(tmp_path.rglob("search_record.json")), "the decision record was not written"
