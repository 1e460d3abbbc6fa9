"""Models nobody here wrote, as zoo modules: Hugging Face ``transformers`` GPT-2, Lightning's ``litgpt`` GPT
(LLaMA-style and mixture-of-experts configs), an ``x-transformers`` decoder, and a ``torchvision`` ResNet.

Each wraps the library's own model, randomly initialised from its config (nothing is downloaded), untouched: the
plan reaches its layers through forward hooks like any other model's. The libraries are optional extras
(``pip install "lightning-comp[hf]"``, ``[litgpt]``, ``[xtransformers]``, ``[vision]``); building a module without
its library raises :class:`~lightning_comp.errors.MissingExtraError` (an ``ImportError``) naming the extra.

What the operators are:

- GPT-2's projections are ``transformers.pytorch_utils.Conv1D`` (a Linear with a transposed weight, ``torch.addmm``):
  compute operators, lowered like ``nn.Linear``. Each ``GPT2Attention`` calls ``scaled_dot_product_attention`` between
  its projections: a trace of the first step makes it a ``FUNCTIONAL`` operator for that work, its projections and
  dropouts staying operators of their own (see :mod:`lightning_comp.operators.owned_work`).
- litgpt's ``CausalSelfAttention`` (``qkv``/``proj`` Linears, rotary embeddings, grouped-query SDPA between them) is
  a ``FUNCTIONAL`` operator the same way; its ``RMSNorm`` is a leaf with a weight, lowered by parameter copies; the
  ``LLaMAMoE`` router and experts are Linears (the token routing, top-k and index ops, stays FP32 between them).
- x-transformers' ``Attend`` computes attention with ``einsum`` (two ``bmm``) around its Dropout child: a
  ``FUNCTIONAL`` operator; its ``Rearrange`` layers are shape-only.
- torchvision's ResNet is built of ``nn`` modules only (``Conv2d``, ``BatchNorm2d``, ``ReLU``, pools, ``Linear``);
  its residual additions are functional and stay FP32 (each block's ``ReLU`` module runs twice per forward).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, ClassVar

import torch

from lightning_comp.errors import ConfigError, MissingExtraError
from lightning_comp.zoo.data import check_positive_int
from lightning_comp.zoo.models import ClassifierModule, LanguageModelModule
from lightning_comp.zoo.text import VOCAB_SIZE

__all__ = ["HFGPT2", "LitGPT", "TorchvisionResNet", "XTransformerLM", "require"]


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``, or raise :class:`~lightning_comp.errors.MissingExtraError` naming the extra that installs
    it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtraError(
            f"{module} is not installed: it is an optional extra of lightning-comp. Install it with"
            f' pip install "lightning-comp[{extra}]" (from a checkout: pip install -e ".[{extra}]").'
        ) from error
    except (RuntimeError, OSError) as error:  # e.g. torchvision built for another torch: "torchvision::nms ..."
        raise MissingExtraError(
            f"{module} is installed but cannot be imported beside torch {torch.__version__}: {error}. Install the"
            f" {module.split('.')[0]} release built for this torch (the [{extra}] extra of lightning-comp)."
        ) from error


class HFGPT2(LanguageModelModule):
    """Hugging Face ``GPT2LMHeadModel``, randomly initialised from a ``GPT2Config``, as a byte-level language model.

    The size knobs are the zoo's (``width``, ``depth``, as :class:`~lightning_comp.zoo.CharGPT`), so ``size=tiny``
    applies to it too.

    Args:
        width: Embedding width (``n_embd``).
        depth: Transformer blocks (``n_layer``).
        heads: Attention heads (``n_head``).
        block_size: Longest sequence (``n_positions``).
        dropout: Residual, embedding and attention dropout.
        vocab_size: Vocabulary (bytes: 256).
        attn_implementation: ``"sdpa"`` (the library's default) or ``"eager"``.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    data_kinds: ClassVar[tuple[str, ...]] = ("tokens",)

    def __init__(self, width: int = 128, depth: int = 2, heads: int = 4, block_size: int = 128,
                 dropout: float = 0.0, vocab_size: int = VOCAB_SIZE, attn_implementation: str = "sdpa",
                 lr: float = 1e-3, weight_decay: float = 0.01) -> None:
        super().__init__(vocab_size=vocab_size, lr=lr, weight_decay=weight_decay)
        transformers = require("transformers", "hf")
        for name, value in (("width", width), ("depth", depth), ("heads", heads), ("block_size", block_size)):
            check_positive_int(name, value)
        if width % heads:
            raise ConfigError(f"HFGPT2(width={width}, heads={heads}): width must be a multiple of heads.")
        config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_embd=width,
                                         n_layer=depth, n_head=heads, resid_pdrop=dropout, embd_pdrop=dropout,
                                         attn_pdrop=dropout, use_cache=False,  # training: no key/value cache
                                         bos_token_id=None, eos_token_id=None)  # bytes, not GPT-2's 50257 ids
        config._attn_implementation = attn_implementation  # noqa: SLF001 - the documented way to pick it at init
        self.gpt2 = transformers.GPT2LMHeadModel(config)
        self.save_hyperparameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map ``[B, T]`` byte ids to ``[B, T, vocab_size]`` logits (the zoo's FP32 loss is applied outside)."""
        return self.gpt2(input_ids=tokens).logits


class LitGPT(LanguageModelModule):
    """Lightning's ``litgpt.GPT``, randomly initialised from a small LLaMA-style ``litgpt.Config``, as a byte-level
    language model: RMSNorm, SwiGLU MLP (``LLaMAMLP``), grouped-query attention, rotary embeddings.

    Args:
        width: Embedding width (``n_embd``).
        depth: Transformer blocks (``n_layer``).
        heads: Query heads (``n_head``).
        query_groups: Key/value heads (``n_query_groups``; ``heads`` must be a multiple).
        block_size: Longest sequence.
        experts: ``0`` for the dense ``LLaMAMLP``; else that many experts of a ``LLaMAMoE`` per block.
        experts_per_token: Experts each token is routed to (``LLaMAMoE`` only).
        vocab_size: Vocabulary (bytes: 256).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    data_kinds: ClassVar[tuple[str, ...]] = ("tokens",)

    def __init__(self, width: int = 128, depth: int = 2, heads: int = 4, query_groups: int = 2,
                 block_size: int = 128, experts: int = 0, experts_per_token: int = 2,
                 vocab_size: int = VOCAB_SIZE, lr: float = 1e-3, weight_decay: float = 0.01) -> None:
        super().__init__(vocab_size=vocab_size, lr=lr, weight_decay=weight_decay)
        litgpt = require("litgpt", "litgpt")
        for name, value in (("width", width), ("depth", depth), ("heads", heads), ("query_groups", query_groups),
                            ("block_size", block_size), ("experts_per_token", experts_per_token)):
            check_positive_int(name, value)
        if width % heads or heads % query_groups:
            raise ConfigError(f"LitGPT(width={width}, heads={heads}, query_groups={query_groups}): width must be a"
                              " multiple of heads, and heads a multiple of query_groups.")
        if experts < 0 or (experts and experts_per_token > experts):
            raise ConfigError(f"LitGPT(experts={experts}, experts_per_token={experts_per_token}): experts must be 0"
                              " (dense) or at least experts_per_token.")
        mlp = {"mlp_class_name": "LLaMAMoE", "n_expert": experts, "n_expert_per_token": experts_per_token,
               "moe_intermediate_size": width} if experts else {"mlp_class_name": "LLaMAMLP"}
        self.config = litgpt.Config(n_layer=depth, n_embd=width, n_head=heads, n_query_groups=query_groups,
                                    vocab_size=vocab_size, padded_vocab_size=vocab_size, block_size=block_size,
                                    bias=False, norm_class_name="RMSNorm", intermediate_size=2 * width,
                                    rotary_percentage=1.0, parallel_residual=False, **mlp)
        self.gpt = litgpt.GPT(self.config)
        self.save_hyperparameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map ``[B, T]`` byte ids to ``[B, T, vocab_size]`` logits."""
        return self.gpt(tokens)


class XTransformerLM(LanguageModelModule):
    """An ``x_transformers.TransformerWrapper`` around a ``Decoder`` (rotary embeddings), randomly initialised, as a
    byte-level language model.

    Args:
        width: Model width (``dim``).
        depth: Decoder layers.
        heads: Attention heads.
        block_size: Longest sequence (``max_seq_len``).
        vocab_size: Vocabulary (bytes: 256).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    data_kinds: ClassVar[tuple[str, ...]] = ("tokens",)

    def __init__(self, width: int = 128, depth: int = 2, heads: int = 4, block_size: int = 128,
                 vocab_size: int = VOCAB_SIZE, lr: float = 1e-3, weight_decay: float = 0.01) -> None:
        super().__init__(vocab_size=vocab_size, lr=lr, weight_decay=weight_decay)
        x_transformers = require("x_transformers", "xtransformers")
        for name, value in (("width", width), ("depth", depth), ("heads", heads), ("block_size", block_size)):
            check_positive_int(name, value)
        if width % heads:
            raise ConfigError(f"XTransformerLM(width={width}, heads={heads}): width must be a multiple of heads.")
        self.net = x_transformers.TransformerWrapper(
            num_tokens=vocab_size, max_seq_len=block_size,
            attn_layers=x_transformers.Decoder(dim=width, depth=depth, heads=heads, attn_dim_head=width // heads,
                                               rotary_pos_emb=True))
        self.save_hyperparameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map ``[B, T]`` byte ids to ``[B, T, vocab_size]`` logits."""
        return self.net(tokens)


class TorchvisionResNet(ClassifierModule):
    """A ``torchvision.models`` ResNet (``resnet18`` by default), randomly initialised, for small images.

    Args:
        arch: A ResNet builder of ``torchvision.models`` (``resnet18``, ``resnet34``, ``resnet50``, ...).
        num_classes: Output classes.
        small_images: Replace the 7x7 stride-2 stem and its max-pool by a 3x3 stride-1 convolution (the usual
            CIFAR-sized variant); ``False`` keeps the library's model exactly.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    data_kinds: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, arch: str = "resnet18", num_classes: int = 10, small_images: bool = False,
                 lr: float = 2e-3, weight_decay: float = 0.01) -> None:
        super().__init__(num_classes=num_classes, lr=lr, weight_decay=weight_decay)
        models = require("torchvision.models", "vision")
        builder: Any = getattr(models, arch, None)
        if not (arch.startswith("resnet") and callable(builder)):
            valid = sorted(n for n in dir(models) if n.startswith("resnet") and callable(getattr(models, n)))
            raise ConfigError(f"TorchvisionResNet(arch={arch!r}) is not a torchvision ResNet builder; use one of"
                             f" {valid}.")
        self.resnet = builder(weights=None, num_classes=num_classes)
        if small_images:
            self.resnet.conv1 = torch.nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
            self.resnet.maxpool = torch.nn.Identity()
        self.save_hyperparameters()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Map ``[B, 3, H, W]`` images to ``[B, num_classes]`` logits."""
        return self.resnet(images)
