"""Block-wise 8-bit storage of optimizer moments, in plain tensors.

The format is torchao's (:mod:`lightning_comp.adapters.torchao_quant`): blocks of 256 elements, each scaled by its
largest magnitude and stored as the index (uint8) of the nearest value of the dynamic tree map. Tensors with fewer
than 4096 elements or a size that is not a multiple of the block stay FP32, as in torchao, since their codes would
save little. A moment is stored as *one* flat ``uint8`` tensor: its codes, then the bytes of its FP32 block scales
(:func:`pack`). An optimizer holding it pickles, deep-copies and loads with ``torch.load(weights_only=True)`` without
torchao's tensor subclasses, and it survives the dtype cast ``Optimizer.load_state_dict`` applies to every state
tensor: bytes cast to FP32 or BF16 and back are the same integers 0..255 (:func:`unpack` takes either).

Quantising reads the code from a table indexed by the top 20 bits of each scaled FP32 value (sign, exponent and 11
mantissa bits; 1 MiB of uint8), built once per map by torchao's own quantiser. Eagerly on a CPU this is about 10x
faster than torchao's eight-pass branchless search (meant for ``torch.compile``) and 10x faster than
``torch.bucketize``; the codes are torchao's, except for values within 2^-11 (relative) of the boundary between two
codes, which may get the neighbouring code (``tests/unit/test_block_quant.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lightning_comp.adapters.torchao_quant import block_scale, dynamic_map, reference_quantise
from lightning_comp.errors import UsageError

__all__ = ["BLOCK_SIZE", "MIN_QUANTISED", "QuantisedMoment", "dequantise", "into", "pack", "packed_size", "quantisable",
           "unpack", "value_map"]

BLOCK_SIZE = 256
MIN_QUANTISED = 4096
_CHUNK = 1 << 20  # elements quantised at once: bounds the int64 temporaries of large tensors
_DROPPED_BITS = 12  # the table is indexed by the top 32 - 12 = 20 bits of an FP32 value


def quantisable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is stored in 8 bits (else it stays FP32)."""
    return tensor.numel() >= MIN_QUANTISED and tensor.numel() % BLOCK_SIZE == 0


@functools.cache
def value_map(signed: bool, device: torch.device) -> torch.Tensor:
    """The 256 FP32 values of the map of ``signed`` on ``device``, sorted: code ``c`` stands for
    ``value_map(...)[c]``."""
    return torch.tensor(dynamic_map(signed), dtype=torch.float32, device=device)


@functools.cache
def _tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The map of ``signed`` on ``device``, and the code of every 20-bit FP32 prefix (values clamped to [-1, 1])."""
    qmap = value_map(signed, torch.device("cpu"))
    prefixes = torch.arange(1 << (32 - _DROPPED_BITS), dtype=torch.int64)
    middle = ((prefixes << _DROPPED_BITS) | (1 << (_DROPPED_BITS - 1))).to(torch.int32).view(torch.float32)
    middle = torch.nan_to_num(middle, nan=0.0, posinf=1.0, neginf=-1.0).clamp(-1.0, 1.0)
    codes = reference_quantise(middle, qmap)
    return value_map(signed, device), codes.to(device)


@dataclass
class QuantisedMoment:
    """One moment tensor in 8 bits: its codes, block scales and whether the map is signed.

    Attributes:
        codes: ``uint8``, the shape of the moment.
        scale: FP32, one per block of :data:`BLOCK_SIZE` elements.
        signed: the first moment is signed, the second is not.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    signed: bool

    @classmethod
    def quantise(cls, values: torch.Tensor, signed: bool) -> QuantisedMoment:
        """Quantise FP32 ``values`` (a :func:`quantisable` tensor)."""
        codes = torch.empty(values.shape, dtype=torch.uint8, device=values.device)
        scales = torch.empty(values.numel() // BLOCK_SIZE, dtype=torch.float32, device=values.device)
        into(values, codes, scales, signed)
        return cls(codes, scales, signed)

    def dequantise(self) -> torch.Tensor:
        """The FP32 values."""
        return dequantise(self.codes, self.scale, self.signed)


def dequantise(codes: torch.Tensor, scales: torch.Tensor, signed: bool, qmap: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The FP32 values of ``codes`` (uint8) with one scale per block in ``scales`` (``qmap``: :func:`value_map`'s
    tensor, passed in by code that ``torch.compile`` traces)."""
    if qmap is None:
        qmap = value_map(signed, codes.device)
    values = torch.take(qmap, codes.reshape(-1).long()).view(-1, BLOCK_SIZE) * scales.view(-1, 1)
    return values.view(codes.shape)


def into(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> None:
    """Quantise FP32 ``values`` into the existing ``codes`` (uint8, same shape) and ``scales`` (one per block)."""
    _, table = _tables(signed, values.device)
    flat, flat_codes = values.reshape(-1), codes.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        end = min(start + _CHUNK, flat.numel())
        scaled, scale = block_scale(flat[start:end], BLOCK_SIZE)
        prefix = (scaled.contiguous().view(torch.int32) >> _DROPPED_BITS).long() & ((1 << (32 - _DROPPED_BITS)) - 1)
        flat_codes[start:end] = torch.take(table, prefix)
        scales[start // BLOCK_SIZE:end // BLOCK_SIZE] = scale


def packed_size(numel: int) -> int:
    """Bytes of the packed form of a moment of ``numel`` elements: a code each and four per block scale."""
    return numel + 4 * (numel // BLOCK_SIZE)


def pack(moment: QuantisedMoment) -> torch.Tensor:
    """``moment`` as one flat ``uint8`` tensor: its codes, then its scales' bytes."""
    return torch.cat([moment.codes.reshape(-1), moment.scale.view(torch.uint8)])


def unpack(packed: torch.Tensor, shape: torch.Size, signed: bool) -> QuantisedMoment:
    """The moment of ``shape`` that :func:`pack` stored (``packed`` may have been cast to a float dtype by a load).

    Raises:
        UsageError: if ``packed`` has not the size of a packed moment of ``shape`` (an inconsistent state).
    """
    numel = shape.numel()
    if packed.numel() != packed_size(numel):
        raise UsageError(f"A packed 8-bit moment of shape {tuple(shape)} has {packed_size(numel)} bytes, not"
                         f" {packed.numel()}.")
    data = packed if packed.dtype == torch.uint8 else packed.to(torch.uint8)
    return QuantisedMoment(data[:numel].view(shape), data[numel:].view(torch.float32), signed)
