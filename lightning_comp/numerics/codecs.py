"""The codecs that store a tensor saved for backward at its :class:`~lightning_comp.numerics.precision.SavedPrecision`.

``bf16`` halves a float32 activation; ``fp8`` stores it as ``float8_e4m3fn`` with one FP32 scale per tensor (a
quarter of float32).

The FP8 codec scales each tensor by a power of two that maps its largest magnitude into e4m3's top binade
(224, 448], so it never overflows and the scaling itself is exact; an all-zero tensor keeps scale 1. A tensor
holding NaN or Inf comes back as NaN everywhere, so the gradients it feeds are NaN and a search trial's NaN check
rejects the plan instead of a silent clamp hiding it. No codec synchronises a CUDA stream: every decision is made on
the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_comp.errors import UsageError
from lightning_comp.numerics.precision import SavedPrecision

__all__ = ["FP8_DTYPE", "FP8_MAX", "CompressedTensor", "compress", "decode_fp8", "decompress", "shrinks"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_TINY = 2.0**-100  # below this amax, 448 / amax is too large for float32: such a tensor keeps scale 1


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
        raise UsageError(f"Saved precision {saved.value!r} stores tensors as computed: nothing to compress"
                         " (check shrinks() first).")


def decompress(packed: CompressedTensor) -> torch.Tensor:
    """The tensor :func:`compress` stored, in its original dtype."""
    if packed.inverse_scale is None:
        return packed.data.to(packed.dtype)
    if packed.dtype == torch.float16:  # its range cannot hold every scale
        return (decode_fp8(packed.data, torch.float32) * packed.inverse_scale).to(packed.dtype)
    return decode_fp8(packed.data, packed.dtype).mul_(packed.inverse_scale.to(packed.dtype))


_DECODE_TABLES: dict[torch.dtype, torch.Tensor] = {}
# float8_e4m3fn's exponent and mantissa bits moved into a wider format's (sign kept): integer type, shift, mask
_BIT_LAYOUTS: dict[torch.dtype, tuple[torch.dtype, int, int]] = {
    torch.bfloat16: (torch.int16, 4, -(2**15) | 0x07F0),
    torch.float32: (torch.int32, 20, -(2**31) | 0x07F00000),
}
_BIAS_GAP = 2.0**120  # 2 ** (127 - 7): e4m3's exponent bias against bfloat16's and float32's


def decode_fp8(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data.to(dtype)`` for float8_e4m3fn, bit-exact (NaN codes included; a NaN's sign aside).

    On a CPU PyTorch converts e4m3 element by element (measured 1.7-4.3 ns per element on 2 EPYC cores). bfloat16 and
    float32 are decoded here by moving e4m3's exponent and mantissa bits into the wider format's and multiplying by
    2 ** 120, the gap between their exponent biases (0.2-0.3 ns per element): exact for subnormal codes too (they land
    on the wider format's subnormals, which that multiply makes normal), so it is used only where the CPU keeps
    subnormals (``torch.set_flush_denormal(True)`` would zero them), and only where no NaN code is present (found by
    one cheap reduction over the bytes: the bits would give 480 there). Else, and for other dtypes, a 256-entry table
    (1-1.5 ns per element).
    """
    if data.device.type != "cpu":
        return data.to(dtype)
    layout = _BIT_LAYOUTS.get(dtype)
    codes = data.view(torch.uint8)
    if layout is not None and data.numel() and _keeps_subnormals() and int(codes.bitwise_and(0x7F).amax()) != 0x7F:
        integer, shift, mask = layout
        bits = data.view(torch.int8).to(integer)  # sign-extended: the sign lands in the wider format's sign bit
        return bits.bitwise_left_shift_(shift).bitwise_and_(mask).view(dtype).mul_(_BIAS_GAP)
    table = _DECODE_TABLES.get(dtype)
    if table is None:
        every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE)
        table = _DECODE_TABLES[dtype] = every.to(dtype)
    return torch.index_select(table, 0, codes.reshape(-1).to(torch.int32)).view(data.shape)


def _keeps_subnormals() -> bool:
    """Whether this thread's float arithmetic keeps subnormal numbers (``torch.set_flush_denormal`` not set)."""
    return bool((_SUBNORMAL * 2.0).item() != 0.0)


_SUBNORMAL = torch.tensor(2.0**-140)  # a float32 subnormal
