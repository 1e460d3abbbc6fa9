"""The precisions a plan assigns to each operator: the one it computes in, the one it stores its saved tensors in
(or whether it recomputes them), and, for the parameters it owns, the precision of their optimizer state and of
their master copy.

The dimensions are independent: an FP32 LayerNorm may save BF16, a BF16 matmul may save FP8 and keep its AdamW
moments in 8 bits.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lightning_comp.common.spelled_enum import SpelledEnum
from lightning_comp.errors import CoMPError, PlanError

__all__ = ["MasterPrecision", "ComputePrecision", "SavedPrecision", "StatePrecision", "parse_precision",
           "parse_saved_precision"]


class ComputePrecision(SpelledEnum):
    """A compute precision for one operator. The value is the spelling in plans, configs and JSON files
    (``float32``/``32``, ``bfloat16``, ``float16``/``half``/``16``, ``float8``/``fp8-tensorwise`` and the torch dtypes
    are accepted too).

    ``fp8`` and ``fp8-rowwise`` are for ``nn.Linear`` operators: their matmuls (forward, input and weight gradient)
    take float8 operands scaled dynamically at every call, per tensor (``fp8``, torchao's ``tensorwise`` recipe: e4m3
    input and weight, e5m2 output gradient) or per row of each operand (``fp8-rowwise``, e4m3 throughout); their
    inputs and outputs are bf16 (:attr:`dtype`), their master weights and gradients stay FP32.
    """

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"  # float8 matmul operands, one dynamic scale per tensor (torchao's "tensorwise")
    FP8_ROWWISE = "fp8-rowwise"  # float8 matmul operands, one dynamic scale per row (torchao's "rowwise")

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype the operator computes in; for the fp8 precisions, that of its activations (bf16: its input
        and output), the matmul operands being float8 (:attr:`operand_dtype`)."""
        return _DTYPES[self]

    @property
    def operand_dtype(self) -> torch.dtype:
        """The dtype of the operator's forward matmul operands (``float8_e4m3fn`` for the fp8 precisions)."""
        return torch.float8_e4m3fn if self.is_fp8 else self.dtype

    @property
    def is_low(self) -> bool:
        """Whether this is lower than FP32 (a 16-bit or an fp8 precision)."""
        return self is not ComputePrecision.FP32

    @property
    def is_fp8(self) -> bool:
        """Whether the operator's matmuls take float8 operands (``fp8``, ``fp8-rowwise``)."""
        return self in (ComputePrecision.FP8, ComputePrecision.FP8_ROWWISE)

    @property
    def fp8_recipe(self) -> str:
        """torchao's name of the scaling recipe (``"tensorwise"``, ``"rowwise"``).

        Raises:
            PlanError: for a precision that is not fp8.
        """
        if not self.is_fp8:
            raise PlanError(f"{self.value!r} is not an fp8 precision: it has no fp8 scaling recipe.")
        return "rowwise" if self is ComputePrecision.FP8_ROWWISE else "tensorwise"

    @classmethod
    def aliases(cls) -> Mapping[str, str]:
        return {"float32": "fp32", "32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "16": "fp16",
                "float8": "fp8", "fp8-tensorwise": "fp8", "fp8_tensorwise": "fp8", "fp8_rowwise": "fp8-rowwise",
                "float8-rowwise": "fp8-rowwise"}

    @classmethod
    def notes(cls) -> Mapping[str, str]:
        return {"fp8": "nn.Linear only, per-tensor scales", "fp8-rowwise": "nn.Linear only, per-row scales"}

    @classmethod
    def noun(cls) -> str:
        return "precision"

    @classmethod
    def error_type(cls) -> type[CoMPError]:
        return PlanError


_DTYPES = {ComputePrecision.FP32: torch.float32, ComputePrecision.BF16: torch.bfloat16,
           ComputePrecision.FP16: torch.float16, ComputePrecision.FP8: torch.bfloat16,
           ComputePrecision.FP8_ROWWISE: torch.bfloat16}


