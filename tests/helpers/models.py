"""Tiny models and loaders the tests share: fast on 2 shared CPU cores, deterministic."""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["MIXED_OPERATORS", "WEIGHTS_ONLY", "MixedNet", "TinyMLP", "regression_loader", "token_loader"]

#: ``Trainer.fit(..., weights_only=True)`` where Lightning has the argument (2.5+); older ones load with torch's
#: default, which is ``weights_only=True`` in torch 2.6+ anyway.
WEIGHTS_ONLY: dict[str, Any] = (
    {"weights_only": True} if "weights_only" in inspect.signature(pl.Trainer.fit).parameters else {})


class TinyMLP(pl.LightningModule):
    """``net = Sequential(Linear, ReLU, Linear, ReLU, Linear)`` regression model with every step kind."""

    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 1, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class MixedNet(pl.LightningModule):
    """A classifier over token sequences mixing every operator family the engine handles differently.

    ``emb`` (Embedding) -> ``lstm`` (LSTM) -> transpose -> ``conv`` (Conv1d) -> ``bn`` (BatchNorm1d) -> ``act``
    (ReLU) -> ``flat`` (Flatten) -> ``fc`` (Linear) -> ``ln`` (LayerNorm) -> ``head`` (Linear).
    """

    VOCAB, SEQ, CLASSES = 32, 6, 4

    def __init__(self, emb: int = 8, hidden: int = 12, channels: int = 8, width: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.emb = nn.Embedding(self.VOCAB, emb)
        self.lstm = nn.LSTM(emb, hidden, batch_first=True)
        self.conv = nn.Conv1d(hidden, channels, 3, padding=1)
        self.bn = nn.BatchNorm1d(channels)
        self.act = nn.ReLU()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(channels * self.SEQ, width)
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, self.CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        x, _ = self.lstm(x)
        x = self.act(self.bn(self.conv(x.transpose(1, 2))))
        return self.head(self.ln(self.fc(self.flat(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        return nn.functional.cross_entropy(self(tokens), labels)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, labels = batch
        self.log("val_loss", nn.functional.cross_entropy(self(tokens), labels))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


MIXED_OPERATORS = ("emb", "lstm", "conv", "bn", "act", "flat", "fc", "ln", "head")


def regression_loader(n: int = 64, d_in: int = 8, batch_size: int = 16, seed: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def token_loader(n: int = 64, batch_size: int = 16, seed: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MixedNet.VOCAB, (n, MixedNet.SEQ), generator=g)
    labels = tokens.sum(dim=1) % MixedNet.CLASSES
    return DataLoader(TensorDataset(tokens, labels), batch_size=batch_size)
