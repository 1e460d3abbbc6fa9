"""LightningModules of the zoo.

All models share one size vocabulary, ``width`` and ``depth``, so that a single Hydra option (``size=tiny``) can shrink
any of them; each model documents what the two mean for it. Every model logs

* ``train_loss`` (per step, this process: no collective per step) and ``train_loss_epoch`` (epoch mean over all
  processes, synchronised once per epoch),
* ``val_loss`` (``sync_dist=True``), and
* a torchmetrics validation metric: ``val_acc`` (classifiers) or ``val_ppl`` and ``val_bpc`` (language models).

``val_metric``/``val_metric_mode`` name the model's headline metric for reports. The loss is always computed in FP32
(``logits.float()``, a function rather than a module, so no plan can lower it): the loss and the metric are reductions,
which should not run in a 16-bit type.

All layers are ``nn.Module``s, so every operator is visible to ``named_modules()`` and can be addressed by a plan.
"""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from lightning_comp.errors import ConfigError
from lightning_comp.zoo.data import check_positive_int
from lightning_comp.zoo.layers import ConvBNBlock
from lightning_comp.zoo.text import VOCAB_SIZE

__all__ = [
    "ClassifierModule",
    "Conv1DClassifier",
    "ConvNetBN",
    "GRUClassifier",
    "LanguageModelModule",
    "NarrowMLP",
    "ZooModule",
]

Batch = tuple[torch.Tensor, torch.Tensor]


def _check_lr(lr: Any, weight_decay: Any) -> None:
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigError(f"lr must be a number > 0, got {lr!r}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ConfigError(f"weight_decay must be a number >= 0, got {weight_decay!r}")


def _check_dropout(dropout: Any) -> float:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"dropout must be a number in [0, 1), got {dropout!r}")
    return float(dropout)


