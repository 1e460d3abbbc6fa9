"""Codes of torchao's dynamic tree map by arithmetic, both ways: the 8-bit codec a compiled update runs.

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
codes (about one value in a million; ``tests/unit/test_update_path.py``), which may get the neighbouring one.

:func:`decode` is the inverse by the same closed form: the decade of a code's magnitude by six compares, its power of
ten by six selects. It gives each map value to a relative 2e-7 (``tests/unit/test_update_path.py``) rather than bit for
bit, and it replaces a gather of the 1 KiB map, which
Inductor's CPU code does element by element: in the compiled 8-bit step on 2 EPYC cores (AVX512-BF16) the gathers
cost about 5.9 ns per parameter against 3.3 ns for the arithmetic (``benchmarks/update_speed.py`` measures the step
in training). The eager step keeps the exact lookup (:func:`~lightning_comp.numerics.block_quant.dequantise`), the
fastest way op by op.
"""

from __future__ import annotations

import torch

__all__ = ["decode", "encode", "encoding_table"]

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


def encoding_table(signed: bool) -> tuple[float, ...]:
    """:func:`encode`'s constants in the order the native update's C code reads them
    (``lightning_comp/execution/native_adam.c``): per decade its multiplier, offset, first code magnitude and
    last index within it (seven of each), the six thresholds between decades, the magnitudes below which a value is
    zero and from which it is one, and the code magnitude of one."""
    rows = _decades(signed)
    zero, between, one = _thresholds(signed)
    columns = tuple(value for column in range(4) for value in (row[column] for row in rows))
    return (*columns, *between, zero, one, _top(signed))


def _top(signed: bool) -> float:
    """The code magnitude of 1: 128 in the signed map (code 255; -1 gets code 0), 255 in the unsigned one."""
    return 2.0**_DECADES if signed else 2.0 ** (_DECADES + 1) - 1


def encode(scaled: torch.Tensor, signed: bool) -> torch.Tensor:
    """The uint8 code of the map value nearest each element of ``scaled`` (FP32, within [-1, 1]; the signed map for
    the first moment, the unsigned one, of values >= 0, for the second)."""
    # computed here, not read from module globals: ``torch.compile`` makes a float it reads from a global a tensor
    # input of the graph, converted at every call (+80 us a call of the compiled 8-bit step on a CPU); floats this
    # code computes from literals are constants of the graph
    rows = _decades(signed)
    zero, between, one = _thresholds(signed)
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
    magnitude = torch.where(y >= one, _top(signed), magnitude)
    if not signed:
        return magnitude.to(torch.uint8)
    # the negative half has no -1: its largest magnitude is that of the value below 1
    negative = 127.0 - torch.clamp(magnitude, max=127.0)
    return torch.where(scaled < 0, negative, 127.0 + magnitude).to(torch.uint8)


def decode(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """The FP32 map value of each ``uint8`` code in ``codes`` (the signed map's or the unsigned one's), to a relative
    2e-7."""
    c = codes.float()
    if signed:
        magnitude = (c - 127.0).abs()  # the code magnitude: 0 is zero, 128 is 1, decade d holds 2^d .. 2^(d+1) - 1
        steps = [float(2**j) for j in range(1, _DECADES)]
    else:
        magnitude = c + 1.0  # decade d holds the codes 2^(d+1) - 1 .. 2^(d+2) - 2; 0 is zero, 255 is 1
        steps = [float(2 ** (j + 1)) for j in range(1, _DECADES)]
    decade = torch.zeros_like(c)
    for step in steps:
        decade = decade + (magnitude >= step).float()
    count = torch.exp2(decade) if signed else torch.exp2(decade + 1.0)  # the decade's value count n
    power = torch.full_like(c, 1e-6)
    for d in range(1, _DECADES):
        power = torch.where(decade >= d, 10.0 ** (d - 6), power)
    value = power * (0.1 + (magnitude - count + 0.5) * 0.9 / count)
    if not signed:
        return torch.where(c == 0.0, 0.0, torch.where(c == 255.0, 1.0, value))
    value = torch.where(magnitude == 0.0, 0.0, torch.where(magnitude == 128.0, 1.0, value))
    return torch.where(c < 127.0, -value, value)
