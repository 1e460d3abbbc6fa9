"""The operator types the simulation checks, each in a tiny model that feeds it what it gets in training.

Every :class:`Case` builds a fresh model (on the CPU, seeded) and a batch for it, and names the operator type it is
about: the grid of the closing note is these cases x the simulated GPUs x {bf16, fp16} x saved precisions.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CASES", "Case", "installed"]


def installed(module: str | None) -> bool:
    """Whether a case's optional library is installed (``None``: it needs none)."""
    return module is None or importlib.util.find_spec(module) is not None
WIDTH, SEQ, VOCAB, CLASSES, BATCH = 16, 6, 24, 4, 3


class Head(nn.Module):
    """``body`` then a Linear head; the loss is the caller's (outside every operator, as in a LightningModule)."""

    def __init__(self, body: nn.Module, features: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(features, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if isinstance(out, tuple):  # recurrent modules return (output, state)
            out = out[0]
        if out.dim() > 2:
            out = out.flatten(1)
        return self.head(out)


class Attention(nn.Module):
    """``nn.MultiheadAttention`` on a projected input (self-attention, batch first)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mha = nn.MultiheadAttention(WIDTH, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.mha(h, h, h, need_weights=False)[0]


class LanguageHead(nn.Module):
    """A token model's logits, flattened to ``(batch, seq * vocab)`` for the shared loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model(tokens)
        logits = out.logits if hasattr(out, "logits") else out
        return logits[:, -1, :CLASSES]


@dataclass(frozen=True)
class Case:
    """An operator type in a model.

    Attributes:
        name: the case's id (the operator type).
        build: a fresh model (CPU, FP32).
        batch: its input (CPU).
        types: the operator class names the case is about (each must be hooked and lowered).
        needs: an optional module the case needs installed.
    """

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], torch.Tensor]
    types: tuple[str, ...]
    needs: str | None = None



def _vectors() -> torch.Tensor:
    return torch.randn(BATCH, WIDTH)


def _sequences() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, WIDTH)


def _signals() -> torch.Tensor:
    return torch.randn(BATCH, 4, SEQ * 2)


def _images() -> torch.Tensor:
    return torch.randn(BATCH, 3, 8, 8)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def _gpt2() -> nn.Module:
    from lightning_comp.zoo import HFGPT2

    return LanguageHead(HFGPT2(width=WIDTH, depth=1, heads=2, block_size=SEQ * 2))


def _litgpt() -> nn.Module:
    from lightning_comp.zoo import LitGPT

    return LanguageHead(LitGPT(width=WIDTH, depth=1, heads=4, query_groups=2, block_size=SEQ * 2, vocab_size=VOCAB))


def _x_transformer() -> nn.Module:
    from lightning_comp.zoo import XTransformerLM

    return LanguageHead(XTransformerLM(width=WIDTH, depth=1, heads=2, block_size=SEQ * 2, vocab_size=VOCAB))


def _zoo_gpt() -> nn.Module:
    from lightning_comp.zoo import CharGPT

    return LanguageHead(CharGPT(width=WIDTH, depth=1, heads=2, block_size=SEQ * 2, vocab_size=VOCAB))


def _zoo_lstm() -> nn.Module:
    from lightning_comp.zoo import CharLSTM

    return LanguageHead(CharLSTM(width=WIDTH, embed_dim=8, vocab_size=VOCAB))


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    """The step's loss, computed by the caller outside every operator (fixed targets)."""
    target = torch.arange(logits.shape[0], device=logits.device) % CLASSES
    return F.cross_entropy(logits, target)


CASES: tuple[Case, ...] = (
    Case("Linear", lambda: Head(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()), WIDTH), _vectors, ("Linear",)),
    Case("Conv1d+BatchNorm1d",
         lambda: Head(nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU()), 8 * SEQ * 2),
         _signals, ("Conv1d", "BatchNorm1d")),
    Case("Conv2d+BatchNorm2d+GroupNorm",
         lambda: Head(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                    nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU()), 8 * 8 * 8),
         _images, ("Conv2d", "BatchNorm2d", "GroupNorm")),
    Case("LayerNorm", lambda: Head(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)), WIDTH),
         _vectors, ("LayerNorm",)),
    Case("RMSNorm", lambda: Head(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.RMSNorm(WIDTH)), WIDTH),
         _vectors, ("RMSNorm",)),
    Case("Embedding", lambda: Head(nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH)), SEQ * WIDTH),
         _tokens, ("Embedding",)),
    Case("LSTM", lambda: Head(nn.LSTM(WIDTH, WIDTH, batch_first=True), SEQ * WIDTH), _sequences, ("LSTM",)),
    Case("GRU", lambda: Head(nn.GRU(WIDTH, WIDTH, batch_first=True), SEQ * WIDTH), _sequences, ("GRU",)),
    Case("MultiheadAttention", lambda: Head(Attention(), SEQ * WIDTH), _sequences, ("MultiheadAttention",)),
    Case("zoo GPT (SDPA module)", _zoo_gpt, _tokens, ("ScaledDotProductAttention", "LayerNorm", "Embedding")),
    Case("zoo LSTM", _zoo_lstm, _tokens, ("LSTM", "Embedding")),
    Case("GPT-2 (Conv1D, GPT2Attention)", _gpt2, _tokens, ("Conv1D", "GPT2Attention", "LayerNorm", "Embedding"),
         needs="transformers"),
    # functional operators: attention computed between modules (SDPA with grouped-query heads; einsum)
    Case("litgpt (CausalSelfAttention, RMSNorm)", _litgpt, _tokens, ("CausalSelfAttention", "Linear", "Embedding"),
         needs="litgpt"),
    # (not litgpt's mixture of experts: its routing, torch.where(mask), has data-dependent shapes that fake tensors
    # cannot compute; the CPU tests train it)
    Case("x-transformers (Attend: einsum)", _x_transformer, _tokens, ("Attend", "Linear"), needs="x_transformers"),
)
