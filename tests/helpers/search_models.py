"""Small Lightning models and data for the search tests (importable by subprocess scripts too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_comp import CoMPSearch
from lightning_comp.search.rewind.snapshot import TrainingSnapshot

OFFSET = 4096.0  # bf16 spacing at 4096 is 32: an input of this offset loses its O(1) signal entirely
TOLERANCE = 0.05


def search_trainer(tmp_path: Path, callbacks: list[Callback], max_epochs: int, plugin: Any = None,
                   **kwargs: Any) -> pl.Trainer:
    """A quiet single-process CPU Trainer for the search tests."""
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, plugins=[plugin] if plugin else None,
                      callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), **kwargs)


def fixed_search(**kwargs: Any) -> CoMPSearch:
    """A search whose candidates for WideMLP are fixed (l2, l3, l4) in BF16, so convergence behaviour is
    deterministic whatever the (noisy, shared) machine measures and whether its CPU makes BF16 fast (on AVX2-only
    CPUs ``low_precision="auto"`` would not search at all); the batch stage's own decisions are tested separately."""
    kwargs.setdefault("low_precision", "bf16")  # pinned: trials run on every CPU class, emulated BF16 included
    kwargs.setdefault("include", ["l2", "l3", "l4"])
    kwargs.setdefault("exclude", ["l1", "head", "a?"])
    kwargs.setdefault("tolerance", TOLERANCE)
    kwargs.setdefault("verbose", False)
    kwargs["measurement"] = {"profile_steps": 3, **kwargs.get("measurement", {})}
    return CoMPSearch(**kwargs)


class SearchProbe(Callback):
    """Per epoch: the plan in force at its start and the batches it trained; per trial after the first: whether its
    start restored the search's snapshot bit for bit."""

    def __init__(self, search: CoMPSearch) -> None:
        self.search = search
        self.plans: list[dict[str, str]] = []
        self.batches: list[int] = []
        self.rewinds_exact: list[bool] = []
        self._trials_seen = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.plans.append({s: p.value for s, p in trainer.precision_plugin.plan["compute"].entries})
        self.batches.append(0)
        state = self.search.state
        if len(state.trials) > self._trials_seen and len(state.trials) > 1 and state.snapshot is not None:
            self.rewinds_exact.append(TrainingSnapshot.from_state(state.snapshot).matches(trainer, pl_module))
        self._trials_seen = len(state.trials)

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches[-1] += 1


def teacher_data(n: int, seed: int, features: int = 64, classes: int = 10) -> TensorDataset:
    """Inputs ~ N(0, 1) labelled by a fixed random linear teacher (the same teacher for every seed)."""
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(seed))
    w = torch.randn(features, classes, generator=torch.Generator().manual_seed(1234))
    return TensorDataset(x, (x @ w).argmax(1))


def loaders(n_train: int = 2048, n_val: int = 512, batch_size: int = 256) -> tuple[DataLoader, DataLoader]:
    train = DataLoader(teacher_data(n_train, 1), batch_size=batch_size, shuffle=True)
    val = DataLoader(teacher_data(n_val, 2), batch_size=batch_size)
    return train, val


class Classifier(pl.LightningModule):
    """Logs ``train_loss``, ``val_loss`` and ``val_acc``; subclasses define ``forward``."""

    lr = 1e-3

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class WideMLP(Classifier):
    """Linear layers; with ``offset=True`` layer ``l3`` is unsafe in bf16 (whatever the width).

    The default width (256) keeps trials quick where BF16 is emulated (AVX2-only CPUs, ~30x slower than FP32 there).

    ``l3`` receives ``h + OFFSET`` and its response to the constant is subtracted again, so in FP32 the layer
    computes ``W h + b`` exactly, while in BF16 the rounding of ``h + OFFSET`` (spacing 32) erases ``h``.
    """

    def __init__(self, width: int = 256, offset: bool = True) -> None:
        super().__init__()
        self.offset = offset
        self.l1 = nn.Linear(64, width)
        self.a1 = nn.ReLU()
        self.l2 = nn.Linear(width, width)
        self.a2 = nn.ReLU()
        self.l3 = nn.Linear(width, width)
        self.a3 = nn.ReLU()
        self.l4 = nn.Linear(width, width)
        self.a4 = nn.ReLU()
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a2(self.l2(self.a1(self.l1(x))))
        h = self.l3(h + OFFSET) - OFFSET * self.l3.weight.sum(1) if self.offset else self.l3(h)
        h = self.a4(self.l4(self.a3(h)))
        return self.head(h)


class AdamWMLP(WideMLP):
    """:class:`WideMLP` without the bf16-unsafe offset, trained with AdamW: the optimizer whose state the memory
    levers manage."""

    def __init__(self, width: int = 256) -> None:
        super().__init__(width=width, offset=False)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TinyOps(Classifier):
    """Many tiny operators: low precision cannot pay for its casts and hooks."""

    def __init__(self, depth: int = 12, width: int = 16) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(64, width), nn.Tanh()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, 10))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Fragile(nn.Linear):
    """A Linear that overflows (returns NaN/Inf) whenever it runs in 16-bit precision, like an fp16 overflow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if out.dtype != torch.float32:
            out = out * float("nan")
        return out


class FragileMLP(Classifier):
    """Linear layers of which ``bad`` produces NaN in low precision."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.l1 = nn.Linear(64, width)
        self.a1 = nn.ReLU()
        self.l2 = nn.Linear(width, width)
        self.a2 = nn.ReLU()
        self.bad = Fragile(width, width)
        self.a3 = nn.ReLU()
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a3(self.bad(self.a2(self.l2(self.a1(self.l1(x)))))))


class StateSensitiveMLP(WideMLP):
    """WideMLP whose validation loss is worse by 1.0 while ``l3``'s Adam moments are held in 8 bits.

    It stands in for a layer 8-bit Adam hurts (bitsandbytes keeps embeddings in 32 bits for that reason); a
    numerical failure depends on gradient scales this test should not have to tune, and what is tested here is
    that the search's trials see it and isolate that layer, with the real 8-bit state in the optimizer.
    """

    def __init__(self) -> None:
        super().__init__(offset=False)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        state = self.trainer.optimizers[0].state.get(self.l3.weight, {})
        if state.get("exp_avg") is not None and state["exp_avg"].dtype == torch.uint8:
            loss = loss + 1.0
        self.log("val_loss", loss)


class Fp8SensitiveMLP(WideMLP):
    """WideMLP whose validation loss is worse by 1.0 while ``l3`` computes in fp8 (in bf16 or FP32 it is not).

    It stands in for a layer fp8 hurts (torchao and Megatron keep the first and last layers in bf16 for that reason);
    what is tested is that the search's trials see it and demote that layer to bf16, with real fp8 compute in every
    trial that plans it.
    """

    def __init__(self) -> None:
        super().__init__(offset=False)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        plan = self.trainer.precision_plugin.plan
        if plan is not None and plan.of("compute", "l3", nn.Linear).is_fp8:
            loss = loss + 1.0
        self.log("val_loss", loss)
