"""The whole-step rule on the real Trainer path: repeated blocks decided and written as groups, the fastest measured
plan trialled, and a refinement flip the per-operator rules cannot find.

The model's operators spin for a fixed CPU time that depends on the precision they compute in (far more than their
arithmetic costs on any CPU class, and counted by either clock the batch stage may choose), so what pays is known:

==============  ============  ============  =====================================================================
operator        fp32 (ms)     bf16 (ms)     what the rules make of it
==============  ============  ============  =====================================================================
``lin``         4.0           1.0           a compute candidate
``act``         2.0           0.5           a cheap operator faster in bf16, but its consumer ``out`` is excluded:
                                            never a fill; only the refinement can lower it
``out``         (tiny)        (excluded)    stays fp32
``slow``        0.5           12.0          a cheap operator far slower in bf16: the plans lowering it (AMP's,
                                            all-low) take over twice the fastest step and are timed once only
==============  ============  ============  =====================================================================
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_comp import CoMPPrecision, CoMPSearch
from tests.helpers.search_models import Classifier, teacher_data


def _spin(ms: float) -> None:
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


class SpinLinear(nn.Linear):
    """A ``Linear`` that costs 4 ms of CPU in fp32 and 1 ms in bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _spin(1.0 if torch.is_autocast_enabled("cpu") or x.dtype == torch.bfloat16 else 4.0)
        return super().forward(x)


class SpinTanh(nn.Module):
    """A parameter-free activation that costs ``fp32_ms`` in fp32 and ``low_ms`` on a bf16 input."""

    def __init__(self, fp32_ms: float, low_ms: float) -> None:
        super().__init__()
        self.fp32_ms, self.low_ms = fp32_ms, low_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _spin(self.low_ms if x.dtype == torch.bfloat16 else self.fp32_ms)
        return torch.tanh(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = SpinLinear(64, 64)
        self.act = SpinTanh(2.0, 0.5)
        self.out = nn.Linear(64, 64)
        self.slow = SpinTanh(0.5, 12.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.slow(self.out(self.act(self.lin(x))))


class Blocks(Classifier):
    lr = 3e-3

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _search(root: Path) -> tuple[CoMPSearch, CoMPPrecision, dict[str, Any]]:
    pl.seed_everything(0, verbose=False)
    search = CoMPSearch(low_precision="bf16", warmup_epochs=0, trial_batches=6, tolerance=1.0, verbose=False,
                        exclude=["blocks.*.out", "head"], record_dir=str(root))
    plugin = CoMPPrecision()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=8, limit_val_batches=1,
                         plugins=[plugin], callbacks=[search], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root))
    trainer.fit(Blocks(), DataLoader(teacher_data(256, 1), batch_size=64),
                DataLoader(teacher_data(128, 2), batch_size=64))
    assert search.record is not None, "the search did not finish"
    return search, plugin, search.record


def test_the_search_trials_the_fastest_plan_refines_it_by_whole_steps_and_writes_groups_as_globs(
        tmp_path: Path) -> None:
    search, plugin, record = _search(tmp_path)
    operators = record["operators"]
    # identical blocks, identical decisions, each made once for its group
    for part in ("lin", "act", "out", "slow"):
        first, second = operators[f"blocks.0.{part}"], operators[f"blocks.1.{part}"]
        assert (first["decision"], first["reason"]) == (second["decision"], second["reason"]), part
    assert record["groups"]["blocks.*.lin"] == {"members": ["blocks.0.lin", "blocks.1.lin"],
                                               "selector": "blocks.*.lin"}
    assert operators["blocks.0.lin"]["own_decision"] == "candidate"
    # the candidates (lin) are the fastest measured plan: all-low pays slow's 12 ms, fp32 lin's 4 ms; a plan over
    # twice the fastest step in its first round is not timed again
    assert record["step_ratios"]["amp"]["rounds"] == 1 and record["step_ratios"]["candidates"]["rounds"] >= 4
    trialled = record["trialled_plan"]
    assert trialled["from"] == "candidates" and trialled["fastest_measured"] == "candidates", record["step_ratios"]
    # the refinement lowers act, which no fill rule can (its consumer stays fp32); slow is never worth a flip
    flips = {flip["group"]: flip for flip in record["refinements"]}
    assert flips["blocks.*.act"]["to"] == "low" and flips["blocks.*.act"]["kept"], flips
    assert flips["blocks.*.act"]["ratio"]["high"] < 1.0
    assert "blocks.*.slow" not in flips and "blocks.*.lin" not in flips
    assert trialled["refined"] and trialled["ratio_to_fp32"] < record["step_ratios"]["candidates"]["ratio"]
    assert "lowered by the refinement" in operators["blocks.1.act"]["reason"]
    # the trial of that plan converged: it is chosen, written with one selector per group, and trains on
    chosen = record["chosen_plan"]
    assert record["chosen_trial"] != "fp32 reference", record["trials"]
    assert dict(chosen["entries"]) == {"blocks.*.act": "bf16", "blocks.*.lin": "bf16"}, chosen
    assert record["lowered_operator_count"] == 4
    assert plugin.plan.same_assignments(search.chosen_plan)  # type: ignore[arg-type]
    assert (tmp_path / "plan.json").exists()
    # the forecast is set beside the step the trial of that plan measured in training (how close they come depends
    # on the machine's load, which no test may: benchmarks/compare.py reports it)
    check = record["forecast_check"]
    assert check["comparable"] and check["trial"] == "all candidates", check
    outside = check["reference_training_ms"] - check["fp32_forecast_ms"]
    assert check["forecast_ratio"] == pytest.approx((check["plan_forecast_ms"] + outside)
                                                    / check["reference_training_ms"], abs=1e-3)
    assert check["gap"] == pytest.approx(check["training_ratio"] / check["forecast_ratio"] - 1, abs=1e-3)
