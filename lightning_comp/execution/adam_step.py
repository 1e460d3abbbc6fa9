"""The Adam(W) step of a managed parameter, in the formats of its plan entry: its moments in FP32, BF16 or 8-bit codes,
the parameter itself FP32 or a BF16 master rounded stochastically.

BF16 moments are rounded stochastically too. Rounded to nearest, the second moment stops following the gradients:
with ``beta2 = 0.999`` a step changes it by 0.1 % of the difference between the squared gradient and itself, below
half a BF16 spacing (0.2 %) unless the squared gradient is three times the moment or more, so it rises on spikes and
never decays. Over 3000 steps of unit-variance gradients it ended at 1.30 (1.00 in FP32 and with stochastic
rounding), every step size then 0.88x Adam's; and as gradients shrink in training, the moment stays at its
high-water mark.

:func:`adam_step` applies Adam(W)'s arithmetic in FP32 (decoupled or L2 weight decay, AMSGrad, ``maximize``) from a
param group's current hyper-parameters (:class:`AdamSettings`), reading and writing the moments in the optimizer's own
state keys; :func:`state_nbytes` says what those moments hold. Which parameters are stepped here, and when, is
:class:`~lightning_comp.execution.optimizer_states.OptimizerStates`'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_comp.errors import UnsupportedSetupError
from lightning_comp.numerics import block_quant
from lightning_comp.numerics.precision import StatePrecision
from lightning_comp.numerics.stochastic_rounding import round_to_bf16

__all__ = ["AdamSettings", "adam_step", "check_optimizer", "state_nbytes", "to_own_format", "undo_load_cast"]

_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False))  # key, signed


@dataclass(frozen=True)
class AdamSettings:
    """The hyper-parameters of one Adam(W) step, read from a parameter group of ``torch.optim.Adam``/``AdamW``.

    Attributes:
        lr: the learning rate.
        betas: the moments' decay rates.
        eps: added to the denominator.
        weight_decay: the weight-decay factor.
        decoupled: whether weight decay is decoupled (AdamW's: the weights shrink) rather than L2 (Adam's: added to
            the gradient).
        amsgrad: whether the denominator uses the maximum second moment so far.
        maximize: whether the objective is maximised.
    """

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    decoupled: bool
    amsgrad: bool = False
    maximize: bool = False

    @classmethod
    def of(cls, optimizer: Optimizer, group: dict[str, Any]) -> AdamSettings:
        """The settings ``group`` of ``optimizer`` steps with now (LR schedulers change them between steps).

        Weight decay is decoupled for every ``AdamW`` (its own class before torch 2.6, a subclass of ``Adam`` since)
        and for an ``Adam`` whose group says ``decoupled_weight_decay=True`` (torch 2.6 and later).
        """
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
        beta1, beta2 = (float(b) for b in group["betas"])
        return cls(lr=float(group["lr"]), betas=(beta1, beta2), eps=float(group["eps"]),
                   weight_decay=float(group["weight_decay"]), decoupled=decoupled,
                   amsgrad=bool(group.get("amsgrad", False)), maximize=bool(group.get("maximize", False)))


def adam_step(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], settings: AdamSettings,
              precision: StatePrecision, rounding: torch.Generator | None,
              moment_rounding: torch.Generator | None = None) -> None:
    """One Adam(W) step of ``p`` in FP32 with ``settings``, its moments read and written in ``precision``'s format;
    with ``rounding``, the new BF16 value of ``p`` is rounded stochastically from it; with ``moment_rounding``, BF16
    moments are (else to nearest: see the module docstring for why the plugin never does that)."""
    amsgrad = settings.amsgrad
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
    moments = [(k, signed) for k, signed in _MOMENTS if k != "max_exp_avg_sq" or amsgrad]
    fmt = _format(precision, p)
    values = {k: _read(state, k, signed, p) for k, signed in moments}
    state["step"] += 1
    step = float(state["step"])
    lr = settings.lr
    beta1, beta2 = settings.betas
    eps, decay = settings.eps, settings.weight_decay
    g = grad.float()
    if settings.maximize:
        g = -g
    in_place = p.dtype == torch.float32
    weights = p.detach() if in_place else p.detach().float()
    if decay != 0:
        if settings.decoupled:
            weights.mul_(1 - lr * decay)
        else:
            g = g.add(weights, alpha=decay)
    m, v = values["exp_avg"], values["exp_avg_sq"]
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias1, bias2_sqrt = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
    if amsgrad:
        top = values["max_exp_avg_sq"]
        torch.maximum(top, v, out=top)
        denom = (top.sqrt() / bias2_sqrt).add_(eps)
    else:
        denom = (v.sqrt() / bias2_sqrt).add_(eps)
    weights.addcdiv_(m, denom, value=-lr / bias1)
    for key, signed in moments:
        _write(state, key, values[key], fmt, signed, moment_rounding)
    if rounding is not None:
        p.detach().copy_(round_to_bf16(weights, rounding))
    elif not in_place:
        p.detach().copy_(weights)  # a parameter that was BF16 of its own: rounded to nearest, as its optimizer would


def state_nbytes(p: torch.Tensor, precision: StatePrecision, amsgrad: bool = False) -> int:
    """Bytes Adam's state of ``p`` takes at ``precision`` (moments, 8-bit block scales and the step counter)."""
    moments = 3 if amsgrad else 2
    fmt = _format(precision, p)
    if fmt == torch.uint8:
        per_moment = block_quant.packed_size(p.numel())
    else:
        per_moment = p.numel() * (2 if fmt == torch.bfloat16 else 4)
    return moments * per_moment + 4


