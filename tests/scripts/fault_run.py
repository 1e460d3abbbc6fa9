"""Fault-injection runs for ``tests/integration/test_faults.py``, plus the small models the fault tests share.

As a script it trains ``WideMLP`` with a deterministic ``CoMPSearch`` (candidates fixed by ``include``/``exclude``,
un-shuffled data, so nothing depends on timing or on RNG state that Lightning does not checkpoint) and a
``ModelCheckpoint(save_last=True)``. With ``--kill`` it SIGKILLs itself at a chosen point; with ``--resume`` it
resumes from ``<root>/ckpt/last.ckpt``. A finished run writes its final plan, epoch, step and a parameter digest
as JSON (``--out``), so a test can compare an interrupted-and-resumed run with an uninterrupted one.

Kill points (``--kill``):

- ``profile:N``: inside the search's batch stage, at the N-th call of ``training_step`` the profiler makes;
- ``batch:E:B``: at the end of training batch B of epoch E (e.g. in the middle of a trial epoch);
- ``epoch_start:E``: at the start of epoch E, before any callback ran: right after the checkpoint of epoch E-1.

Before it kills itself the script writes ``<root>/killed.json`` describing where it was (search phase, trials,
whether the batch stage had finished), so the test can check that the kill point is the intended one.

With ``--every-n-train-steps N`` the checkpoint is written every N optimizer steps (mid-epoch) instead of at epoch
ends. With ``--timed`` the search decides from its measurements (``TIMED_SEARCH_KWARGS``: nothing included or
excluded); with ``--busy`` the whole run competes with processes that keep every CPU busy (``competitor.py``).

Usage::

    python tests/scripts/fault_run.py --root DIR [--kill POINT] [--resume] [--out result.json] [--every-n-train-steps N]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.helpers

from tests.helpers.search_models import Classifier, WideMLP, teacher_data  # noqa: E402
from tests.scripts.competitor import competing_load  # noqa: E402

# The search the script runs: WideMLP(offset=True) with candidates l2 (safe in bf16) and l3 (unsafe in bf16).
# Everything else is excluded, so no decision depends on timing. Epochs: 0 warm-up, 1 FP32 reference,
# 2 {l2, l3} (fails), 3 {l2} (passes and is kept; {l3} is inferred unsafe), 4 the user's last epoch.
SEARCH_KWARGS: dict[str, Any] = {
    "low_precision": "bf16",  # pinned: the trials run on every CPU class
    "include": ["l2", "l3"],
    "exclude": ["l1", "l4", "head", "a?"],
    "tolerance": 0.05,
    "measurement": {"profile_steps": 2, "profile_warmup": 1},
    "verbose": False,
}
# --timed: candidates come from the batch stage's measurements, whatever they are on this machine
TIMED_SEARCH_KWARGS: dict[str, Any] = {**SEARCH_KWARGS, "include": [], "exclude": [],
                                       "measurement": {"profile_steps": 4, "profile_warmup": 1}}
MAX_EPOCHS = 3
SEARCH_WARMUP_EPOCHS = 1
WIDTH = 256


def fixed_loaders(n_train: int = 512, n_val: int = 256, batch_size: int = 64) -> tuple[DataLoader, DataLoader]:
    """Teacher data without shuffling: the batch order is the same in every process and after every resume."""
    train = DataLoader(teacher_data(n_train, 1), batch_size=batch_size, shuffle=False)
    val = DataLoader(teacher_data(n_val, 2), batch_size=batch_size)
    return train, val


# ------------------------------------------------------------------------------------------- shared fault models
class InfLinear(nn.Linear):
    """A Linear whose output is +Inf whenever it computes in a 16-bit precision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + float("inf") if out.dtype != torch.float32 else out


