"""Stochastic rounding from FP32 to BF16, with a generator of its own.

A BF16 weight updated by round-to-nearest loses every update smaller than half its spacing (about 0.4 % of its
magnitude), so small learning rates stop training. Rounding up with the probability of the discarded fraction keeps
the update in expectation: add 16 random low bits to the FP32 bit pattern and truncate. The random bits come from a
generator the caller owns (:class:`~lightning_comp.execution.optimizer_states.OptimizerStates` checkpoints its
state), so a resumed run rounds exactly as the uninterrupted one, and the user's RNG streams (dropout, data order)
are not consumed.
"""

from __future__ import annotations

import torch

__all__ = ["round_to_bf16"]


def round_to_bf16(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``values`` (FP32) rounded stochastically to BF16: unbiased, ``E[result] == values`` up to BF16's range.

    Non-finite values (inf, NaN) keep their class: NaN stays NaN, inf stays inf.
    """
    bits = values.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, values.shape, dtype=torch.int32, device=values.device, generator=generator)
    rounded = (bits + noise) & -65536  # 0xFFFF0000 as a signed int32
    out = rounded.view(torch.float32).to(torch.bfloat16)
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        out = torch.where(finite, out, values.to(torch.bfloat16))
    return out
