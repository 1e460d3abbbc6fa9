"""Stochastic rounding from FP32 to BF16: the random bits from a generator, or from a counter-based hash.

A BF16 weight updated by round-to-nearest loses every update smaller than half its spacing (about 0.4 % of its
magnitude), so small learning rates stop training. Rounding up with the probability of the discarded fraction keeps
the update in expectation: add 16 random low bits to the FP32 bit pattern and truncate.

Two sources of those bits, one per update path
(:class:`~lightning_comp.execution.update_path.UpdatePath`):

- :func:`round_to_bf16` draws them from a generator the caller owns
  (:class:`~lightning_comp.execution.optimizer_states.OptimizerStates` checkpoints its state): the eager update,
  where ``torch.randint`` is the cheapest source (about 7 ns per element on 2 CPU cores, against 28-60 ns for a hash
  evaluated op by op).
- :func:`round_to_bf16_hashed` computes them from ``(seed, tensor name, step, element index)``
  (:func:`rounding_key`) with a 32-bit integer hash (Chris Wellons' "lowbias32" mixer): no generator, no state to
  checkpoint beyond the optimizer's own step counter, and a handful of integer operations that ``torch.compile``
  fuses into the update's kernel (a generator argument would break the graph). The same key and shape give the same
  bits on every device, compiled or not.

Either way a resumed run rounds exactly as the uninterrupted one, the user's RNG streams (dropout, data order) are
not consumed, and nothing is read back to the host: non-finite values keep their class (NaN stays NaN, inf stays
inf) by an unconditional select.
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["round_to_bf16", "round_to_bf16_hashed", "rounding_key"]

_LOW = 1 << 16
_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # spreads consecutive steps over the 32-bit space


def round_to_bf16(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``values`` (FP32) rounded stochastically to BF16 with random bits from ``generator``: unbiased,
    ``E[result] == values`` up to BF16's range. A ``DTensor`` (FSDP2's shards of Adam's moments) is rounded shard by
    shard, each rank drawing from its own generator, and stays a ``DTensor`` on the same mesh and placements."""
    to_local = getattr(values, "to_local", None)
    if callable(to_local):
        from torch.distributed.tensor import DTensor

        rounded = round_to_bf16(to_local(), generator)
        return DTensor.from_local(rounded, values.device_mesh, values.placements,  # type: ignore[attr-defined]
                                  run_check=False, shape=values.shape, stride=values.stride())
    noise = torch.randint(0, _LOW, values.shape, dtype=torch.int32, device=values.device, generator=generator)
    return _rounded(values, noise)


def round_to_bf16_hashed(values: torch.Tensor, key: int) -> torch.Tensor:
    """``values`` (FP32) rounded stochastically to BF16 with random bits hashed from ``key`` (:func:`rounding_key`:
    the tensor and the step) and each element's index: unbiased, and a pure function of its arguments."""
    index = torch.arange(values.numel(), dtype=torch.int64, device=values.device)
    return _rounded(values, (_mix(index + key) & (_LOW - 1)).to(torch.int32).view(values.shape))


def rounding_key(seed: int, name: str, step: int) -> int:
    """The key of :func:`round_to_bf16_hashed` for the tensor ``name`` at optimizer step ``step``: 32 bits mixed
    from the three, so that every tensor and step draws from its own place of the hash's sequence."""
    x = (seed ^ zlib.crc32(name.encode())) & _MASK32
    return int(_mix_int((x + step * _GOLDEN) & _MASK32))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of the low 32 bits of ``x`` (int64; products wrap, their low 32 bits are kept)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _mix_int(x: int) -> int:
    """:func:`_mix` of one Python integer."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _rounded(values: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``values`` with ``noise`` (int32 in [0, 2^16)) added to their low bits, truncated to BF16; non-finite values
    rounded to nearest (they keep their class)."""
    bits = values.contiguous().view(torch.int32)
    rounded = ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # 0xFFFF0000 as a signed int32
    return torch.where(torch.isfinite(values), rounded, values.to(torch.bfloat16))
