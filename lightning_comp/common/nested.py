"""Tensors inside nested structures: a forward's arguments and outputs, state dicts, snapshots.

One walker, Lightning's own (``lightning_utilities``' ``apply_to_collection``): tensors inside tuples, namedtuples,
lists, mappings of any type (a Hugging Face ``ModelOutput`` stays one) and dataclasses are found; every other value
is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

__all__ = ["cast_floating", "has_dtype", "map_tensors", "structures_equal", "tensors", "to_device"]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor in it replaced by ``fn(tensor)`` (the structure is rebuilt, ``obj`` untouched)."""
    return apply_to_collection(obj, torch.Tensor, fn)


def cast_floating(obj: Any, dtype: torch.dtype, only: tuple[torch.dtype, ...] | None = None) -> Any:
    """``obj`` with every floating tensor cast to ``dtype`` (with ``only``: just those of these dtypes)."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and tensor.dtype != dtype and (only is None or tensor.dtype in only):
            return tensor.to(dtype)
        return tensor

    return map_tensors(obj, cast)


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, in the walker's order."""
    found: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    map_tensors(obj, collect)
    return found


def has_dtype(obj: Any, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether a tensor of one of ``dtypes`` is in ``obj``."""
    return any(tensor.dtype in dtypes for tensor in tensors(obj))


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor moved to ``device``."""
    return map_tensors(obj, lambda tensor: tensor.to(device))


def structures_equal(a: Any, b: Any, tensors_equal: Callable[[torch.Tensor, torch.Tensor], bool]) -> bool:
    """Whether ``a`` and ``b`` have the same structure (mapping keys, sequence lengths), equal tensors by
    ``tensors_equal`` and equal other values by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tensors_equal(a, b)
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys()
                and all(structures_equal(a[k], b[k], tensors_equal) for k in a))
    if isinstance(a, Sequence) and isinstance(b, Sequence) and not isinstance(a, str) and not isinstance(b, str):
        return len(a) == len(b) and all(structures_equal(x, y, tensors_equal) for x, y in zip(a, b))
    return bool(a == b)
