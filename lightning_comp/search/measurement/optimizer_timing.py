"""How long the optimizer step of one operator's parameters takes in each optimizer-state and master format.

The batch stage profiles forward and backward only; the optimizer step is timed here, on copies, so the run's
parameters and state are never touched. Per parameter group (an operator's parameters) and per configuration, one
update of those parameters is timed in interleaved rounds, like every other comparison of the search, in each
:class:`UpdateVariant`:

- ``FP32`` (``"fp32"``): the user's own optimizer algorithm (a throwaway optimizer of its class, with the
  hyper-parameters of the group the parameters belong to, ``foreach`` included), on FP32 copies;
- ``INT8``, ``BF16`` (``"8bit"``, ``"bf16"``, :meth:`UpdateVariant.of` a state format):
  :func:`~lightning_comp.execution.adam_step.adam_step` with the moments in that format;
- ``MASTER`` (``"master"``): the same with BF16 parameter copies and stochastic rounding (and the moments of the
  configuration's ``state``);
- ``MASTER_FP32_COPIES`` (``"master+fp32 copies"``): ``MASTER`` for an operator that computes in FP32, which then
  computes with FP32 copies of its bf16 parameters: each timed update also makes the casts those copies cost a
  training step (the parameters to FP32 for the forward and again for backward, the FP32 gradient to bf16).

Each timed update follows an untimed one of the same configuration. Timed right after another configuration's,
every update read slow, the optimizer's own FP32 one most: on the default example (19 groups, 2 AVX2 EPYC cores,
the four configurations of a memory search) FP32's sum over the groups was 11.4-12.0 ms against 7.9-8.2 ms with an
untimed update first (6.4-7.3 ms timed alone; training's one call over every group 7.0-7.6 ms), the 8-bit one's
29.2-30.2 ms against 25.8-26.7 ms (training's managed loop: 26-31 ms). The FP32 update is part of the step the
memory levers' room is a share of; what a variant adds to it, a state lever's price, moved less (8-bit over FP32:
17.2-18.7 ms before, 17.9-18.5 ms after, in one run side by side;
``benchmarks/results/issue34_avx2/tenth_pass/update_timing_order_r1.txt``).

Moments start from the run's own state where it has one (after the warm-up, it does), so 8-bit codes see real
magnitudes; gradients are the parameters' own from the profiled step when present, else small random ones.

The managed variants run on the code the plugin steps them with in training (``updates``: a
:class:`~lightning_comp.execution.update_path.CompiledUpdates` of the plugin's update path, deciding as the plugin
does for a step that manages every timed group, each group's parameters in one call as training steps all of them
in one): native or compiled where training runs them so, so a lever is priced at what it costs there
(:mod:`~lightning_comp.execution.update_path` says where that is and how much it gains). Two unmeasured updates come
first then: the first converts the state, the second compiles.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_comp.common.spelled_enum import SpelledEnum
from lightning_comp.execution.adam_step import AdamSettings, adam_step
from lightning_comp.execution.update_path import CompiledUpdates, ManagedStep
from lightning_comp.numerics.precision import StatePrecision
from lightning_comp.search.measurement.clocks import Clock

__all__ = ["UpdateConfig", "UpdateVariant", "time_updates"]


class UpdateVariant(SpelledEnum):
    """One of the optimizer updates the parameter stage times and compares (the keys of its times, bytes and ratios).

    Its values are the state formats' (:class:`~lightning_comp.numerics.precision.StatePrecision`) and ``"master"``,
    as the record and the search's checkpoint spell them.
    """

    FP32 = "fp32"  # the optimizer's own update, FP32 state and weights
    BF16 = "bf16"  # the moments in bfloat16
    INT8 = "8bit"  # the moments block-quantised
    MASTER = "master"  # bf16 weights, stochastically rounded
    MASTER_FP32_COPIES = "master+fp32 copies"  # the same, of an operator computing in FP32: its copies' casts added

    @classmethod
    def of(cls, state: StatePrecision) -> UpdateVariant:
        """The update with the optimizer state in ``state`` (FP32 weights)."""
        return cls(state.value)

    @classmethod
    def noun(cls) -> str:
        return "optimizer-update configuration"


@dataclass(frozen=True)
class UpdateConfig:
    """One configuration of a group's update.

    Attributes:
        state: the moments' format (``None``: the user's own optimizer).
        master: whether the parameters are held in BF16 (stochastically rounded updates).
        fp32_copies: (with ``master``) the operator computes in FP32: the casts of its FP32 copies are timed too.
    """

    state: StatePrecision | None
    master: bool = False
    fp32_copies: bool = False


def time_updates(optimizer: Optimizer, groups: Mapping[str, Sequence[nn.Parameter]],
                 configs: Mapping[UpdateVariant, UpdateConfig], clock: Clock, rounds: int,
                 warmup: int, updates: CompiledUpdates | None = None,
                 variants: Mapping[str, Collection[UpdateVariant]] | None = None
                 ) -> dict[str, dict[UpdateVariant, list[float]]]:
    """Per group and configuration, the milliseconds of one update of the group's parameters per round.

    Args:
        optimizer: the run's optimizer (Adam or AdamW): its class, hyper-parameters and current state are read.
        groups: group name -> its parameters (each in ``optimizer``).
        configs: variant -> its configuration (``UpdateConfig(None)`` is the optimizer's own update).
        clock: the batch stage's clock.
        rounds: measured rounds.
        warmup: unmeasured rounds first.
        updates: the code that steps the managed variants, as the plugin's (``None``: eager).
        variants: group name -> the variants of ``configs`` timed for it (``None``, or a group not in it: all).
    """
    hyper = {id(p): {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
             for p in group["params"]}
    out: dict[str, dict[UpdateVariant, list[float]]] = {}
    managed = sum(p.numel() for params in groups.values() for p in params)  # a step that manages every group
    for name, params in groups.items():
        wanted = configs.keys() if variants is None or name not in variants else variants[name]
        runs = {label: _update(optimizer, name, params, hyper, config, updates, managed)
                for label, config in configs.items() if label in wanted}
        series: dict[UpdateVariant, list[float]] = {label: [] for label in runs}
        for index in range(warmup + rounds):
            for label, run in runs.items():
                run()  # untimed: the timed update finds its own data where training's does (module docstring)
                start = clock.now()
                run()
                end = clock.now()
                clock.finish()
                if index >= warmup:
                    series[label].append(clock.elapsed_ms(start, end))
        out[name] = series
    return out


def _update(optimizer: Optimizer, name: str, params: Sequence[nn.Parameter], hyper: dict[int, dict[str, Any]],
            config: UpdateConfig, updates: CompiledUpdates | None, managed: int) -> Callable[[], None]:
    """A function running one update of copies of ``params`` (the group ``name``) in ``config``, managed ones on
    ``updates``' path as for a step managing ``managed`` elements."""
    dtype = torch.bfloat16 if config.master else torch.float32
    copies = [nn.Parameter(p.detach().to(dtype, copy=True)) for p in params]
    for source, target in zip(params, copies):
        grad = source.grad if source.grad is not None else torch.randn_like(source, dtype=torch.float32) * 1e-3
        target.grad = grad.detach().to(dtype, copy=True)
    if config.state is None:
        accepted = inspect.signature(type(optimizer).__init__).parameters  # not "initial_lr" an LR scheduler adds
        scratch = type(optimizer)(copies, **{k: v for k, v in hyper[id(params[0])].items() if k in accepted})
        for source, target in zip(params, copies):
            if source in optimizer.state:
                scratch.state[target] = copy.deepcopy(optimizer.state[source])
        return lambda: scratch.step()
    states: list[dict[str, Any]] = []
    for source in params:
        own = optimizer.state.get(source)
        states.append(copy.deepcopy(dict(own)) if own else {})
    precision = config.state
    rounds = config.master or precision is StatePrecision.BF16  # BF16 masters and moments round stochastically
    generator = torch.Generator(device=copies[0].device).manual_seed(0) if rounds else None
    settings = {id(source): AdamSettings.of(optimizer, hyper[id(source)]) for source in params}

    def run() -> None:
        with torch.no_grad():
            steps = [ManagedStep(target, target.grad, state, settings[id(source)], precision, config.master,
                                 f"{name}.{index}")
                     for index, (source, target, state) in enumerate(zip(params, copies, states))
                     if target.grad is not None]
            if updates is not None:
                updates.begin(managed, copies[0].device)
                steps = updates.step_many(steps)
            for one in steps:  # eagerly: what the plugin's path leaves to its eager step
                adam_step(one.p, one.grad, one.state, one.settings, precision, generator if config.master else None,
                          generator if precision is StatePrecision.BF16 else None)

    timed = run
    if config.master and config.fp32_copies:
        fp32_grads = [t.grad.float() for t in copies if t.grad is not None]  # what backward computes for a copy

        def with_copies() -> None:  # the casts of a training step of an FP32 operator holding bf16 parameters
            run()
            with torch.no_grad():
                for target in copies:
                    target.to(torch.float32)  # the forward's copy
                    target.to(torch.float32)  # backward's, cast again from the recipe
                for grad in fp32_grads:
                    grad.to(torch.bfloat16)  # the copy's gradient into the parameter's dtype

        timed = with_copies
    if updates is not None:
        timed()  # the state converted to its format
        timed()  # compiled (or the native library loaded)
    return timed
