"""Numerics: the precisions a plan assigns, and the codecs that store saved tensors at a lower precision.

==================  ====================================================================================
module              what it holds
==================  ====================================================================================
``precision``       :class:`ComputePrecision` (what an operator computes in), :class:`SavedPrecision` (what it
                    stores for backward in, or ``recompute``), :class:`StatePrecision` (its parameters'
                    optimizer state), :class:`MasterPrecision` (its parameters themselves)
``codecs``          compress and decompress a saved tensor at a :class:`SavedPrecision` (bf16, fp8 with a
                    power-of-two scale)
``block_quant``     8-bit block-quantised optimizer moments in plain tensors (torchao's format)
``stochastic_       FP32 -> BF16 stochastic rounding with a generator of its own (BF16 master weights)
rounding``
==================  ====================================================================================
"""

from lightning_comp.numerics.precision import (
    ComputePrecision,
    MasterPrecision,
    SavedPrecision,
    StatePrecision,
    parse_precision,
    parse_saved_precision,
)

__all__ = ["MasterPrecision", "ComputePrecision", "SavedPrecision", "StatePrecision", "parse_precision",
           "parse_saved_precision"]