class ZooModule(pl.LightningModule):
    """Shared training logic: AdamW at a constant learning rate, FP32 cross-entropy loss, logging.

    Subclasses implement ``forward`` (returning logits) and set the class attributes below.

    Args:
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    data_kinds: ClassVar[tuple[str, ...]] = ()
    val_metric: ClassVar[str] = "val_loss"
    val_metric_mode: ClassVar[str] = "min"

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.01) -> None:
        super().__init__()
        _check_lr(lr, weight_decay)
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy in FP32 over all positions (``logits[..., C]``, ``target[...]``).

        A function, not a module, on purpose: the loss is a reduction that must stay FP32, so it is kept out of the
        operators a precision plan can address.
        """
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        """Forward, loss, log ``train_loss`` (this step, this process) and ``train_loss_epoch`` (epoch mean)."""
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=len(x))
        self.log("train_loss_epoch", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(x))
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        """Forward, loss, log ``val_loss``, update the metric."""
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        self.log("val_loss", loss, on_epoch=True, prog_bar=True, sync_dist=True, batch_size=len(x))
        self.update_metric(logits, y)
        return loss

    def update_metric(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Update and log the validation metric (subclasses)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over all parameters."""
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


class ClassifierModule(ZooModule):
    """Base of the classifiers: logs ``val_acc`` (torchmetrics ``MulticlassAccuracy``, micro average)."""

    val_metric: ClassVar[str] = "val_acc"
    val_metric_mode: ClassVar[str] = "max"

    def __init__(self, num_classes: int, lr: float = 1e-3, weight_decay: float = 0.01) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay)
        self.num_classes = check_positive_int("num_classes", num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def update_metric(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Accumulate accuracy; Lightning computes (and synchronises) it at epoch end."""
        self.val_acc(logits.float(), target)
        self.log("val_acc", self.val_acc, on_epoch=True, prog_bar=True)


class LanguageModelModule(ZooModule):
    """Base of the byte-level language models: logs ``val_ppl`` (torchmetrics ``Perplexity``) and ``val_bpc``.

    ``val_bpc`` is ``log2(val_ppl)``: bits per byte (= per character for ASCII text).
    """

    data_kinds: ClassVar[tuple[str, ...]] = ("tokens",)
    val_metric: ClassVar[str] = "val_bpc"
    val_metric_mode: ClassVar[str] = "min"

    def __init__(self, vocab_size: int = VOCAB_SIZE, lr: float = 1e-3, weight_decay: float = 0.01) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay)
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        self.val_ppl = Perplexity()

    def update_metric(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Accumulate perplexity state (FP32 logits)."""
        self.val_ppl.update(logits.float(), target)

    def on_validation_epoch_end(self) -> None:
        """Log ``val_ppl`` and ``val_bpc`` (the metric synchronises its state across processes in ``compute``)."""
        ppl = self.val_ppl.compute()
        self.log("val_ppl", ppl, prog_bar=True, sync_dist=True)
        self.log("val_bpc", torch.log2(ppl), sync_dist=True)
        self.val_ppl.reset()


class Conv1DClassifier(ClassifierModule):
    """1-D CNN for MNIST-1D: ``depth`` stride-2 ``Conv1d``+``ReLU`` layers of ``width`` channels, then a ``Linear``.

    Args:
        width: Channels of every convolution.
        depth: Number of convolutions.
        kernel_size: Odd kernel size.
        length: Input length (40 for MNIST-1D); fixes the size of the classifier layer.
        num_classes: Output classes.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    data_kinds: ClassVar[tuple[str, ...]] = ("signal",)

    def __init__(
        self,
        width: int = 64,
        depth: int = 3,
        kernel_size: int = 5,
        length: int = 40,
        num_classes: int = 10,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(num_classes=num_classes, lr=lr, weight_decay=weight_decay)
        check_positive_int("width", width)
        check_positive_int("depth", depth)
        check_positive_int("length", length)
        if check_positive_int("kernel_size", kernel_size) % 2 == 0:
            raise ConfigError(f"kernel_size must be odd, got {kernel_size}")
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Conv1d(1 if i == 0 else width, width, kernel_size, stride=2, padding=kernel_size // 2)]
            layers += [nn.ReLU()]
        self.features = nn.Sequential(*layers)
        out_len = length
        for _ in range(depth):
            out_len = (out_len + 2 * (kernel_size // 2) - kernel_size) // 2 + 1
        self.flatten = nn.Flatten()
        self.head = nn.Linear(width * out_len, num_classes)
        self.save_hyperparameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, L]`` signals to ``[B, num_classes]`` logits."""
        return self.head(self.flatten(self.features(x.unsqueeze(1))))


class GRUClassifier(ClassifierModule):
    """GRU for MNIST-1D: the signal is read one sample per time step; the last output feeds a ``Linear``.

    Args:
        width: GRU hidden size.
        depth: Stacked GRU layers.
        num_classes: Output classes.
        dropout: Dropout between GRU layers (needs ``depth > 1``).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    data_kinds: ClassVar[tuple[str, ...]] = ("signal",)

    def __init__(
        self,
        width: int = 128,
        depth: int = 2,
        num_classes: int = 10,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(num_classes=num_classes, lr=lr, weight_decay=weight_decay)
        check_positive_int("width", width)
        check_positive_int("depth", depth)
        self.gru = nn.GRU(1, width, num_layers=depth, batch_first=True, dropout=_check_dropout(dropout))
        self.head = nn.Linear(width, num_classes)
        self.save_hyperparameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, L]`` signals to ``[B, num_classes]`` logits."""
        out, _ = self.gru(x.unsqueeze(-1))
        return self.head(out[:, -1])


class NarrowMLP(ClassifierModule):
    """A deep, narrow MLP: only tiny operators (the case where low precision cannot pay on a CPU).

    ``Linear(in, width)``, then ``depth - 1`` times ``Linear(width, width)``, each followed by ``ReLU``, then a
    ``Linear(width, num_classes)``.

    Args:
        width: Hidden width.
        depth: Hidden layers.
        in_features: Input size (40 for MNIST-1D).
        num_classes: Output classes.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    data_kinds: ClassVar[tuple[str, ...]] = ("signal",)

    def __init__(
        self,
        width: int = 32,
        depth: int = 8,
        in_features: int = 40,
        num_classes: int = 10,
        lr: float = 2e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(num_classes=num_classes, lr=lr, weight_decay=weight_decay)
        check_positive_int("width", width)
        check_positive_int("depth", depth)
        check_positive_int("in_features", in_features)
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(in_features if i == 0 else width, width), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)
        self.save_hyperparameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, in_features]`` to ``[B, num_classes]`` logits."""
        return self.head(self.body(x.flatten(1)))


class ConvNetBN(ClassifierModule):
    """VGG-style image classifier with BatchNorm.

    ``depth`` stages; stage ``i`` has two :class:`~lightning_comp.zoo.layers.ConvBNBlock` of ``width * 2**i``
    channels and a 2x2 max-pool; then global average pooling and a ``Linear``.

    Args:
        width: Channels of the first stage.
        depth: Number of stages (each halves the resolution; the image side must be >= ``2**depth``).
        in_channels: Image channels.
        num_classes: Output classes.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    data_kinds: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(
        self,
        width: int = 32,
        depth: int = 3,
        in_channels: int = 3,
        num_classes: int = 10,
        lr: float = 2e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(num_classes=num_classes, lr=lr, weight_decay=weight_decay)
        check_positive_int("width", width)
        check_positive_int("depth", depth)
        check_positive_int("in_channels", in_channels)
        stages: list[nn.Module] = []
        channels = in_channels
        for i in range(depth):
            out = width * 2**i
            stages.append(nn.Sequential(ConvBNBlock(channels, out), ConvBNBlock(out, out), nn.MaxPool2d(2)))
            channels = out
        self.features = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.head = nn.Linear(channels, num_classes)
        self.save_hyperparameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, C, H, W]`` images to ``[B, num_classes]`` logits."""
        return self.head(self.flatten(self.pool(self.features(x))))
