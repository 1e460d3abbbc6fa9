"""The Adam(W) step of one managed parameter as a single pure function per state format: what the compiled update
path traces into one kernel.

:func:`~lightning_comp.execution.adam_step.adam_step` runs the step op by op (each op a pass over the parameter's
memory, and on CUDA a kernel launch), converting formats as it goes. The functions here take a parameter whose state
is already in its planned format and do the whole step (decode the moments, Adam's arithmetic in FP32, encode the
moments, round the weights) in element-wise ``torch`` code with no Python branch on a tensor's value and no read back
to the host, so that ``torch.compile`` fuses it into a kernel or two (the 8-bit block scales are a reduction) that
reads and writes each byte once (:mod:`lightning_comp.execution.update_path` compiles and calls them).

Every hyper-parameter is a Python float, which ``torch.compile(dynamic=True)`` keeps symbolic: an LR schedule's new
value does not recompile. Weight decay comes as two factors, one of which is zero: ``l2`` (Adam's, added to the
gradient) and ``shrink`` (``lr * weight_decay``, AdamW's, applied to the weights); ``sign`` is -1 to maximise.
The bias corrections come computed from the step count (``bias1 = 1 - beta1^t``, ``bias2_sqrt = sqrt(1 - beta2^t)``).
The weights are FP32 (updated in place), or a BF16 master rounded stochastically (``stochastic``, with
:func:`~lightning_comp.numerics.stochastic_rounding.round_to_bf16_hashed`'s ``key``) or to nearest.
"""

from __future__ import annotations

import torch

from lightning_comp.numerics import block_quant
from lightning_comp.numerics.dynamic_codec import encode
from lightning_comp.numerics.stochastic_rounding import round_to_bf16_hashed

__all__ = ["step_8bit_moments", "step_bf16_moments", "step_fp32_moments"]


def _adam(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, beta1: float, beta2: float,
          eps: float, l2: float, shrink: float, sign: float, bias1: float, bias2_sqrt: float
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adam(W)'s arithmetic in FP32: the new weights and moments."""
    g = g * sign + w * l2
    w = w * (1.0 - shrink)
    m = m + (g - m) * (1.0 - beta1)
    v = v * beta2 + g * g * (1.0 - beta2)
    w = w - (lr / bias1) * m / (v.sqrt() / bias2_sqrt + eps)
    return w, m, v


def _store_weights(p: torch.Tensor, w: torch.Tensor, stochastic: bool, key: int) -> None:
    """Write the new FP32 weights ``w`` into ``p``: as they are, or rounded to BF16 (stochastically with ``key``)."""
    if p.dtype == torch.bfloat16 and stochastic:
        p.copy_(round_to_bf16_hashed(w, key))
    else:
        p.copy_(w)


def step_fp32_moments(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      lr: float, beta1: float, beta2: float, eps: float, l2: float, shrink: float, sign: float,
                      bias1: float, bias2_sqrt: float, stochastic: bool, key: int) -> None:
    """One step of ``p`` whose moments are FP32 tensors of its shape (updated in place)."""
    w, m, v = _adam(p.float(), grad.float(), exp_avg, exp_avg_sq, lr, beta1, beta2, eps, l2, shrink, sign, bias1,
                    bias2_sqrt)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    _store_weights(p, w, stochastic, key)


def step_bf16_moments(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      lr: float, beta1: float, beta2: float, eps: float, l2: float, shrink: float, sign: float,
                      bias1: float, bias2_sqrt: float, stochastic: bool, key: int) -> None:
    """One step of ``p`` whose moments are BF16 tensors of its shape (read in FP32, written rounded to nearest)."""
    w, m, v = _adam(p.float(), grad.float(), exp_avg.float(), exp_avg_sq.float(), lr, beta1, beta2, eps, l2, shrink,
                    sign, bias1, bias2_sqrt)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    _store_weights(p, w, stochastic, key)


def step_8bit_moments(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      signed_map: torch.Tensor, unsigned_map: torch.Tensor, lr: float, beta1: float, beta2: float,
                      eps: float, l2: float, shrink: float, sign: float, bias1: float, bias2_sqrt: float,
                      stochastic: bool, key: int) -> None:
    """One step of ``p`` whose moments are packed 8-bit moments (flat ``uint8``: codes, then the bytes of the FP32
    block scales, :func:`~lightning_comp.numerics.block_quant.pack`), decoded through the maps
    (:func:`~lightning_comp.numerics.block_quant.value_map`) and encoded by
    :func:`~lightning_comp.numerics.dynamic_codec.encode`, both in place."""
    numel = p.numel()
    m = _decode(exp_avg, numel, signed_map)
    v = _decode(exp_avg_sq, numel, unsigned_map)
    w, m, v = _adam(p.float().reshape(-1), grad.float().reshape(-1), m, v, lr, beta1, beta2, eps, l2, shrink, sign,
                    bias1, bias2_sqrt)
    _encode_into(m, exp_avg, True)
    _encode_into(v, exp_avg_sq, False)
    _store_weights(p, w.view(p.shape), stochastic, key)


def _decode(packed: torch.Tensor, numel: int, qmap: torch.Tensor) -> torch.Tensor:
    """The FP32 values of the packed moment of ``numel`` elements (``packed`` is read only through its own slices:
    ``torch.compile`` does not take an input mutated through views of two dtypes)."""
    codes = packed[:numel]
    scales = packed[numel:].view(torch.float32)
    return (qmap[codes.long()].view(-1, block_quant.BLOCK_SIZE) * scales.view(-1, 1)).view(-1)


def _encode_into(values: torch.Tensor, packed: torch.Tensor, signed: bool) -> None:
    """Block-scale FP32 ``values`` as torchao does (each block by its largest magnitude, at least 1e-12) and write
    their codes and scales' bytes into ``packed``."""
    numel = values.numel()
    blocks = values.view(-1, block_quant.BLOCK_SIZE)
    scale = blocks.abs().amax(-1).clamp(min=1e-12)
    packed[:numel].copy_(encode(blocks / scale.view(-1, 1), signed).view(-1))
    packed[numel:].copy_(scale.view(torch.uint8))
