"""Your own Hydra app with ``precision=comp`` (or any shipped precision option): no wiring code of its own.

    python examples/hydra_app.py                        # precision=comp
    python examples/hydra_app.py precision=bf16-mixed   # fp32 | bf16-mixed | 16-mixed | bf16-true | comp

``examples/hydra_app.yaml`` puts ``pkg://lightning_comp.conf`` on Hydra's search path and selects a ``precision``
option; ``instantiate(cfg.precision)`` builds that option's Trainer arguments (``precision``, ``plugins``,
``callbacks``: ``CoMPPrecision`` and ``CoMPSearch`` for ``comp``).
"""

from __future__ import annotations

import hydra
import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import DataLoader, TensorDataset


class Regressor(pl.LightningModule):
    """A tiny MLP that fits ``y = sin(sum(x))``; it logs ``val_loss``, the metric CoMPSearch judges by."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

    def _loss(self, batch: list[torch.Tensor], name: str) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        self.log(name, loss)
        return loss

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch, "train_loss")

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch, "val_loss")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader(seed: int) -> DataLoader:
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=32)


@hydra.main(version_base="1.3", config_path=".", config_name="hydra_app")
def main(cfg: DictConfig) -> float:
    """Train the regressor under the selected precision; return the final ``val_loss``."""
    pl.seed_everything(int(cfg.seed))
    trainer = instantiate(cfg.trainer, **instantiate(cfg.precision))  # all the wiring precision=... needs
    trainer.fit(Regressor(), loader(0), loader(1))
    val_loss = float(trainer.callback_metrics["val_loss"])
    print(f"RESULT precision={cfg.precision.name} trainer_precision={trainer.precision} "
          f"plugin={type(trainer.precision_plugin).__name__} val_loss={val_loss:.4f}", flush=True)
    return val_loss


if __name__ == "__main__":
    main()
