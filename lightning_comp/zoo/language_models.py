"""Language models of the zoo (character level, on the ``text`` data): an LSTM and a small GPT.

They share :class:`~lightning_comp.zoo.models.LanguageModelModule` (loss, ``val_ppl``/``val_bpc``) with its size
vocabulary, ``width`` and ``depth``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_comp.errors import ConfigError
from lightning_comp.zoo.data import check_positive_int
from lightning_comp.zoo.layers import TransformerBlock
from lightning_comp.zoo.models import LanguageModelModule, _check_dropout
from lightning_comp.zoo.text import VOCAB_SIZE

__all__ = ["CharGPT", "CharLSTM"]


class CharLSTM(LanguageModelModule):
    """Stacked LSTM byte-level language model (2 layers by default, as in the distributed deep-RNN paper).

    ``Embedding(vocab, embed_dim)``, ``LSTM(embed_dim, width, depth)``, ``Linear(width, vocab)``.

    Args:
        width: LSTM hidden size.
        depth: Stacked LSTM layers.
        embed_dim: Byte embedding size.
        dropout: Dropout between LSTM layers (needs ``depth > 1``).
        vocab_size: Vocabulary (256 bytes).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    def __init__(
        self,
        width: int = 512,
        depth: int = 2,
        embed_dim: int = 64,
        dropout: float = 0.0,
        vocab_size: int = VOCAB_SIZE,
        lr: float = 2e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(vocab_size=vocab_size, lr=lr, weight_decay=weight_decay)
        check_positive_int("width", width)
        check_positive_int("depth", depth)
        check_positive_int("embed_dim", embed_dim)
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, width, num_layers=depth, batch_first=True, dropout=_check_dropout(dropout))
        self.head = nn.Linear(width, vocab_size)
        self.save_hyperparameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, T]`` byte ids to ``[B, T, vocab]`` next-byte logits."""
        out, _ = self.lstm(self.embed(x))
        return self.head(out)


class CharGPT(LanguageModelModule):
    """Small GPT-style byte-level language model (pre-norm, learned positions, causal attention).

    ``Embedding`` of bytes and of positions, ``depth`` :class:`~lightning_comp.zoo.layers.TransformerBlock`, a final
    ``LayerNorm`` and a ``Linear`` head. Linear and embedding weights start from N(0, 0.02); the output projection of
    each residual branch from N(0, 0.02 / sqrt(2 * depth)) (GPT-2).

    Args:
        width: Model width (``d_model``).
        depth: Transformer blocks.
        heads: Attention heads (must divide ``width``).
        mlp_ratio: Hidden size of the MLP as a multiple of ``width``.
        block_size: Longest sequence the model accepts (size of the position table).
        dropout: Dropout probability.
        vocab_size: Vocabulary (256 bytes).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    def __init__(
        self,
        width: int = 256,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: int = 4,
        block_size: int = 128,
        dropout: float = 0.0,
        vocab_size: int = VOCAB_SIZE,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(vocab_size=vocab_size, lr=lr, weight_decay=weight_decay)
        check_positive_int("width", width)
        check_positive_int("depth", depth)
        check_positive_int("mlp_ratio", mlp_ratio)
        self.block_size = check_positive_int("block_size", block_size)
        dropout = _check_dropout(dropout)
        self.tok_emb = nn.Embedding(vocab_size, width)
        self.pos_emb = nn.Embedding(block_size, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(TransformerBlock(width, heads, mlp_ratio, dropout) for _ in range(depth)))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)
        self._init_weights(depth)
        self.save_hyperparameters()

    def _init_weights(self, depth: int) -> None:
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = 0.02 / math.sqrt(2 * depth) if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, T]`` byte ids (``T <= block_size``) to ``[B, T, vocab]`` next-byte logits.

        Raises:
            ConfigError: If ``T`` exceeds ``block_size``.
        """
        t = x.shape[1]
        if t > self.block_size:
            raise ConfigError(f"sequence length {t} exceeds block_size={self.block_size}; raise model.block_size")
        pos = torch.arange(t, device=x.device)
        h = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        return self.head(self.ln_f(self.blocks(h)))
