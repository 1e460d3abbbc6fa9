"""Quick start: search a per-operator precision plan for a model on MNIST-1D, then train with it.

    python examples/quickstart.py                 # ~1-2 minutes on a 2-core CPU
    python examples/quickstart.py --epochs 3 --width 256 --samples 2000

MNIST-1D is generated locally by the ``mnist1d`` package (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch
from mnist1d.data import get_dataset_args, make_dataset
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_comp import CoMPPrecision, CoMPSearch


class MLP(pl.LightningModule):
    """A plain MLP classifier; nothing in it knows about precision."""

    def __init__(self, width: int = 1024, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(40, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

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
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def mnist1d_loaders(samples: int, batch_size: int) -> tuple[DataLoader, DataLoader]:
    """MNIST-1D, generated locally and deterministically."""
    args = get_dataset_args()
    args.num_samples = samples
    data = make_dataset(args)
    train = TensorDataset(torch.as_tensor(data["x"], dtype=torch.float32), torch.as_tensor(data["y"]).long())
    val = TensorDataset(torch.as_tensor(data["x_test"], dtype=torch.float32), torch.as_tensor(data["y_test"]).long())
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(val, batch_size=batch_size)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", default="outputs/quickstart")
    args = parser.parse_args(argv)

    pl.seed_everything(0)
    train, val = mnist1d_loaders(args.samples, args.batch_size)
    plugin, search = CoMPPrecision(), CoMPSearch(monitor="val_loss", tolerance=0.05)
    trainer = pl.Trainer(
        accelerator="cpu" if not torch.cuda.is_available() else "auto",
        max_epochs=args.epochs,
        plugins=[plugin],
        callbacks=[search],
        default_root_dir=args.out,
        enable_progress_bar=False,
    )
    started = time.perf_counter()
    trainer.fit(MLP(width=args.width), train, val)
    seconds = time.perf_counter() - started
    print(plugin.plan.summary(trainer.lightning_module))
    metrics = trainer.callback_metrics
    result = {"val_loss": float(metrics["val_loss"]), "val_acc": float(metrics["val_acc"]), "seconds": seconds}
    print(f"final val_loss {result['val_loss']:.4f}  val_acc {result['val_acc']:.3f}  wall {seconds:.1f} s")
    return result


if __name__ == "__main__":
    main()
