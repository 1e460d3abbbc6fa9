"""What a managed optimizer update adds per step, as one cost model per update variant fitted over every operator.

The parameter stage times each operator's update in every variant (8-bit or bf16 state, bf16 master) against the
optimizer's own, in paired rounds. Per operator those times are a fraction of a millisecond and noisy: on the default
example, four MLP matmuls of the same shape measured 0.36-0.67 ms for the same FP32 update in one search, so the
8-bit lever of one group of blocks priced above another's in one run and below it in the next, and which of them the
memory levers took changed from run to run.

An update is element-wise over the operator's parameters, so what a variant adds is a fixed cost per parameter
tensor (a kernel launch, a compiled call) plus a cost per element. :func:`fit_update_cost` fits both by least squares
over every operator's measured addition (its FP32 update times its paired median ratio, less one), neither below
zero; each operator's lever is then priced from the model: operators of one shape get one price, and the noise of one
operator's few rounds is spread over all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["UpdateCost", "UpdateSample", "fit_two_terms", "fit_update_cost"]

MIN_SAMPLES = 3  # operators measured: fewer, and each is priced by its own measurement


@dataclass(frozen=True)
class UpdateSample:
    """One operator's measured addition to the update.

    Attributes:
        tensors: its parameter tensors (a weight and a bias: 2).
        elements: their elements.
        extra_ms: what the variant added to its update per step (ms; below 0 where it was faster).
    """

    tensors: int
    elements: int
    extra_ms: float


@dataclass(frozen=True)
class UpdateCost:
    """What a variant adds to an update: ``per_tensor_ms * tensors + per_element_ms * elements``.

    Attributes:
        per_tensor_ms: the fixed cost per parameter tensor (ms).
        per_element_ms: the cost per element (ms).
        samples: the operators it was fitted over.
    """

    per_tensor_ms: float
    per_element_ms: float
    samples: int

    def extra_ms(self, tensors: int, elements: int) -> float:
        """What it adds to an update of ``tensors`` tensors holding ``elements`` elements (ms)."""
        return self.per_tensor_ms * tensors + self.per_element_ms * elements


def fit_update_cost(samples: Sequence[UpdateSample]) -> UpdateCost | None:
    """The non-negative least-squares fit of ``extra_ms`` on tensors and elements (``None``: fewer than
    :data:`MIN_SAMPLES` operators, too few to spread one's noise over the others; :func:`fit_two_terms`)."""
    if len(samples) < MIN_SAMPLES:
        return None
    a, b = fit_two_terms([float(s.tensors) for s in samples], [float(s.elements) for s in samples],
                         [s.extra_ms for s in samples])
    return UpdateCost(a, b, len(samples))


def fit_two_terms(x1: Sequence[float], x2: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """The non-negative least-squares fit ``y ~ a * x1 + b * x2`` (no intercept): ``(a, b)``.

    Where the unconstrained fit gives a coefficient below zero, that term is dropped and the other refitted alone
    (through the origin); where both would be, ``(0, 0)``: the samples add nothing measurable."""
    t, e = list(x1), list(x2)
    stt, see, ste = _dot(t, t), _dot(e, e), _dot(t, e)
    sty, sey = _dot(t, y), _dot(e, y)
    det = stt * see - ste * ste
    if det > 1e-12 * stt * see:
        a, b = (sty * see - sey * ste) / det, (sey * stt - sty * ste) / det
        if a >= 0 and b >= 0:
            return a, b
    # one term alone: the better of the two single-term fits that stays non-negative
    fits = [(max(sty / stt, 0.0), 0.0), (0.0, max(sey / see, 0.0))] if stt > 0 and see > 0 else [(0.0, 0.0)]
    return min(fits, key=lambda ab: sum((yi - ab[0] * ti - ab[1] * ei) ** 2 for ti, ei, yi in zip(t, e, y)))


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b))
