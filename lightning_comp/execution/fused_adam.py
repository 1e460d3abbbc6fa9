"""The Adam(W) step of one managed parameter as a single pure function per state format: what the compiled update
path traces into one kernel.

:func:`~lightning_comp.execution.adam_step.adam_step` runs the step op by op (each op a pass over the parameter's
memory, and on CUDA a kernel launch), converting formats as it goes. The functions here take a parameter whose state
is already in its planned format and do the whole step (decode the moments, Adam's arithmetic in FP32, encode the
moments, round the weights) in element-wise ``torch`` code with no Python branch on a tensor's value and no read back
to the host, so that ``torch.compile`` fuses it into a kernel or two (the 8-bit block scales are a reduction) that
reads and writes each byte once (:mod:`lightning_comp.execution.update_path` compiles and calls them).

The hyper-parameters come as one FP32 tensor on the parameter's device, ``hyper``, in the order of
:data:`HYPER_PARAMETERS`: a tensor rather than Python floats, which ``torch.compile(dynamic=True)`` would keep symbolic
too but converts to tensors one by one at every call (about 100 us a call on a CPU, against 25 us for the tensor, on
a 4096-element parameter); an LR schedule's new value recompiles neither. Each is computed on the host in double
precision and rounded once, as the eager step's Python scalars are: ``sign`` (-1 to maximise), ``l2`` (Adam's weight
decay, added to the gradient), ``keep`` (``1 - lr * weight_decay``, AdamW's, applied to the weights), ``beta1_rest``
and ``beta2_rest`` (``1 - beta``), ``step_size`` (``lr / (1 - beta1^t)``), ``bias2_sqrt`` (``sqrt(1 - beta2^t)``).
The weights are FP32 (updated in place), or a BF16 master rounded stochastically (``stochastic``, with
:func:`~lightning_comp.numerics.stochastic_rounding.round_to_bf16_hashed`'s ``key``) or to nearest; BF16 moments are
always rounded stochastically, from streams of the same key.
"""

from __future__ import annotations

import torch

from lightning_comp.numerics.dynamic_codec import decode, encode
from lightning_comp.numerics.stochastic_rounding import round_to_bf16_hashed

__all__ = ["EXP_AVG_SQ_STREAM", "EXP_AVG_STREAM", "HYPER_PARAMETERS", "step_8bit_moments", "step_bf16_moments",
           "step_fp32_moments"]

# offsets of the BF16 moments' rounding streams from the weights' key (the hash's input is the key plus the element's
# index: odd offsets far apart, so that the three streams do not overlap for any tensor under 2**29 elements)
EXP_AVG_STREAM, EXP_AVG_SQ_STREAM = 0x5BD1E995, 0x9E3779B1

HYPER_PARAMETERS = ("sign", "l2", "keep", "beta1_rest", "beta2", "beta2_rest", "step_size", "bias2_sqrt", "eps")
"""The values of the ``hyper`` tensor every step function takes, in order."""


def _adam(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adam(W)'s arithmetic in FP32 with the :data:`HYPER_PARAMETERS` in ``hyper``: the new weights and moments."""
    sign, l2, keep, beta1_rest, beta2, beta2_rest, step_size, bias2_sqrt, eps = hyper.unbind(0)
    g = g * sign + w * l2
    w = w * keep
    m = m + (g - m) * beta1_rest
    v = v * beta2 + g * g * beta2_rest
    w = w - step_size * m / (v.sqrt() / bias2_sqrt + eps)
    return w, m, v


def _store_weights(p: torch.Tensor, w: torch.Tensor, stochastic: bool, key: int) -> None:
    """Write the new FP32 weights ``w`` into ``p``: as they are, or rounded to BF16 (stochastically with ``key``)."""
    if p.dtype == torch.bfloat16 and stochastic:
        p.copy_(round_to_bf16_hashed(w, key))
    else:
        p.copy_(w)


def step_fp32_moments(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      hyper: torch.Tensor, stochastic: bool, key: int) -> None:
    """One step of ``p`` whose moments are FP32 tensors of its shape (updated in place)."""
    w, m, v = _adam(p.float(), grad.float(), exp_avg, exp_avg_sq, hyper)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    _store_weights(p, w, stochastic, key)


def step_bf16_moments(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      hyper: torch.Tensor, stochastic: bool, key: int) -> None:
    """One step of ``p`` whose moments are BF16 tensors of its shape (read in FP32, written rounded stochastically,
    each from its own stream of ``key``'s hash: :mod:`lightning_comp.execution.adam_step` says why not to nearest)."""
    w, m, v = _adam(p.float(), grad.float(), exp_avg.float(), exp_avg_sq.float(), hyper)
    exp_avg.copy_(round_to_bf16_hashed(m, key + EXP_AVG_STREAM))
    exp_avg_sq.copy_(round_to_bf16_hashed(v, key + EXP_AVG_SQ_STREAM))
    _store_weights(p, w, stochastic, key)


def step_8bit_moments(p: torch.Tensor, grad: torch.Tensor, exp_avg_codes: torch.Tensor, exp_avg_scales: torch.Tensor,
                      exp_avg_sq_codes: torch.Tensor, exp_avg_sq_scales: torch.Tensor, hyper: torch.Tensor,
                      stochastic: bool, key: int) -> None:
    """One step of ``p`` whose moments are 8-bit codes with one FP32 scale per block, all in place.

    Every tensor comes shaped by blocks: ``p``, ``grad`` and the codes (``uint8``) as ``(blocks,``
    :data:`~lightning_comp.numerics.block_quant.BLOCK_SIZE` ``)``, each moment's scales as the ``4 * blocks`` bytes
    of its FP32 values (the two parts of a packed moment, :func:`~lightning_comp.numerics.block_quant.pack`, passed
    as two ``uint8`` views that do not overlap: ``torch.compile`` takes no input mutated through views of two dtypes).
    Only the block count is a symbolic size, so that Inductor vectorises the block reductions (with the flat length
    symbolic instead it emitted scalar code, 20x slower on a CPU). Codes are decoded and encoded by
    :mod:`~lightning_comp.numerics.dynamic_codec`'s arithmetic."""
    m = decode(exp_avg_codes, True) * exp_avg_scales.view(torch.float32).view(-1, 1)
    v = decode(exp_avg_sq_codes, False) * exp_avg_sq_scales.view(torch.float32).view(-1, 1)
    w, m, v = _adam(p.float(), grad.float(), m, v, hyper)
    _encode_into(m, exp_avg_codes, exp_avg_scales, True)
    _encode_into(v, exp_avg_sq_codes, exp_avg_sq_scales, False)
    _store_weights(p, w, stochastic, key)


def _encode_into(blocks: torch.Tensor, codes: torch.Tensor, scale_bytes: torch.Tensor, signed: bool) -> None:
    """Block-scale FP32 ``blocks`` as torchao does (each block by its largest magnitude, at least 1e-12) and write
    their codes and their scales' bytes."""
    scale = blocks.abs().amax(-1).clamp(min=1e-12)
    codes.copy_(encode(blocks / scale.view(-1, 1), signed))
    scale_bytes.copy_(scale.view(torch.uint8))
