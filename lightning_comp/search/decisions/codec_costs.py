"""What a saved codec (bf16, fp8) adds per step, as one cost model per codec fitted over every operator.

The saved stage times each operator's (or sharing group's) saved precisions against saving as computed, in paired
rounds; what a codec adds is that operator's forward and backward times its median ratio, less one. Per operator
those additions are noisy: on the default example the fp8 of one attention group's saved tensors measured x1.23 of
its time in one search and x1.41 in the next, and its bf16 x1.12 in three blocks and x1.28 in the fourth, so whether
the levers took fp8 or bf16 for a group changed from run to run.

A codec is element-wise: a cast on the way into storage, one on the way back, each reading and writing the tensor,
plus its hooks per operator. :func:`fit_codec_cost` fits a fixed cost per operator and a cost per byte of what the
operators save as computed (the bytes the casts read: a tensor computed in FP32 costs about twice one computed in
bf16 of the same shape, which a cost per element would miss; over three searches of the default example, the fit by
bytes was off each operator's own measurement by 20-24 % on average, by elements by 23-40 %), both non-negative, over
every operator whose codec frees bytes; each operator's lever is then priced from the model.

Where the saved stage timed a group's casts directly (:mod:`~lightning_comp.search.measurement.direct_timing`), that
time prices its lever and the model is not fitted on it: the casts' own times repeat within about 12 % from search to
search, and the groups differ by more than their bytes, which one model per codec averages away. The model prices what
was judged by its time ratio alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_comp.search.decisions.update_costs import MIN_SAMPLES, fit_two_terms

__all__ = ["CodecCost", "CodecSample", "fit_codec_cost"]


@dataclass(frozen=True)
class CodecSample:
    """One operator's (or sharing group's) measured addition from a codec.

    Attributes:
        operators: the operators whose forward and backward its time ratio is of.
        source_bytes: the bytes they save for backward as computed.
        extra_ms: what the codec added to their forward and backward (ms; below 0 where it was faster).
    """

    operators: int
    source_bytes: int
    extra_ms: float


@dataclass(frozen=True)
class CodecCost:
    """What a codec adds: ``per_operator_ms * operators + per_byte_ms * source_bytes``.

    Attributes:
        per_operator_ms: the fixed cost per operator (ms).
        per_byte_ms: the cost per byte saved as computed (ms).
        samples: the operators (or groups) it was fitted over.
    """

    per_operator_ms: float
    per_byte_ms: float
    samples: int

    def extra_ms(self, operators: int, source_bytes: int) -> float:
        """What it adds to ``operators`` operators saving ``source_bytes`` bytes as computed (ms)."""
        return self.per_operator_ms * operators + self.per_byte_ms * source_bytes


def fit_codec_cost(samples: Sequence[CodecSample]) -> CodecCost | None:
    """The non-negative least-squares fit of ``extra_ms`` on operators and source bytes
    (:func:`~lightning_comp.search.decisions.update_costs.fit_two_terms`; ``None``: fewer than
    :data:`~lightning_comp.search.decisions.update_costs.MIN_SAMPLES` samples, too few to spread one's noise over the
    others)."""
    if len(samples) < MIN_SAMPLES:
        return None
    a, b = fit_two_terms([float(s.operators) for s in samples], [float(s.source_bytes) for s in samples],
                         [s.extra_ms for s in samples])
    return CodecCost(a, b, len(samples))