class SavedPrecision(SpelledEnum):
    """How an operator stores the floating tensors it saves for backward. The value is the spelling in plans."""

    FP32 = "fp32"  # as computed (a BF16 operator's saved tensors stay BF16)
    BF16 = "bf16"
    FP8 = "fp8"  # float8_e4m3fn with a per-tensor FP32 scale
    RECOMPUTE = "recompute"  # its output is not stored where it is saved: backward recomputes it from its input

    @property
    def compresses(self) -> bool:
        """Whether tensors saved at this precision are converted (``bf16`` and ``fp8``)."""
        return self in (SavedPrecision.BF16, SavedPrecision.FP8)

    @property
    def recomputes(self) -> bool:
        """Whether the operator's output is recomputed in backward instead of stored where it is saved."""
        return self is SavedPrecision.RECOMPUTE

    @property
    def changes(self) -> bool:
        """Whether this differs from saving as computed (a compression or a recomputation)."""
        return self is not SavedPrecision.FP32

    @property
    def bytes_per_element(self) -> int:
        """Bytes one element takes when saved at this precision (``fp32``: that of float32; ``recompute``: 0)."""
        sizes = {SavedPrecision.FP32: 4, SavedPrecision.BF16: 2, SavedPrecision.FP8: 1, SavedPrecision.RECOMPUTE: 0}
        return sizes[self]

    @classmethod
    def aliases(cls) -> Mapping[str, str]:
        return {"float32": "fp32", "as_computed": "fp32", "bfloat16": "bf16", "fp8_e4m3": "fp8", "e4m3": "fp8",
                "recomputed": "recompute", "checkpoint": "recompute"}

    @classmethod
    def noun(cls) -> str:
        return "saved precision"

    @classmethod
    def error_type(cls) -> type[CoMPError]:
        return PlanError

    @classmethod
    def notes(cls) -> Mapping[str, str]:
        return {"fp32": "as computed", "fp8": "float8 e4m3 with a per-tensor scale",
                "recompute": "not stored: recomputed in backward from the operator's input"}


class StatePrecision(SpelledEnum):
    """How the optimizer state (Adam/AdamW's two moments) of an operator's parameters is stored."""

    FP32 = "fp32"  # the optimizer's own state, untouched
    BF16 = "bf16"  # both moments in bfloat16 (4 bytes per parameter)
    INT8 = "8bit"  # block-wise dynamic-tree quantisation, 256 elements per block (about 2 bytes per parameter)

    @property
    def managed(self) -> bool:
        """Whether the package steps these parameters itself (anything but ``fp32``)."""
        return self is not StatePrecision.FP32

    @classmethod
    def aliases(cls) -> Mapping[str, str]:
        return {"float32": "fp32", "bfloat16": "bf16", "int8": "8bit", "8-bit": "8bit", "8": "8bit"}

    @classmethod
    def noun(cls) -> str:
        return "optimizer-state precision"

    @classmethod
    def error_type(cls) -> type[CoMPError]:
        return PlanError

    @classmethod
    def notes(cls) -> Mapping[str, str]:
        return {"fp32": "the optimizer's own", "8bit": "block-quantised moments"}


class MasterPrecision(SpelledEnum):
    """The precision an operator's parameters are held in between steps (their master copy)."""

    FP32 = "fp32"
    BF16 = "bf16"  # no FP32 copy: the optimizer step rounds each update stochastically into the bfloat16 weight

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the parameters are held in."""
        return torch.float32 if self is MasterPrecision.FP32 else torch.bfloat16

    @property
    def managed(self) -> bool:
        """Whether the package steps these parameters itself (anything but ``fp32``)."""
        return self is not MasterPrecision.FP32

    @classmethod
    def aliases(cls) -> Mapping[str, str]:
        return {"float32": "fp32", "bfloat16": "bf16"}

    @classmethod
    def noun(cls) -> str:
        return "master-weight precision"

    @classmethod
    def error_type(cls) -> type[CoMPError]:
        return PlanError

    @classmethod
    def notes(cls) -> Mapping[str, str]:
        return {"bf16": "stochastically rounded updates, no FP32 copy"}


def parse_precision(value: object) -> ComputePrecision:
    """Turn a user-facing value into a :class:`ComputePrecision`.

    Args:
        value: a :class:`ComputePrecision`, a torch dtype (float32/bfloat16/float16) or one of the strings ``"fp32"``,
            ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp8-rowwise"`` (aliases ``float32``, ``bfloat16``, ``float16``,
            ``half``, ``float8`` are accepted).

    Raises:
        PlanError: if the value names no supported precision.
    """
    return ComputePrecision.parse(value)


def parse_saved_precision(value: object) -> SavedPrecision:
    """Turn a user-facing value into a :class:`SavedPrecision`.

    Raises:
        PlanError: naming the value and the valid spellings.
    """
    return SavedPrecision.parse(value)
