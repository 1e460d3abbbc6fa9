"""The shipped ``precision`` group in a Hydra app of the user's own (issue 37, point 5).

Each test writes a primary config into a temporary directory, outside this repository's app, that takes the group
through ``hydra.searchpath: [pkg://lightning_comp.conf]`` and builds the Trainer with ``hydra.utils.instantiate``
alone: ``instantiate(cfg.trainer, **instantiate(cfg.precision))``. ``examples/hydra_app.py``, which does the same, is
run by ``tests/integration/test_examples.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import EarlyStopping
from omegaconf import DictConfig

from lightning_comp import CoMPPrecision, CoMPSearch, ConfigError
from lightning_comp.conf import trainer_arguments
from tests.helpers.models import TinyMLP, regression_loader

# option -> what Lightning makes of it on a CPU (16-mixed runs as bf16-mixed there, with a warning)
PRECISIONS: dict[str, set[str]] = {
    "fp32": {"32-true"},
    "bf16-mixed": {"bf16-mixed"},
    "16-mixed": {"16-mixed", "bf16-mixed"},
    "bf16-true": {"bf16-true"},
    "comp": {"32-true"},  # CoMPPrecision keeps FP32 master weights: Lightning reports its plugin as 32-true
}
PLUGINS = {"fp32": "Precision", "bf16-mixed": "MixedPrecision", "16-mixed": "MixedPrecision",
           "bf16-true": "HalfPrecision", "comp": "CoMPPrecision"}
SEARCH = "precision.callbacks.comp_search"
# a search that runs on every CPU class (bf16 pinned: "auto" searches nothing where bf16 is emulated), quickly
QUICK_SEARCH = [f"{SEARCH}.low_precision=bf16", f"{SEARCH}.warmup_epochs=0",
                "precision/callbacks/comp_search/measurement=quick", f"{SEARCH}.verbose=false"]

USER_APP = """
defaults:
  - precision: comp
  - _self_
hydra:
  searchpath:
    - pkg://lightning_comp.conf
trainer:
  _target_: lightning.pytorch.Trainer
  accelerator: cpu
  devices: 1
  max_epochs: 2
  limit_train_batches: 4
  limit_val_batches: 2
  num_sanity_val_steps: 0
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
"""


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _compose(directory: Path, *overrides: str) -> DictConfig:
    (directory / "my_app.yaml").write_text(USER_APP)
    with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
        return compose("my_app", overrides=[f"+trainer.default_root_dir={directory}", *overrides])


def _trainer(cfg: DictConfig, **extra: Any) -> pl.Trainer:
    trainer = instantiate(cfg.trainer, **instantiate(cfg.precision), **extra)
    assert isinstance(trainer, pl.Trainer)
    return trainer


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_every_precision_option_fits_a_users_model_with_instantiate_alone(tmp_path: Path, precision: str) -> None:
    cfg = _compose(tmp_path, f"precision={precision}", *(QUICK_SEARCH if precision == "comp" else []))
    pl.seed_everything(0)
    trainer = _trainer(cfg)
    assert trainer.precision in PRECISIONS[precision]
    assert type(trainer.precision_plugin).__name__ == PLUGINS[precision]
    searches = [c for c in trainer.callbacks if isinstance(c, CoMPSearch)]  # type: ignore[attr-defined]
    assert len(searches) == (precision == "comp")
    trainer.fit(TinyMLP(), regression_loader(n=64, seed=1), regression_loader(n=32, seed=2))
    assert trainer.global_step > 0 and torch.isfinite(trainer.callback_metrics["val_loss"])
    if precision == "comp":  # the search ran and wrote its record where CoMPSearch writes by default
        record = json.loads((tmp_path / "search_record.json").read_text())
        assert record["num_operators"] > 0 and (tmp_path / "plan.json").is_file()


def test_search_settings_from_the_command_line_reach_the_callback(tmp_path: Path) -> None:
    cfg = _compose(tmp_path, f"{SEARCH}.tolerance=0.05", f"{SEARCH}.exclude=[net.4]",
                   f"{SEARCH}.measurement.timing=cpu")
    arguments = instantiate(cfg.precision)
    (search,) = arguments["callbacks"]
    assert isinstance(search, CoMPSearch) and isinstance(arguments["plugins"][0], CoMPPrecision)
    assert search.config.tolerance == 0.05 and search.config.exclude == ("net.4",)
    assert search.config.measurement.timing == "cpu" and search.config.trial_batches == 0.25
    assert arguments["precision"] is None


def test_the_update_path_is_set_from_the_command_line(tmp_path: Path) -> None:
    default = instantiate(_compose(tmp_path).precision)["plugins"][0]
    assert default.update_path.value == "auto"
    chosen = instantiate(_compose(tmp_path, "precision.plugins.0.update_path=eager").precision)["plugins"][0]
    assert chosen.update_path.value == "eager"


def test_a_users_own_callbacks_go_along(tmp_path: Path) -> None:
    cfg = _compose(tmp_path, "precision=comp")
    arguments = instantiate(cfg.precision)
    own = EarlyStopping(monitor="val_loss")
    trainer = instantiate(cfg.trainer, **{**arguments, "callbacks": [own, *arguments["callbacks"]]})
    assert own in trainer.callbacks and any(isinstance(c, CoMPSearch) for c in trainer.callbacks)


def test_a_switched_off_search_leaves_the_plugin(tmp_path: Path) -> None:
    arguments = instantiate(_compose(tmp_path, f"{SEARCH}=null").precision)
    assert arguments["callbacks"] == [] and isinstance(arguments["plugins"][0], CoMPPrecision)


def test_settings_of_a_callback_the_option_lacks_are_ignored(tmp_path: Path) -> None:
    """``++precision.callbacks.comp_search.warmup_epochs=0`` in a multirun over fp32 and comp: fp32 ignores it."""
    cfg = _compose(tmp_path, "precision=fp32", f"++{SEARCH}.warmup_epochs=0")
    assert instantiate(cfg.precision) == {"precision": "32-true", "plugins": None, "callbacks": []}


def test_a_plugin_with_a_trainer_precision_is_explained(tmp_path: Path) -> None:
    cfg = _compose(tmp_path, "precision.trainer_precision=bf16-mixed")
    with pytest.raises(InstantiationException, match="so its trainer_precision must be null") as caught:
        instantiate(cfg.precision)
    assert isinstance(caught.value.__cause__, ConfigError)
    assert "precision.trainer_precision='bf16-mixed'" in str(caught.value.__cause__)


def test_a_plan_for_an_option_without_plugin_is_refused(tmp_path: Path) -> None:
    cfg = _compose(tmp_path, "precision=bf16-mixed", "++precision.plan=runs/a/plan.json")
    with pytest.raises(InstantiationException, match="a fixed plan needs precision=comp"):
        instantiate(cfg.precision)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"callbacks": [EarlyStopping(monitor="val_loss")]}, "callbacks must be a mapping of name -> callback"),
        ({"callbacks": {"timer": 3}}, r"precision.callbacks.timer must build a Lightning Callback, got int 3"),
        ({"plugins": [{"plan": None}]}, r"plugins\[0\] must build a Lightning plugin from its _target_"),
        ({"plugins": "lightning_comp.CoMPPrecision"}, "plugins must be a list of plugin configs"),
    ],
)
def test_malformed_options_are_refused(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        trainer_arguments("mine", **arguments)
