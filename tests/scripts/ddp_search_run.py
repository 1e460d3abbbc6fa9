"""Run CoMPSearch under 2-process DDP on CPU (gloo); every rank writes the plan it ran at each epoch start.

    python tests/scripts/ddp_search_run.py STRATEGY OUT_DIR [TRIAL_BATCHES|0] [throughput|memory]

With ``memory`` the search also lowers what l2, l3 and l4 save for backward (pinned at fp8), so the ranks must agree
on the saved dimension's measurements, candidates and trials too.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.helpers

from lightning_comp import CoMPPrecision, CoMPSearch  # noqa: E402
from tests.helpers.search_models import WideMLP, loaders  # noqa: E402


class ReleaseProcessGroup(pl.Callback):
    """Destroy the gloo group at the end of the fit, in every rank's process. Lightning destroys only NCCL groups at
    exit, and a gloo group left to interpreter shutdown can abort a finished rank ("terminate called without an
    active exception"); under ddp_spawn the ranks are the spawned workers, so the script's own end is too late."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _plan_entries(plan: Any) -> dict[str, str]:
    """Both dimensions of a plan's entries, flat (saved ones as ``saved:<selector>``)."""
    return {**plan["compute"].to_dict(), **{f"saved:{s}": v for s, v in plan["saved"].to_dict().items()}}


class PlanLog(pl.Callback):
    """Each rank records (epoch, plan entries) at every epoch start and the final plan at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[list[object]] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rows.append([trainer.current_epoch, _plan_entries(trainer.precision_plugin.plan), 0])

    def on_train_batch_end(self, *args: Any) -> None:
        self.rows[-1][2] += 1  # batches this rank trained in the epoch

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = [float(p.detach().double().sum()) for p in pl_module.parameters()]
        payload = {"epochs": self.rows, "final": _plan_entries(trainer.precision_plugin.plan),
                   "params": params, "world_size": trainer.world_size, "phase": trainer.callbacks[0].phase}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(payload))


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    trial_batches = (int(sys.argv[3]) or None) if len(sys.argv) > 3 else None
    objective = sys.argv[4] if len(sys.argv) > 4 else "throughput"
    # a bounded collective timeout: a lost rank fails the run in minutes instead of hanging for half an hour
    strategy = DDPStrategy(start_method="spawn" if name == "ddp_spawn" else "popen", timeout=timedelta(seconds=120))
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0)
    pinned: dict[str, Any] = {"include": ["l2", "l3", "l4"], "exclude": ["l1", "head", "a?"], "tolerance": 0.05}
    if objective == "memory":  # compute is not searched: only the pinned saved lowerings trial
        pinned = {"objective": "memory", "low_precision": "off", "measurement": {"speed_margin": 0.9},
                  "precisions": {"saved": "fp8"},
                  "include_dimensions": {"saved": ["l2", "l3", "l4"]}, "tolerance": 0.01}
    pinned["measurement"] = {"profile_steps": 2, "profile_warmup": 1, **pinned.get("measurement", {})}
    search = CoMPSearch(**{"low_precision": "bf16", **pinned}, verbose=False, trial_batches=trial_batches)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=3, plugins=[CoMPPrecision()],
        # EarlyStopping reduces its decision across ranks: both must pause it at the same epochs, or this hangs
        callbacks=[search, EarlyStopping(monitor="val_loss", patience=100), PlanLog(out), ReleaseProcessGroup()],
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=str(out),
    )
    train, val = loaders(n_train=1024, n_val=256, batch_size=128)
    trainer.fit(WideMLP(width=256), train, val)


if __name__ == "__main__":
    main()