class InfBNMLP(Classifier):
    """BatchNorm buffers, an epoch StepLR schedule and a layer ``bad`` that yields Inf in 16-bit precision."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.l1 = nn.Linear(64, width)
        self.bn = nn.BatchNorm1d(width)
        self.a1 = nn.ReLU()
        self.l2 = nn.Linear(width, width)
        self.a2 = nn.ReLU()
        self.bad = InfLinear(width, width)
        self.a3 = nn.ReLU()
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a3(self.bad(self.a2(self.l2(self.a1(self.bn(self.l1(x))))))))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)}


class _AmplifyGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``factor`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class OverflowMLP(Classifier):
    """Two FP16 hazards on small Linear layers, and one safe layer.

    - ``big`` receives activations of ~1e5-1e6 (``h * 1e6``, scaled back after it): beyond FP16's 65504, so its
      FP16 forward is Inf. In FP32 (and BF16, with FP32's range) it computes ``W h`` exactly.
    - ``hot``'s output gradient is multiplied by 1e8 (identity forward): in FP16 its gradients overflow at any
      loss scale the scaler tries in a trial, so every step is skipped; the forward and the loss stay finite. Adam
      is invariant to that gradient scale, so the FP32 reference trains normally.
    - ``l2`` (after the amplifier, normal gradients) is safe in FP16.
    """

    big_scale = 1e6
    grad_factor = 1e8

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.l1 = nn.Linear(64, width)
        self.a1 = nn.ReLU()
        self.big = nn.Linear(width, width)
        self.hot = nn.Linear(width, width)
        self.a2 = nn.ReLU()
        self.l2 = nn.Linear(width, width)
        self.a3 = nn.ReLU()
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a1(self.l1(x))
        h = self.big(h * self.big_scale) / self.big_scale
        h = _AmplifyGrad.apply(self.hot(h), self.grad_factor)
        return self.head(self.a3(self.l2(self.a2(h))))


# ---------------------------------------------------------------------------------------------------- the script
class KillableWideMLP(WideMLP):
    """WideMLP whose ``training_step`` can SIGKILL the process at its N-th call after ``arm`` (profiling kills)."""

    def __init__(self) -> None:
        super().__init__(width=WIDTH, offset=True)
        self.calls_left: int | None = None
        self.on_kill: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.calls_left is not None:
            self.calls_left -= 1
            if self.calls_left == 0:
                self.on_kill()
        return super().training_step(batch, batch_idx)


class Killer(pl.Callback):
    """SIGKILLs the process at the point given as ``profile:N``, ``batch:E:B`` or ``epoch_start:E``."""

    def __init__(self, point: str, root: Path, search: Any) -> None:
        kind, *numbers = point.split(":")
        if kind not in ("profile", "batch", "epoch_start"):
            raise SystemExit(f"unknown kill point {point!r}: use profile:N, batch:E:B or epoch_start:E")
        self.kind, self.numbers = kind, [int(n) for n in numbers]
        self.root, self.search = root, search

    def kill(self, trainer: pl.Trainer, where: str) -> None:
        state = self.search.state
        info = {
            "where": where,
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "phase": state.phase,
            "profile_done": state.batch is not None,
            "trials": [(t.label, t.verdict) for t in state.trials],
            "decisions": _decisions(state.batch),
            "timing": None if state.batch is None else state.batch.timing,
        }
        (self.root / "killed.json").write_text(json.dumps(info))
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.kind == "epoch_start" and trainer.current_epoch == self.numbers[0]:
            self.kill(trainer, "epoch_start")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        # runs before CoMPSearch's hook (this callback comes first), i.e. before the batch stage
        state = self.search.state
        if self.kind == "profile" and state.phase != "done" and state.batch is None \
                and trainer.current_epoch >= SEARCH_WARMUP_EPOCHS and batch_idx == 0:
            pl_module.calls_left = self.numbers[0]
            pl_module.on_kill = lambda: self.kill(trainer, "profile")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.calls_left = None
        if self.kind == "batch" and (trainer.current_epoch, batch_idx) == tuple(self.numbers):
            self.kill(trainer, "batch")



def _decisions(batch: Any) -> dict[str, str] | None:
    """The batch stage's decision per operator (``None`` before it ran)."""
    if batch is None:
        return None
    return {name: decision.decision.value for name, decision in batch.decisions.items()}


def param_digest(module: nn.Module) -> str:
    """SHA-256 over every parameter and buffer: equal digests mean bit-identical model states."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_comp import CoMPPrecision, CoMPSearch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--kill", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", default=None, type=Path)
    parser.add_argument("--every-n-train-steps", default=None, type=int,
                        help="checkpoint every N steps (mid-epoch) instead of at epoch ends")
    parser.add_argument("--timed", action="store_true", help="decisions from measurements, not include/exclude")
    parser.add_argument("--busy", action="store_true", help="compete with processes keeping every CPU busy")
    args = parser.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # less contention on the shared machine; results are exact either way

    pl.seed_everything(0, verbose=False)
    search = CoMPSearch(warmup_epochs=SEARCH_WARMUP_EPOCHS, record_dir=str(args.root / "record"),
                        **(TIMED_SEARCH_KWARGS if args.timed else SEARCH_KWARGS))
    plugin = CoMPPrecision()
    callbacks: list[pl.Callback] = []
    if args.kill:
        callbacks.append(Killer(args.kill, args.root, search))
    every_n = args.every_n_train_steps
    checkpoint = ModelCheckpoint(dirpath=args.root / "ckpt", save_last=True, every_n_train_steps=every_n)
    callbacks += [search, checkpoint]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=MAX_EPOCHS,
        plugins=[plugin],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.root),
        num_sanity_val_steps=0,
    )
    model = KillableWideMLP()
    train, val = fixed_loaders()
    ckpt = args.root / "ckpt" / "last.ckpt" if args.resume else None
    with competing_load() if args.busy else contextlib.nullcontext():
        trainer.fit(model, train, val, ckpt_path=None if ckpt is None else str(ckpt))
    result = {
        "plan": {name: p.value for name, p in plugin.plan.resolve(model).items()},
        "phase": search.phase,
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "max_epochs": trainer.max_epochs,
        "trials": [(t.label, t.verdict) for t in search.state.trials],
        "extension_epochs": search.state.extension_epochs,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "digest": param_digest(model),
        "decisions": _decisions(search.state.batch),
        "timing": None if search.state.batch is None else search.state.batch.timing,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
