"""Numerics: the precisions a plan assigns, and the codecs that store saved tensors at a lower precision.

==================  ====================================================================================
module              what it holds
==================  ====================================================================================
``precision``       :class:`Precision` (what an operator computes in), :class:`SavedPrecision` (what it
                    stores for backward in)
``codecs``          compress and decompress a saved tensor at a :class:`SavedPrecision` (bf16, fp8 with a
                    power-of-two scale)
==================  ====================================================================================
"""

from lightning_comp.numerics.precision import Precision, SavedPrecision, parse_precision, parse_saved_precision

__all__ = ["Precision", "SavedPrecision", "parse_precision", "parse_saved_precision"]
