"""The one door to torchao's low-bit optimizer quantisation (``torchao.optim.quant_utils``, not a public API).

torchao's 8-bit optimizers store each Adam moment as block-wise scaled codes of the *dynamic tree* map of Dettmers
et al. (8-bit Optimizers via Block-wise Quantization, 2022). This package takes the map and the block scaling from
torchao, so the format is the library's; it stores the codes in plain tensors of the user's own optimizer (see
:mod:`lightning_comp.numerics.block_quant`). torchao is imported on first use: it costs about 1.5 s and prints
harmless lines about CUDA extensions on a CPU-only torch.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from lightning_comp.errors import MissingExtraError

__all__ = ["block_scale", "dynamic_map", "reference_quantise"]


@functools.cache
def _quant_utils() -> Any:
    pytree = logging.getLogger("torch.utils._pytree")  # torchao registers an enum torch now handles: it logs so
    level = pytree.level
    try:
        pytree.setLevel(logging.ERROR)
        from torchao.optim import quant_utils
    except ImportError as err:  # pragma: no cover - torchao is a dependency of the package
        raise MissingExtraError(
            "8-bit optimizer state needs torchao (pip install 'torchao>=0.18' together with your torch pin, e.g."
            f" pip install torch=={torch.__version__.split('+')[0]} torchao): {err}"
        ) from None
    finally:
        pytree.setLevel(level)
    return quant_utils


@functools.cache
def dynamic_map(signed: bool) -> tuple[float, ...]:
    """torchao's 256-value dynamic tree map, sorted (signed for the first moment, unsigned for the second)."""
    return tuple(float(v) for v in _quant_utils().create_dynamic_map(signed=signed))


def block_scale(tensor: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` divided by the largest magnitude of each block of ``block_size`` elements, and those maxima."""
    scaled, scale = _quant_utils().scale_tensor(tensor, block_size)
    return scaled, scale


def reference_quantise(scaled: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """torchao's own quantiser of values in [-1, 1] to codes of ``qmap`` (a branchless binary search meant for
    ``torch.compile``): builds the lookup table of :mod:`lightning_comp.numerics.block_quant`."""
    out: torch.Tensor = _quant_utils().quantize_8bit_with_qmap(scaled, qmap)
    return out
