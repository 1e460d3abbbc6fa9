"""A rewind restores everything a rejected trial touched: non-persistent buffers, stateful callbacks, the
dataloaders' own generators (so every trial sees the reference's batches), optimizers strictly paired."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

from lightning_comp import CoMPPrecision, CoMPSearch
from lightning_comp.distributed import WorkerScaledLR
from lightning_comp.errors import SearchConfigError, SnapshotMismatchError
from lightning_comp.search.rewind.snapshot import TrainingSnapshot
from tests.helpers.search_models import WideMLP, fixed_search, search_trainer, teacher_data


class CountingMLP(WideMLP):
    """``WideMLP`` (``l3`` unsafe in bf16) with a non-persistent buffer that counts training forwards."""

    def __init__(self) -> None:
        super().__init__(width=64)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards += 1
        return super().forward(x)


class ParamAverage(Callback):
    """A stateful callback like an EMA: a running average of the weights, updated after every step."""

    def __init__(self) -> None:
        self.average: dict[str, torch.Tensor] = {}
        self.updates = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.updates += 1
        for name, param in pl_module.named_parameters():
            old = self.average.get(name, param.detach().clone())
            self.average[name] = 0.9 * old + 0.1 * param.detach()

    def state_dict(self) -> dict[str, Any]:
        return {"average": {k: v.clone() for k, v in self.average.items()}, "updates": self.updates}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.average = {k: v.clone() for k, v in state_dict["average"].items()}
        self.updates = int(state_dict["updates"])


class FirstBatches(Callback):
    """The sum of the first training batch of every epoch: equal sums = the same batch order."""

    def __init__(self, search: CoMPSearch) -> None:
        self.search = search
        self.first: list[tuple[int, int, float]] = []  # (epoch, trials so far, sum of the first batch's inputs)
        self.exact: list[bool] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self.search.state
        if len(state.trials) > 1 and state.snapshot is not None and state.current_trial is not None \
                and state.current_trial.start_epoch == trainer.current_epoch:
            self.exact.append(TrainingSnapshot.from_state(state.snapshot).matches(trainer, pl_module))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx == 0:
            self.first.append((trainer.current_epoch, len(self.search.state.trials), float(batch[0].sum())))


def _loaders(seed: int) -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(seed)  # the user's own generator: it advances every epoch
    train = DataLoader(teacher_data(512, 1), batch_size=64, shuffle=True, generator=generator)
    return train, DataLoader(teacher_data(128, 2), batch_size=64)


@pytest.mark.slow
def test_rejected_trials_are_rewound_with_buffers_callbacks_and_batch_order(tmp_path: Path) -> None:
    pl.seed_everything(0)
    search = fixed_search()  # l2, l3, l4 in bf16: "all candidates" fails on l3 and is rewound
    batches = FirstBatches(search)
    average, lr = ParamAverage(), WorkerScaledLR(workers=2)
    trainer = search_trainer(tmp_path, [search, batches, average, lr], max_epochs=4, plugin=CoMPPrecision())
    train, val = _loaders(7)
    model = CountingMLP()
    trainer.fit(model, train, val)
    record = search.record
    assert record is not None and any(t["verdict"] == "fail" for t in record["trials"][1:]), record["trials"]
    # every trial after the first started from the snapshot bit for bit: the buffer, both callbacks, the generator
    assert batches.exact and all(batches.exact), batches.exact
    # so every trial saw the batch order of the reference trial
    start = record["search_start_epoch"]
    trial_starts = [s for e, _, s in batches.first if e >= start][: len(record["trials"])]  # one epoch per trial
    assert len(trial_starts) == len(record["trials"]) and len(set(trial_starts)) == 1, batches.first
    # the kept progress counts like a plain run's: forwards and callback updates of rejected trials were rewound
    kept = 4 * len(train)  # a plain run's steps (global_step also counts the rejected trials' steps)
    assert trainer.global_step == kept + record["extension_epochs"] * len(train)
    assert average.updates == kept and lr.steps == [kept]
    assert int(model.forwards) == kept  # the batch stage's measuring forwards were rewound too


def test_a_snapshot_refuses_to_restore_onto_other_optimizers() -> None:
    model = nn.Linear(2, 2)
    one = SimpleNamespace(optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)], lr_scheduler_configs=[],
                          callbacks=[], fit_loop=SimpleNamespace())
    module = pl.LightningModule()
    module.layer = model
    snapshot = TrainingSnapshot.capture(one, module)  # type: ignore[arg-type]
    two = SimpleNamespace(optimizers=one.optimizers * 2, lr_scheduler_configs=[], callbacks=[],
                          fit_loop=SimpleNamespace())
    with pytest.raises(SnapshotMismatchError, match=r"1 optimizer\(s\) captured, 2 now"):
        snapshot.restore(two, module)  # type: ignore[arg-type]
    snapshot.restore(one, module)  # type: ignore[arg-type]


def test_snapshots_can_be_kept_on_the_cpu() -> None:
    model = pl.LightningModule()
    model.layer = nn.Linear(2, 2)
    trainer = SimpleNamespace(optimizers=[torch.optim.Adam(model.parameters())], lr_scheduler_configs=[],
                              callbacks=[], fit_loop=SimpleNamespace())
    snapshot = TrainingSnapshot.capture(trainer, model, device="cpu")  # type: ignore[arg-type]
    assert all(t.device.type == "cpu" for t in snapshot.model.values())
    assert CoMPSearch(snapshot_device="cpu").config.snapshot_device == "cpu"
    with pytest.raises(SearchConfigError, match=r"snapshot_device='gpu0'"):
        CoMPSearch(snapshot_device="gpu0")


def test_a_snapshot_tells_every_difference_from_the_live_state_bit_for_bit() -> None:
    """``matches`` (what the rewind tests rely on) sees a change in each part it compares, down to the sign of a
    zero, and a restore makes it match again."""
    model = CountingMLP()
    average = ParamAverage()

    class Capture(Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.trainer = trainer

    capture = Capture()
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, callbacks=[average, capture], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(model, DataLoader(teacher_data(64, seed=1), batch_size=16, shuffle=True,
                                  generator=torch.Generator().manual_seed(0)))
    snapshot = TrainingSnapshot.capture(trainer, model, callbacks=lambda cb: cb is average)
    assert snapshot.matches(trainer, model)
    optimizer = trainer.optimizers[0]
    changes = {
        "a weight's last bit": lambda: model.l1.weight.data.view(torch.int32).view(-1)[0].add_(1),
        "a non-persistent buffer": lambda: model.forwards.add_(1),
        "the optimizer's state": lambda: optimizer.param_groups[0].update(lr=optimizer.param_groups[0]["lr"] * 2),
        "the dataloader's generator": lambda: torch.randperm(4, generator=trainer.train_dataloader.generator),
        "a stateful callback": lambda: setattr(average, "updates", average.updates + 1),
        "a zero's sign": lambda: model.l1.bias.data.__setitem__(0, -0.0 if float(model.l1.bias[0]) == 0 else 0.0),
    }
    for what, change in changes.items():
        with torch.no_grad():
            change()
        assert not snapshot.matches(trainer, model), what
        snapshot.restore(trainer, model)
        assert snapshot.matches(trainer, model), what
