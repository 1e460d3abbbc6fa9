"""Numerics: the precisions a plan assigns, and the formats that store tensors at a lower precision.

The value enums of the plan's dimensions (:class:`ComputePrecision`, :class:`SavedPrecision`, :class:`StatePrecision`,
:class:`MasterPrecision`), the codecs of saved tensors (bf16, fp8 with a scale), 8-bit block-quantised optimizer moments
and stochastic rounding to BF16. Each module's docstring says what it holds.
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
