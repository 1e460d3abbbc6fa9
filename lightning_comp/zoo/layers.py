"""Building blocks of the zoo models, written so that every piece of work is an ``nn.Module``.

A precision plan acts on modules (forward hooks), so the zoo avoids doing real work in functional calls: attention is
split into a ``qkv`` ``Linear``, a :class:`ScaledDotProductAttention` module and an output ``Linear``
(``nn.MultiheadAttention`` would hide its projections inside ``F.multi_head_attention_forward``, where hooks on
``out_proj`` never fire).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_comp.errors import ConfigError

__all__ = ["CausalSelfAttention", "ConvBNBlock", "FeedForward", "ScaledDotProductAttention", "TransformerBlock"]


class ScaledDotProductAttention(nn.Module):
    """Causal ``F.scaled_dot_product_attention`` as a module (so a plan can address it).

    Args:
        dropout: Attention dropout probability, used in training mode only.
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend causally; ``q``, ``k``, ``v`` are ``[B, heads, T, head_dim]``."""
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``qkv`` projection, :class:`ScaledDotProductAttention`, output projection.

    Args:
        dim: Model width.
        heads: Attention heads; must divide ``dim``.
        dropout: Dropout on attention weights and on the output.

    Raises:
        ConfigError: If ``heads`` does not divide ``dim``.
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if heads <= 0 or dim % heads:
            raise ConfigError(f"heads must be a positive divisor of the width {dim}, got heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn = ScaledDotProductAttention(dropout)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, T, dim]`` to ``[B, T, dim]``."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attn(q, k, v).transpose(1, 2).reshape(b, t, d)
        return self.drop(self.proj(y))


class FeedForward(nn.Module):
    """Transformer MLP: ``Linear(dim, ratio*dim)``, ``GELU``, ``Linear(ratio*dim, dim)``, dropout."""

    def __init__(self, dim: int, ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, ratio * dim)
        self.act = nn.GELU()
        self.proj = nn.Linear(ratio * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP position-wise."""
        return self.drop(self.proj(self.act(self.fc(x))))


class TransformerBlock(nn.Module):
    """Pre-norm GPT block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim, mlp_ratio, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, T, dim]`` to ``[B, T, dim]``."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ConvBNBlock(nn.Sequential):
    """``Conv2d(3x3, no bias)``, ``BatchNorm2d``, ``ReLU``."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
        )
