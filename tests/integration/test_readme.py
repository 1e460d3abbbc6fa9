"""Every ``python`` snippet in README.md runs, in order, against a small model and small data."""

from __future__ import annotations

import os
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.paths import REPO

README = REPO / "README.md"


class _Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)  # README's optimizer-state snippet needs Adam(W)


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.slow
def test_readme_python_snippets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snippets = _snippets()
    assert snippets, "README.md has python snippets"
    monkeypatch.chdir(tmp_path)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 3, (64,)))
    namespace = {
        "model": _Model(),
        "train_loader": DataLoader(data, batch_size=16),
        "val_loader": DataLoader(data, batch_size=16),
    }
    # Snippets set process-wide variables (Lightning sets MASTER_PORT, seeding sets PL_GLOBAL_SEED). They are put back
    # afterwards: a later test's DDP subprocess would inherit a port this process still holds (EADDRINUSE).
    environment = dict(os.environ)
    try:
        for snippet in snippets:
            exec(compile(snippet, str(README), "exec"), namespace)  # noqa: S102 - executing our own documentation
    finally:
        os.environ.clear()
        os.environ.update(environment)
