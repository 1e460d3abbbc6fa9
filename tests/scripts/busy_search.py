"""The busy-machine scenario of issue 15, shared by ``tests/unit/test_measurement.py`` and
``benchmarks/busy_machine.py``: a search's batch stage on an MLP whose operators span clear wins and clear losses.

``BusyMLP`` has a 512x512 ``Linear`` that BF16 makes ~0.55x as slow where BF16 is native, and a ``Linear(128, 8)``
head that BF16 makes 2.5-4x slower on every CPU class (its casts cost more than its arithmetic); on AVX2-only CPUs
every operator is slower in BF16 (emulated). :func:`batch_stage_record` runs the search on a real Trainer for as
few batches as it needs and returns its decision record.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_comp import CoMPPrecision, CoMPSearch
from tests.helpers.search_models import Classifier, teacher_data

CLEAR = 1.5  # operators whose low/fp32 time ratio is this far from 1 (either way) must be decided alike


class BusyMLP(Classifier):
    """``Linear(64, 512)``, ``Linear(512, 512)``, ``Linear(512, 128)``, ``Linear(128, 8)``, ReLUs between."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(64, 512)
        self.a1 = nn.ReLU()
        self.l2 = nn.Linear(512, 512)
        self.a2 = nn.ReLU()
        self.l3 = nn.Linear(512, 128)
        self.a3 = nn.ReLU()
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a3(self.l3(self.a2(self.l2(self.a1(self.l1(x)))))))


def batch_stage_record(root: Path, timing: str | None = "auto", seed: int = 0, **search: Any) -> dict[str, Any]:
    """Run the search on ``BusyMLP`` (BF16 pinned, one-batch trials) and return its decision record.

    ``timing=None`` leaves the argument out (for versions of the package before it existed).
    """
    pl.seed_everything(seed, verbose=False)
    if timing is not None:
        search["measurement"] = {**search.get("measurement", {}), "timing": timing}
    callback = CoMPSearch(low_precision="bf16", warmup_epochs=0, trial_batches=1, verbose=False,
                          record_dir=str(root), **search)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=1,
                         plugins=[CoMPPrecision()], callbacks=[callback], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root))
    train = DataLoader(teacher_data(512, 1), batch_size=256, shuffle=False)
    val = DataLoader(teacher_data(256, 2), batch_size=256)
    trainer.fit(BusyMLP(), train, val)
    record = callback.record
    assert record is not None, "the search did not finish"
    return record


def default_example_record(root: Path, timing: str | None = "auto", seed: int = 0, **search: Any) -> dict[str, Any]:
    """The batch stage of the default example (``python examples/train.py``: CharGPT on pydoc text, model and data
    as ``lightning_comp/conf`` configures them, the search's shipped settings), one-batch trials; its record."""
    from omegaconf import OmegaConf

    import lightning_comp
    from lightning_comp import zoo

    conf = Path(lightning_comp.__file__).resolve().parent / "conf"
    kwargs = {}
    for group, name in (("model", "char_gpt"), ("data", "text")):
        node = OmegaConf.to_container(OmegaConf.load(conf / group / f"{name}.yaml"), resolve=True)
        assert isinstance(node, dict)
        kwargs[group] = {k: v for k, v in node.items() if not str(k).startswith("_")}
    shipped = OmegaConf.to_container(OmegaConf.load(conf / "precision" / "comp.yaml"), resolve=True)
    assert isinstance(shipped, dict)
    settings = {k: v for k, v in shipped["callbacks"]["comp_search"].items() if not str(k).startswith("_")}
    settings.update(warmup_epochs=0, trial_batches=1, verbose=False, record_dir=str(root), **search)
    if timing is not None:
        settings["measurement"] = {**settings.get("measurement", {}), "timing": timing}
    pl.seed_everything(seed, verbose=False)
    callback = CoMPSearch(**settings)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=1,
                         plugins=[CoMPPrecision()], callbacks=[callback], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root))
    trainer.fit(zoo.CharGPT(**kwargs["model"]), datamodule=zoo.CharTextDataModule(**kwargs["data"]))
    record = callback.record
    assert record is not None, "the search did not finish"
    return record


def clear_operators(record: dict[str, Any]) -> dict[str, str]:
    """Operators judged by their own times whose whole interval lies at least :data:`CLEAR` from 1, and what their
    own measurement decided (before the whole-step checks, which judge plans, not operators)."""
    out = {}
    for name, op in record["operators"].items():
        low, high = op.get("time_spread") or (math.nan, math.nan)
        if "own_decision" in op and (high <= 1 / CLEAR or low >= CLEAR):
            out[name] = op["own_decision"]
    return out


def adopted_whole(op: dict[str, Any]) -> bool:
    """Whether an operator was lowered as part of a whole-step plan that beat the per-operator candidates."""
    return str(op.get("reason", "")).startswith("lowered as in")


def own_decisions(record: dict[str, Any]) -> dict[str, str]:
    """Every operator judged by its own times, and that judgement."""
    return {name: op["own_decision"] for name, op in record["operators"].items() if "own_decision" in op}
