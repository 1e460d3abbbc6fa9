"""The precision in which an operator's tensors saved for backward are stored, and the codecs that store them.

Besides the precision an operator *computes* in (:class:`~lightning_comp.numerics.precision.Precision`), a plan can set
the precision of the activations it *saves* for backward (:class:`SavedPrecision`): ``fp32`` keeps them as computed
(the default, and today's behaviour), ``bf16`` halves a float32 activation, ``fp8`` stores it as ``float8_e4m3fn``
with one FP32 scale per tensor (a quarter of float32). The two dimensions are independent: an FP32 LayerNorm may
save BF16, a BF16 matmul may save FP8.

The FP8 codec scales each tensor by a power of two that maps its largest magnitude into e4m3's top binade
(224, 448], so it never overflows and the scaling itself is exact; an all-zero tensor keeps scale 1. A tensor
holding NaN or Inf comes back as NaN everywhere, so the gradients it feeds are NaN and a search trial's NaN check
rejects the plan instead of a silent clamp hiding it. No codec synchronises a CUDA stream: every decision is made on
the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from lightning_comp.errors import PlanError

__all__ = ["CompressedTensor", "SavedPrecision", "compress", "decode_fp8", "decompress", "parse_saved_precision"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_TINY = 2.0**-100  # below this amax, 448 / amax is too large for float32: such a tensor keeps scale 1


class SavedPrecision(str, Enum):
    """How an operator stores the floating tensors it saves for backward. The value is the spelling in plans."""

    FP32 = "fp32"  # as computed (a BF16 operator's saved tensors stay BF16)
    BF16 = "bf16"
    FP8 = "fp8"  # float8_e4m3fn with a per-tensor FP32 scale

    @property
    def compresses(self) -> bool:
        """Whether tensors saved at this precision are converted (everything but ``fp32``)."""
        return self is not SavedPrecision.FP32

    @property
    def bytes_per_element(self) -> int:
        """Bytes one element takes when saved at this precision (``fp32``: that of float32)."""
        return {SavedPrecision.FP32: 4, SavedPrecision.BF16: 2, SavedPrecision.FP8: 1}[self]

    def __str__(self) -> str:
        return self.value


_ALIASES = {
    "fp32": SavedPrecision.FP32,
    "float32": SavedPrecision.FP32,
    "as_computed": SavedPrecision.FP32,
    "bf16": SavedPrecision.BF16,
    "bfloat16": SavedPrecision.BF16,
    "fp8": SavedPrecision.FP8,
    "fp8_e4m3": SavedPrecision.FP8,
    "e4m3": SavedPrecision.FP8,
}


def parse_saved_precision(value: object) -> SavedPrecision:
    """Turn a user-facing value into a :class:`SavedPrecision`.

    Raises:
        PlanError: naming the value and the valid spellings.
    """
    if isinstance(value, SavedPrecision):
        return value
    if isinstance(value, str) and value.strip().lower() in _ALIASES:
        return _ALIASES[value.strip().lower()]
    raise PlanError(
        f"Unknown saved precision {value!r}: valid saved precisions are 'fp32' (as computed), 'bf16' and 'fp8'"
        " (float8 e4m3 with a per-tensor scale)."
    )


@dataclass(frozen=True)
class CompressedTensor:
    """A saved tensor in its stored form.

    Attributes:
        data: the stored values (bfloat16, or float8_e4m3fn scaled by ``1 / inverse_scale``).
        dtype: the dtype to give back in backward.
        inverse_scale: the FP32 factor that turns ``data`` back into values (FP8 only).
    """

    data: torch.Tensor
    dtype: torch.dtype
    inverse_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held (the scale included)."""
        scale = 0 if self.inverse_scale is None else self.inverse_scale.nbytes
        return self.data.nbytes + scale


def shrinks(tensor: torch.Tensor, saved: SavedPrecision) -> bool:
    """Whether storing ``tensor`` at ``saved`` takes fewer bytes than keeping it (floating tensors only)."""
    return (saved.compresses and tensor.is_floating_point() and tensor.dtype != FP8_DTYPE
            and tensor.element_size() > saved.bytes_per_element)


def compress(tensor: torch.Tensor, saved: SavedPrecision) -> CompressedTensor:
    """Store ``tensor`` at ``saved`` (callers check :func:`shrinks` first). Never synchronises the device."""
    with torch.no_grad():
        value = tensor.detach()
        if saved is SavedPrecision.BF16:
            return CompressedTensor(value.to(torch.bfloat16), tensor.dtype)
        if saved is SavedPrecision.FP8:
            if value.numel():
                low, high = torch.aminmax(value)
                amax = torch.maximum(-low, high).float()
            else:
                amax = value.new_zeros((), dtype=torch.float32)
            finite = torch.isfinite(amax)
            usable = finite & (amax > _TINY)
            # A power of two at or above amax / 448: scaling by it is exact in every float format (no bias from a
            # rounded scale), and the largest magnitude lands in (224, 448], so nothing overflows without a clamp.
            # NaN/Inf anywhere: a NaN scale makes every value NaN in backward (the NaN check sees it, nothing hides it)
            power = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
            inverse = torch.where(usable, power, torch.where(finite, 1.0, torch.nan))
            # (float16 is scaled in float32: 448 / amax overflows its range for small tensors)
            scaled = value.float() if value.dtype == torch.float16 else value
            data = torch.mul(scaled, inverse.reciprocal().to(scaled.dtype)).to(FP8_DTYPE)
            return CompressedTensor(data, tensor.dtype, inverse)
        raise ValueError(f"Saved precision {saved.value!r} stores tensors as computed: nothing to compress.")


def decompress(packed: CompressedTensor) -> torch.Tensor:
    """The tensor :func:`compress` stored, in its original dtype."""
    if packed.inverse_scale is None:
        return packed.data.to(packed.dtype)
    if packed.dtype == torch.float16:  # its range cannot hold every scale
        return (decode_fp8(packed.data, torch.float32) * packed.inverse_scale).to(packed.dtype)
    return decode_fp8(packed.data, packed.dtype).mul_(packed.inverse_scale.to(packed.dtype))


_DECODE_TABLES: dict[torch.dtype, torch.Tensor] = {}


def decode_fp8(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data.to(dtype)`` for float8_e4m3fn; on a CPU through a 256-entry table (bit-exact), because PyTorch's CPU
    conversion of e4m3 is element by element (measured 1.7-4.3 ns per element on 2 EPYC cores, the table 1-1.5)."""
    if data.device.type != "cpu":
        return data.to(dtype)
    table = _DECODE_TABLES.get(dtype)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE)
        table = _DECODE_TABLES[dtype] = codes.to(dtype)
    index = data.view(torch.uint8).reshape(-1).to(torch.int32)
    return torch.index_select(table, 0, index).view(data.shape)
