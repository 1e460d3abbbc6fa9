"""Train an explicit plan that lowers LSTM, GRU, Conv1d, BatchNorm1d, LayerNorm and Linear to BF16, then run
``CoMPSearch()`` with its defaults, and write what happened as JSON.

Run by ``tests/integration/test_cpu_classes.py`` in a subprocess whose environment sets the CPU class, e.g.
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``: ATen and oneDNN then run their AVX2 kernels on any x86 CPU,
as on an AVX2-only machine (BF16 emulated, CPU-autocast BF16 LSTM unavailable).

Usage: ``python tests/scripts/cpu_class_run.py OUT.json``
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_comp import CoMPPrecision, CoMPSearch
from lightning_comp.devices import device_class
from lightning_comp.devices.lowering import lowering_for
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.search.record.text import format_record
from tests.helpers.recording import DtypeRecorder

LOWERED = ("lstm", "gru", "conv", "bn", "ln", "fc", "head")
# the aten ops that do each operator's arithmetic (what must run in the planned dtype)
WORK_OPS = {"lstm": ("lstm", "mkldnn_rnn", "_thnn_fused_lstm_cell", "linear", "addmm", "mm"),
            "gru": ("gru", "_thnn_fused_gru_cell", "linear", "addmm", "mm"),
            "conv": ("convolution", "mkldnn_convolution", "_convolution", "conv1d"),
            "bn": ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                   "batch_norm"),
            "ln": ("native_layer_norm", "layer_norm"),
            "fc": ("addmm", "mm", "linear"),
            "head": ("addmm", "mm", "linear")}


class SequenceNet(pl.LightningModule):
    """``emb -> lstm -> gru -> conv (Conv1d) -> bn (BatchNorm1d) -> act -> flat -> fc -> ln -> head``."""

    VOCAB, SEQ, CLASSES = 16, 8, 4

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(self.VOCAB, width)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.conv = nn.Conv1d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm1d(width)
        self.act = nn.ReLU()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(width * self.SEQ, 32)
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, self.CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, _ = self.lstm(self.emb(tokens))
        x, _ = self.gru(x)
        x = self.act(self.bn(self.conv(x.transpose(1, 2))))
        return self.head(self.ln(self.fc(self.flat(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        loss = nn.functional.cross_entropy(self(tokens), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, labels = batch
        self.log("val_loss", nn.functional.cross_entropy(self(tokens), labels))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def _loader(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SequenceNet.VOCAB, (128, SequenceNet.SEQ), generator=g)
    return DataLoader(TensorDataset(tokens, tokens.sum(1) % SequenceNet.CLASSES), batch_size=32)


class Observe(Callback):
    """Records the aten ops of the first training step, and parameter/gradient dtypes before each optimizer step."""

    def __init__(self) -> None:
        self.recorder = DtypeRecorder()
        self.param_dtypes: set[str] = set()
        self.grad_dtypes: set[str] = set()
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 0:
            self.recorder.attach(pl_module, LOWERED)
            self.recorder.__enter__()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        for p in pl_module.parameters():
            self.param_dtypes.add(str(p.dtype))
            if p.grad is not None:
                self.grad_dtypes.add(str(p.grad.dtype))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
                           ) -> None:
        if self.recorder._handles:  # noqa: SLF001 - end of the recorded step
            self.recorder.__exit__(None, None, None)
            self.recorder.detach()
        self.losses.append(float(outputs["loss"]))


def _trainer(root: Path, plugin: CoMPPrecision, callbacks: list[Callback], max_epochs: int) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, plugins=[plugin], callbacks=callbacks,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      default_root_dir=str(root))


def main(out: Path) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    pl.seed_everything(0)
    root = out.parent
    result: dict[str, Any] = {"capability": torch.backends.cpu.get_cpu_capability(),
                              "device_class": device_class("cpu").to_dict()}
    # 1. an explicit plan lowering every operator family to bf16 trains to the end
    plugin = CoMPPrecision({name: "bf16" for name in LOWERED})
    observe = Observe()
    model = SequenceNet()
    _trainer(root, plugin, [observe], max_epochs=2).fit(model, _loader(1), _loader(2))
    lowering = {name: lowering_for(module, plugin.executor.precisions()[name], "cpu").value  # type: ignore[union-attr]
                for name, module in iter_operators(model)}
    work: dict[str, list[str]] = {}
    for name in LOWERED:
        dtypes = {str(d) for r in observe.recorder.ops_of(name, *WORK_OPS[name]) for d in r.inputs}
        work[name] = sorted(dtypes)
    result["explicit"] = {
        "steps": plugin.optimizer_steps, "losses": observe.losses, "lowering": lowering, "work_dtypes": work,
        "precisions": {n: p.value for n, p in plugin.executor.precisions().items()},
        "param_dtypes": sorted(observe.param_dtypes), "grad_dtypes": sorted(observe.grad_dtypes),
        "finite": all(math.isfinite(v) for v in observe.losses),
    }
    # 2. the default search decides from this device
    pl.seed_everything(0)
    search = CoMPSearch(verbose=False, record_dir=str(root / "record"))
    trainer = _trainer(root, CoMPPrecision(), [search], max_epochs=2)
    trainer.fit(SequenceNet(), _loader(1), _loader(2))
    record = search.record or {}
    result["search"] = {"low_precision": record.get("low_precision"), "finish_reason": record.get("finish_reason"),
                        "trials": len(record.get("trials", [])), "extension_epochs": record.get("extension_epochs"),
                        "epochs": trainer.current_epoch, "num_operators": record.get("num_operators"),
                        "model_operators": len(list(iter_operators(trainer.lightning_module))),
                        "report": format_record(record)}
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
