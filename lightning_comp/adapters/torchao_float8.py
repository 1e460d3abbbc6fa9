"""The one door to torchao's float8 training pieces: the scaled-matmul autograd function of ``Float8Linear``.

An operator whose plan entry is ``fp8``/``fp8-rowwise`` computes its ``F.linear`` through torchao's
``matmul_with_hp_or_float8_args`` (``torchao.float8.float8_linear``), the function torchao's own ``Float8Linear``
calls: it scales each operand of the forward matmul and of both backward matmuls to ``float8_e4m3fn`` at every call
(dynamic scaling, per tensor or per row as the recipe says, ``Float8LinearConfig.from_recipe_name``) and multiplies
them with ``torch._scaled_mm``, saving its high-precision input and weight for backward. The module is not swapped:
the model's ``nn.Linear`` keeps its class, parameters and state-dict keys, and an operator's precision can change
between steps (a search trials fp8 and bf16 on the same module).

Used pieces (torchao 0.18): ``Float8LinearConfig``, ``LinearMMConfig``/``ScaledMMConfig`` and
``matmul_with_hp_or_float8_args``. The last two are not documented as public API; every use goes through this file.
Importing ``torchao`` costs about 2.5 s (and logs a warning per CUDA extension it cannot load on a CPU build, which
this door silences), so it happens on the first fp8 call, not when lightning-comp is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from lightning_comp.errors import MissingExtraError

__all__ = ["FP8_RECIPES", "float8_linear", "recipe_config"]

#: The scaling recipes an fp8 precision may name (torchao's recipe names).
FP8_RECIPES = ("tensorwise", "rowwise")


@functools.cache
def _float8() -> Any:
    # On a CPU build torchao logs a warning per CUDA extension it cannot load: noise for an fp8 plan (which never
    # needs them there); anything worse than a warning still shows.
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        from torchao.float8 import config, float8_linear, float8_training_tensor
    except ImportError as err:
        raise MissingExtraError(
            "fp8 compute needs torchao (pip install 'torchao>=0.18' together with your torch pin, e.g."
            f" pip install torch=={torch.__version__.split('+')[0]} torchao): {err}") from None
    finally:
        logger.setLevel(level)
    return config, float8_linear, float8_training_tensor


@functools.cache
def recipe_config(recipe: str) -> tuple[Any, Any]:
    """torchao's ``(Float8LinearConfig, LinearMMConfig)`` for ``recipe`` (``"tensorwise"`` or ``"rowwise"``), built
    as ``Float8Linear`` builds them (not emulated: the matmuls run ``torch._scaled_mm``), with ``pad_inner_dim``: the
    weight-gradient matmul's inner dimension is the number of tokens in the batch, which ``_scaled_mm``'s CUDA
    kernels need to be a multiple of 16 (a batch of 3 sequences of 6 tokens is refused without it; the CUDA
    simulation found it), so torchao pads it, and any other inner dimension, where it is not."""
    config_module, _, tensors = _float8()
    config = dataclasses.replace(config_module.Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)

    def mm(gemm: Any) -> Any:
        return tensors.ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)

    mm_config = tensors.LinearMMConfig(mm(config.gemm_config_output), mm(config.gemm_config_grad_input),
                                       mm(config.gemm_config_grad_weight))
    return config, mm_config


def float8_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  recipe: str) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` with float8 matmul operands scaled as ``recipe`` says, in forward and
    backward; the output has ``input``'s dtype, the weight's gradient ``weight``'s."""
    config, mm_config = recipe_config(recipe)
    output: torch.Tensor = _float8()[1].matmul_with_hp_or_float8_args.apply(input, weight.t(), mm_config, config)
    if bias is not None:
        output = output + bias.to(output.dtype)
    return output
