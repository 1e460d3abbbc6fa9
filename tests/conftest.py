# ruff: noqa: E402  (torch is imported after the Inductor cache directory is chosen, below)
"""Shared fixtures: seeds, fast Trainer settings, tiny models and data, and an aten-level dtype recorder.

Everything here is small on purpose: the whole suite runs on 2 shared CPU cores.
"""

from __future__ import annotations

import getpass
import inspect
import math
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


def inductor_cache_for_capability(env: dict[str, str]) -> dict[str, str]:
    """``env`` with an Inductor cache of its own where it sets ``ATEN_CPU_CAPABILITY``.

    Inductor's on-disk cache does not tell kernels built for one ATen CPU capability from another's: a process that
    emulates the AVX2 class and a native one sharing it load each other's kernels (NaN from compiled bf16 layers under
    the emulation, heap corruption natively; seen with torch 2.13).
    """
    capability = env.get("ATEN_CPU_CAPABILITY")
    if not capability or "TORCHINDUCTOR_CACHE_DIR" in env:
        return env
    user = getpass.getuser()
    return {**env, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_{capability}")}


# before torch is imported: Inductor fixes its cache directory the first time it looks it up
os.environ.update(inductor_cache_for_capability(dict(os.environ)))  # the suite run as an emulated class

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, TensorDataset

SEED = 0
#: ``Trainer.fit(..., weights_only=True)`` where Lightning has the argument (2.5+); older ones load with torch's
#: default, which is ``weights_only=True`` in torch 2.6+ anyway.
_FIT_PARAMETERS = inspect.signature(pl.Trainer.fit).parameters
WEIGHTS_ONLY: dict[str, Any] = {"weights_only": True} if "weights_only" in _FIT_PARAMETERS else {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``needs_native_bf16`` tests (their point is speed) where this CPU emulates BF16, saying so."""
    from lightning_comp.devices.device_class import device_class

    cpu = device_class("cpu")
    if cpu.is_native("bf16"):
        return
    skip = pytest.mark.skip(reason=f"BF16 is emulated on this CPU ({cpu.describe()}): the speed-up this test is"
                                   " about does not exist here")
    for item in items:
        if "needs_native_bf16" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything() -> Iterator[None]:
    """Every test starts from the same RNG state (torch, python), so models and data are reproducible."""
    random.seed(SEED)
    torch.manual_seed(SEED)
    yield


@pytest.fixture
def seed() -> int:
    """The seed the RNGs were set to before the test (re-seed with it to rebuild an identical model)."""
    return SEED


@pytest.fixture
def fast_trainer_kwargs() -> dict[str, Any]:
    """Trainer arguments for quick CPU runs without side effects (no logger, bar, summary or checkpoints).

    Add ``devices``, ``max_steps``, ``default_root_dir``... at the call site: ``pl.Trainer(max_steps=2, **kw)``.
    """
    return dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


# ------------------------------------------------------------------------------------------------------- models
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


@pytest.fixture
def make_mlp() -> Callable[..., TinyMLP]:
    """Factory of :class:`TinyMLP` (keyword arguments go to its constructor)."""
    return TinyMLP


@pytest.fixture
def make_mixed() -> Callable[..., MixedNet]:
    """Factory of :class:`MixedNet` (keyword arguments go to its constructor)."""
    return MixedNet


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


@pytest.fixture
def make_regression_loader() -> Callable[..., DataLoader]:
    """Factory of a deterministic regression DataLoader (x: (n, d_in), y: (n, 1))."""
    return regression_loader


@pytest.fixture
def make_token_loader() -> Callable[..., DataLoader]:
    """Factory of a deterministic DataLoader of (tokens (n, MixedNet.SEQ), labels (n,)) for :class:`MixedNet`."""
    return token_loader


# ------------------------------------------------------------------------------------------------ observation
@dataclass
class OpRecord:
    module: str | None  # innermost recorded module running when the op ran (None: outside modules, e.g. backward)
    op: str  # aten overload packet name, e.g. "addmm"
    inputs: list[torch.dtype]
    outputs: list[torch.dtype]


@dataclass
class CallRecord:
    module: str
    inputs: list[torch.dtype]
    outputs: list[torch.dtype]


def _dtypes(obj: Any) -> list[torch.dtype]:
    return [t.dtype for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()]


class DtypeRecorder(TorchDispatchMode):
    """Records the dtypes of every aten op, attributed to the module whose forward was running.

    Attach it *after* the plugin has hooked the model: its pre-hook is prepended (runs before the plugin casts the
    inputs) and its post-hook is appended (runs after the plugin cast the outputs), so the casts the plugin inserts
    are attributed to the operator they belong to, and :attr:`calls` shows what each operator handed on.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpRecord] = []
        self.calls: list[CallRecord] = []
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def attach(self, model: nn.Module, names: tuple[str, ...] | None = None) -> DtypeRecorder:
        for name, module in model.named_modules():
            if not name or (names is not None and name not in names):
                continue
            self._handles.append(module.register_forward_pre_hook(self._push(name), prepend=True))
            self._handles.append(module.register_forward_hook(self._pop(name), always_call=True))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _push(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(name)

        return hook

    def _pop(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._stack.pop()
            self.calls.append(CallRecord(name, _dtypes(args), _dtypes(output)))

        return hook

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        module = self._stack[-1] if self._stack else None
        self.ops.append(OpRecord(module, func.overloadpacket.__name__, _dtypes((args, kwargs)), _dtypes(out)))
        return out

    def clear(self) -> None:
        self.ops.clear()
        self.calls.clear()

    def ops_of(self, module: str, *ops: str) -> list[OpRecord]:
        return [r for r in self.ops if r.module == module and (not ops or r.op in ops)]

    def calls_of(self, module: str) -> list[CallRecord]:
        return [c for c in self.calls if c.module == module]


@pytest.fixture
def dtype_recorder() -> Iterator[DtypeRecorder]:
    """A fresh :class:`DtypeRecorder`; its hooks are removed after the test."""
    recorder = DtypeRecorder()
    yield recorder
    recorder.detach()


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB, ``20 log10(||ref|| / ||ref - out||)`` (inf if identical)."""
    ref, out = ref.detach().double(), out.detach().double()
    noise = torch.linalg.vector_norm(ref - out)
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(torch.linalg.vector_norm(ref) / noise))


@pytest.fixture
def sqnr_db() -> Callable[[torch.Tensor, torch.Tensor], float]:
    """:func:`sqnr`: ``20 log10(||ref|| / ||ref - out||)`` in dB."""
    return sqnr


def count_forward_hooks(model: nn.Module) -> int:
    """Forward pre- and post-hooks registered on ``model`` and all its submodules."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.fixture
def hook_count() -> Callable[[nn.Module], int]:
    """:func:`count_forward_hooks`."""
    return count_forward_hooks


@pytest.fixture(scope="session")
def plain_wide_mlp(tmp_path_factory: pytest.TempPathFactory) -> pl.Trainer:
    """A plain FP32 run of ``search_models.WideMLP`` for 4 epochs: the reference the search tests compare with."""
    from search_models import WideMLP, loaders, search_trainer

    pl.seed_everything(0)
    trainer = search_trainer(tmp_path_factory.mktemp("plain_fp32"), [], max_epochs=4)
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    return trainer