# ------------------------------------------------------------------------------------------------ state formats
def _format(state: StatePrecision, p: torch.Tensor) -> torch.dtype:
    """The dtype a moment of ``p`` is stored in under ``state`` (uint8: 8-bit codes)."""
    if state is StatePrecision.INT8 and block_quant.quantisable(p):
        return torch.uint8
    return torch.bfloat16 if state is StatePrecision.BF16 else torch.float32


def _read(state: dict[str, Any], key: str, signed: bool, p: torch.Tensor) -> torch.Tensor:
    """The moment ``key`` in FP32 (the stored tensor itself when it is FP32: updated in place; zeros if absent)."""
    stored = state.get(key)
    if stored is None:
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
    if _packed(stored, p):
        return block_quant.unpack(stored, p.shape, signed).dequantise()
    return stored if stored.dtype == torch.float32 else stored.float()


def _packed(stored: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether ``stored`` is a packed 8-bit moment of ``p`` (bytes, or bytes a load cast to ``p``'s dtype)."""
    return stored.dtype == torch.uint8 or (stored.dim() == 1 and stored.shape != p.shape
                                           and stored.numel() == block_quant.packed_size(p.numel()))


def _write(state: dict[str, Any], key: str, values: torch.Tensor, fmt: torch.dtype, signed: bool,
           rounding: torch.Generator | None = None) -> None:
    """Store FP32 ``values`` as the moment ``key`` in ``fmt`` (BF16 rounded stochastically with ``rounding``)."""
    stored = state.get(key)
    if fmt == torch.bfloat16 and rounding is not None:
        values = round_to_bf16(values, rounding)
    if fmt == torch.uint8:
        if stored is not None and stored.dtype == torch.uint8:
            moment = block_quant.unpack(stored, values.shape, signed)  # views of ``stored``: quantised in place
            block_quant.into(values, moment.codes, moment.scale, signed)
        else:
            state[key] = block_quant.pack(block_quant.QuantisedMoment.quantise(values, signed))
        return
    if stored is not None and stored.dtype == fmt and stored.shape == values.shape:
        if stored is not values:
            stored.copy_(values)
    else:
        state[key] = values if fmt == torch.float32 else values.to(fmt)


def to_own_format(state: dict[str, Any], p: torch.Tensor) -> None:
    """Return an unmanaged parameter's state to the optimizer's own format (moments in ``p``'s dtype and shape)."""
    for key, signed in _MOMENTS:
        stored = state.get(key)
        if stored is None:
            continue
        if _packed(stored, p):
            state[key] = block_quant.unpack(stored, p.shape, signed).dequantise().to(p.dtype)
        elif stored.dtype != p.dtype and stored.is_floating_point():
            state[key] = stored.to(p.dtype)


def undo_load_cast(state: dict[str, Any], p: torch.Tensor, precision: StatePrecision) -> None:
    """Put back, in ``precision``'s format, the moments of a managed parameter that ``Optimizer.load_state_dict``
    cast to ``p``'s dtype where no load hook kept their saved dtypes (under Fabric the plugin meets the optimizer only
    at its first step): packed 8-bit moments cast to a float dtype (their bytes are integers, exact in any float
    dtype) and BF16 moments cast to FP32 (exact). Lossless, so a resumed step takes the path and the random bits the
    uninterrupted run's step took; moments in another format (a changed plan) are left to :func:`adam_step`'s
    conversion."""
    for key, _ in _MOMENTS:
        stored = state.get(key)
        if not isinstance(stored, torch.Tensor) or not stored.is_floating_point():
            continue
        if precision is StatePrecision.INT8 and block_quant.quantisable(p) and _packed(stored, p):
            state[key] = stored.to(torch.uint8)
        elif precision is StatePrecision.BF16 and stored.dtype == torch.float32 and stored.shape == p.shape \
                and torch.equal(stored.bfloat16().float(), stored):
            state[key] = stored.bfloat16()


def check_optimizer(optimizer: Optimizer, group: dict[str, Any], name: str) -> None:
    """Refuse an optimizer whose step :func:`adam_step` does not reproduce, naming it and the parameter ``name``."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise UnsupportedSetupError(
            f"{type(optimizer).__qualname__} steps parameter {name!r}, whose plan entry sets state/master precision:"
            " those apply to torch.optim.Adam and torch.optim.AdamW only. Use one of them, or keep state='fp32' and"
            " master='fp32' for it.")
    for flag in ("capturable", "differentiable", "fused"):
        if group.get(flag):
            raise UnsupportedSetupError(
                f"{type(optimizer).__qualname__}({flag}=True) steps parameter {name!r}, whose plan entry sets"
                " state/master precision: that step is not reproduced here. Drop the flag, or keep state='fp32' and"
                " master='fp32' for it.")
