"""Values as plain JSON types, so that checkpoints load with ``torch.load(weights_only=True)`` and files diff."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

import torch

__all__ = ["plain"]


def plain(value: Any) -> Any:
    """``value`` in plain JSON types: dicts with str keys, lists, str, int, float, bool and None.

    Enums become their values, one-element tensors numbers, tuples and sets lists; anything else its ``str``.
    """
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, Enum):
        return plain(value.value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)
