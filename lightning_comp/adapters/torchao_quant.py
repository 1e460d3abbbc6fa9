"""The one door to torchao's low-bit optimizer quantisation (``torchao.optim.quant_utils``, not a public API).

torchao's 8-bit optimizers store each Adam moment as block-wise scaled codes of the *dynamic tree* map of Dettmers
et al. (8-bit Optimizers via Block-wise Quantization, 2022). This package takes the map and the block scaling from
torchao, so the format is the library's; it stores the codes in plain tensors of the user's own optimizer (see
:mod:`lightning_comp.numerics.block_quant`). Only torchao's ``optim/quant_utils.py`` is loaded, on first use, by
file: it imports only torch, while importing the ``torchao`` package costs about 2.5 s and prints lines about CUDA
extensions on a CPU-only torch.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch

from lightning_comp.errors import MissingExtraError

__all__ = ["block_scale", "dynamic_map", "reference_quantise"]


@functools.cache
def _quant_utils() -> Any:
    """torchao's ``optim/quant_utils.py``, loaded on its own: it imports only torch, and the ``torchao`` package's
    own import (about 2.5 s, CUDA-extension warnings on a CPU build) is not needed for it."""
    spec = importlib.util.find_spec("torchao")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(
            "8-bit optimizer state needs torchao (pip install 'torchao>=0.18' together with your torch pin, e.g."
            f" pip install torch=={torch.__version__.split('+')[0]} torchao).")
    path = Path(next(iter(spec.submodule_search_locations))) / "optim" / "quant_utils.py"
    module_spec = importlib.util.spec_from_file_location("lightning_comp._torchao_quant_utils", path)
    if module_spec is None or module_spec.loader is None or not path.is_file():
        raise MissingExtraError(f"torchao at {path.parent.parent} has no optim/quant_utils.py: install torchao>=0.18.")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


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
