"""What an exception raised inside a lowered operator is told: which operator, precision and device it was, and,
only where precision can be the cause, that assigning the operator FP32 may help.

An out-of-range token index raises the same ``IndexError`` in FP32 as in BF16: advising FP32 there would send the
user the wrong way. The advice is given when the error speaks of dtypes or of the low-precision kernels (mixed
dtypes, a missing 16-bit kernel, oneDNN's primitive descriptors, float8); otherwise the note says that the error
may not come from precision, and how to tell.
"""

from __future__ import annotations

import re

import torch

from lightning_comp.devices.device_classes import device_class
from lightning_comp.execution.hooked import HookedOperator

__all__ = ["note_failing_operator", "precision_may_cause"]

# Words of errors that mixed or 16-bit dtypes cause (torch's dtype names and messages, oneDNN's, CUDA kernels')
_PRECISION_WORDS = re.compile(
    r"dtype|scalar type|bfloat16|BFloat16|float16|\bHalf\b|\bhalf\b|float8|Float8|\bbf16\b|\bfp16\b|\bfp8\b"
    r"|mat1 and mat2|same type|primitive descriptor|not implemented for|mkldnn|oneDNN|onednn|overflow",
)


def precision_may_cause(error: BaseException) -> bool:
    """Whether ``error``'s message speaks of dtypes or 16-bit kernels, so that a lower precision may have caused it."""
    return bool(_PRECISION_WORDS.search(str(error)))


def note_failing_operator(op: HookedOperator, error: BaseException | None, device: torch.device | None) -> None:
    """Add a note to ``error`` (raised inside ``op``'s forward) naming the operator, its precision and the device;
    only the innermost lowered operator notes it, once."""
    if error is None or getattr(error, "_comp_operator", None) is not None or not hasattr(error, "add_note"):
        return
    error._comp_operator = op.name  # type: ignore[attr-defined]
    where = "unknown device" if device is None else f"{device} [{device_class(device).describe()}]"
    saving = f", saving for backward in {op.saved.value}" if op.saved.compresses else ""
    if precision_may_cause(error):
        advice = (" Assign it 'fp32' in the plan, or exclude it from the search with CoMPSearch(exclude=[...]).")
    else:
        advice = (" The error does not speak of dtypes, so it may not come from precision: the same input would"
                  " likely fail in fp32 too. To tell, assign the operator 'fp32' in the plan and run again.")
    error.add_note(
        f"lightning-comp: raised inside operator {op.name or '<root>'!r} ({type(op.module).__name__}) computing in"
        f" {op.precision.value} ({op.lowering.value} lowering){saving} on {where}.{advice}"
    )
