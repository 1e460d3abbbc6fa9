"""Codes of torchao's dynamic tree map by arithmetic: the 8-bit quantiser a compiled update runs.

:mod:`~lightning_comp.numerics.block_quant` finds a value's code in a 1 MiB lookup table, the fastest way eagerly on a
CPU; inside a compiled kernel a gather per element is the slowest part of the step (about 7.7 ns per element through
the table and 19.6 ns through torchao's branchless search, compiled, on 2 CPU cores, against 4.9 ns here). The map
has a closed form, so the code can be computed instead of looked up: its positive half is 0, then seven decades
``d = 0..6`` of equally spaced values ``10^(d-6) * (0.1 + (k + 0.5) * 0.9 / n_d)``, ``k < n_d``, with ``n_d = 2^d``
values in a decade of the signed map and ``2^(d+1)`` in the unsigned one, then 1. The decade of a scaled magnitude is
told by six threshold compares (the midpoints between decades), the value within it by one multiply and a floor;
the signed map's negative half mirrors its positive one without -1. Everything is element-wise ``torch`` arithmetic
(compares, selects, multiplies), which vectorises on a CPU and fuses into one kernel on CUDA.

:func:`encode` gives torchao's nearest code except for values within float rounding of the midpoint between two
codes (about one value in a million; ``tests/unit/test_dynamic_codec.py``), which may get the neighbouring one.
Decoding stays a lookup of the 256-value map (:func:`~lightning_comp.numerics.block_quant.dequantise`): one gather of a
1 KiB table is cheaper than the arithmetic.
"""

from __future__ import annotations

import torch

__all__ = ["encode"]

_DECADES = 7


def _decades(signed: bool) -> tuple[tuple[float, float, float, float], ...]:
    """Per decade: (multiplier ``n/(0.9 p)``, offset ``0.1 n / 0.9``, code of its first value, its value count - 1),
    where ``p = 10^(d-6)`` and ``n`` is the decade's value count; codes count magnitudes (0 is the map's zero)."""
    rows = []
    for d in range(_DECADES):
        n = 2**d if signed else 2 ** (d + 1)
        scale = 10.0 ** (d - 6)
        first_code = 2**d if signed else 2 ** (d + 1) - 1
        rows.append((n / (0.9 * scale), 0.1 * n / 0.9, float(first_code), float(n - 1)))
    return tuple(rows)


def _thresholds(signed: bool) -> tuple[float, tuple[float, ...], float]:
    """The magnitudes where codes change decade: below the first, zero; the six between decades; above the last, 1."""
    def value(d: int, k: int) -> float:
        n = 2**d if signed else 2 ** (d + 1)
        return 10.0 ** (d - 6) * (0.1 + (k + 0.5) * 0.9 / n)

    counts = [2**d if signed else 2 ** (d + 1) for d in range(_DECADES)]
    zero = value(0, 0) / 2
    between = tuple((value(d - 1, counts[d - 1] - 1) + value(d, 0)) / 2 for d in range(1, _DECADES))
    one = (value(_DECADES - 1, counts[-1] - 1) + 1.0) / 2
    return zero, between, one


# constants of the code (``torch.compile`` traces :func:`encode`: plain tuples, no cached calls)
_ROWS = {signed: _decades(signed) for signed in (True, False)}
_THRESHOLDS = {signed: _thresholds(signed) for signed in (True, False)}


def encode(scaled: torch.Tensor, signed: bool) -> torch.Tensor:
    """The uint8 code of the map value nearest each element of ``scaled`` (FP32, within [-1, 1]; the signed map for
    the first moment, the unsigned one, of values >= 0, for the second)."""
    rows = _ROWS[signed]
    zero, between, one = _THRESHOLDS[signed]
    y = scaled.abs()
    multiplier, offset, first, last = (torch.full_like(y, value) for value in rows[0])
    for d in range(1, _DECADES):
        above = y >= between[d - 1]
        row = rows[d]
        multiplier = torch.where(above, row[0], multiplier)
        offset = torch.where(above, row[1], offset)
        first = torch.where(above, row[2], first)
        last = torch.where(above, row[3], last)
    within = torch.minimum(torch.floor(y * multiplier - offset).clamp(min=0.0), last)
    magnitude = torch.where(y < zero, 0.0, first + within)
    top = 2.0 ** (_DECADES + 1) - 1 if not signed else 2.0**_DECADES  # the code magnitude of 1 (255 / 127 + 128)
    magnitude = torch.where(y >= one, top, magnitude)
    if not signed:
        return magnitude.to(torch.uint8)
    # the negative half has no -1: its largest magnitude is that of the value below 1
    negative = 127.0 - torch.clamp(magnitude, max=127.0)
    return torch.where(scaled < 0, negative, 127.0 + magnitude).to(torch.uint8)
