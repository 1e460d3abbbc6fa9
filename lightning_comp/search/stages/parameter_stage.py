"""The batch stage's parameter dimensions: the precision of each operator's optimizer state and master weights.

Runs for ``objective="memory"`` and ``"balanced"`` after the compute and saved candidates are known, when the run
trains with one ``torch.optim.Adam``/``AdamW`` (other optimizers are left as they are, with the reason in the record).
Per operator that owns trainable parameters, the update of its parameters is timed in every format the settings
allow (:mod:`lightning_comp.search.measurement.optimizer_timing`) and judged against the whole step
(:mod:`lightning_comp.search.decisions.parameters`). The plan with every lowering that pays is then timed as whole
steps beside the plan without them (forward and backward measured, the updates added), and kept only if the
objective finds it better as a whole.

The lowerings join the epoch stage's group testing as candidates of the ``state`` and ``master`` dimensions, beside
their operator's other candidates, so an operator whose 8-bit state hurts convergence is isolated and keeps the
optimizer's own state.
"""

from __future__ import annotations

import statistics

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_comp.execution.adam_step import state_nbytes
from lightning_comp.execution.optimizer_states import state_bytes
from lightning_comp.execution.parameter_groups import parameter_owners
from lightning_comp.execution.update_path import CompiledUpdates
from lightning_comp.numerics.precision import ComputePrecision, MasterPrecision, StatePrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.decisions.batch_result import ParameterStageResult
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.parameters import (
    ParameterDecision,
    StepBudget,
    judge_lowering,
)
from lightning_comp.search.measurement.estimates import paired_ratio
from lightning_comp.search.measurement.optimizer_timing import UpdateConfig, UpdateVariant, time_updates
from lightning_comp.search.stages.context import StageContext

__all__ = ["ParameterStage"]

FP32, MASTER, MASTER_FP32_COPIES = UpdateVariant.FP32, UpdateVariant.MASTER, UpdateVariant.MASTER_FP32_COPIES
MIN_GROUP_PARAMS = 4096  # smaller groups hold too few bytes to be worth a candidate (and are not quantised)


class ParameterStage:
    """Measures and decides the optimizer-state and master-weight precision of each operator (module docstring).

    Args:
        ctx: the batch stage's run.
    """

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.config = ctx.config

    def skip_reason(self, trainer: pl.Trainer, base: PrecisionPlan) -> str | None:
        """Why the stage does not run here (``None``: it runs)."""
        config = self.config
        if not config.tried(Dimension.STATE) and not config.tried(Dimension.MASTER):
            return "precisions={'state': 'off', 'master': 'off'}"
        optimizers = trainer.optimizers
        if len(optimizers) != 1 or not isinstance(optimizers[0], (torch.optim.Adam, torch.optim.AdamW)):
            kinds = ", ".join(type(o).__qualname__ for o in optimizers) or "none"
            return (f"the run's optimizers ({kinds}) are not a single torch.optim.Adam/AdamW, whose state and master"
                    " precisions the plugin can step")
        if base.uses(ComputePrecision.FP16) or self.ctx.low is ComputePrecision.FP16:
            return "fp16 plans are loss-scaled, which state and master precisions do not combine with yet"
        if self.ctx.plugin.compiled:
            return "the model is compiled"
        if "FSDP" in type(trainer.strategy).__name__ or "ModelParallel" in type(trainer.strategy).__name__:
            return f"{type(trainer.strategy).__name__} shards the parameters and their optimizer state"
        return None

    @staticmethod
    def _masters_allowed(trainer: pl.Trainer) -> bool:
        """bf16 masters change parameter dtypes, which DDP's gradient buckets (built once) do not follow."""
        return trainer.world_size == 1

    def measure(self, base: PrecisionPlan, decisions: dict[str, OperatorDecision], fp32_ms: float,
                candidates_ms: float, saved_bytes: float, bound_ms: float | None = None) -> ParameterStageResult:
        """Measure and decide per operator (into each ``decisions[name].parameters``); what is taken is decided with
        the other memory levers (:mod:`lightning_comp.search.stages.memory_stage`).

        Args:
            base: the candidate plan, with its saved lowerings.
            decisions: the operators' decisions so far.
            fp32_ms: the FP32 plan's whole step (forward and backward).
            candidates_ms: the candidate plan's whole step (the FP32 plan's when there are no candidates).
            saved_bytes: bytes the candidate plan saves for backward.
            bound_ms: the forward and backward the slowdown bound is a multiple of
                (:func:`~lightning_comp.search.stages.memory_stage.bound_step`; ``None``: the pace's).
        """
        ctx = self.ctx
        trainer, pl_module = ctx.trainer, ctx.pl_module
        why = ctx.agree(self.skip_reason(trainer, base))
        if why is not None:
            return ParameterStageResult(skipped=why)
        optimizer = trainer.optimizers[0]
        groups = self._groups(pl_module, decisions)
        if not groups:
            return ParameterStageResult(skipped=f"no operator owns {MIN_GROUP_PARAMS} trainable parameters or more")
        configs: dict[UpdateVariant, UpdateConfig] = {FP32: UpdateConfig(None)}
        configs.update({UpdateVariant.of(s): UpdateConfig(s) for s in self.config.tried(Dimension.STATE)})
        types = {o.owner: o.owner_type for o in parameter_owners(pl_module)}
        variants: dict[str, set[UpdateVariant]] = {}
        if self.config.tried(Dimension.MASTER) and self._masters_allowed(trainer):
            tried = self.config.tried(Dimension.STATE)
            state = tried[-1] if tried else StatePrecision.FP32
            configs[MASTER] = UpdateConfig(state, master=True)
            configs[MASTER_FP32_COPIES] = UpdateConfig(state, master=True, fp32_copies=True)
            for name in groups:  # an operator computing in FP32 would compute with FP32 copies of bf16 parameters
                fp32 = base.of(Dimension.COMPUTE, name, types.get(name)) is ComputePrecision.FP32
                variants[name] = set(configs) - {MASTER if fp32 else MASTER_FP32_COPIES}
        rounds, warmup = self.config.measurement.profile_steps, self.config.measurement.profile_warmup
        times = time_updates(optimizer, groups, configs, ctx.clock, rounds, warmup,
                             CompiledUpdates(ctx.plugin.update_path), variants)
        times = ctx.agree({g: {k: [ctx.reduce_mean(v) for v in vs] for k, vs in s.items()} for g, s in times.items()})
        fp32_update = sum(statistics.median(s[FP32]) for s in times.values())
        # the fastest fixed policy's forward and backward (or the base's, where the rounds could not tell them apart)
        pace_ms = fp32_ms * ctx.policy.pace.ratio_to_fp32 if bound_ms is None else bound_ms
        budget = StepBudget(step_ms=candidates_ms + fp32_update, pace_step_ms=pace_ms + fp32_update,
                            step_bytes=_persistent_bytes(pl_module, optimizer) + saved_bytes)
        result = ParameterStageResult()
        for name, params in groups.items():
            decision = self._decide(name, types.get(name), params, optimizer, base, times[name], budget)
            decisions[name].parameters = decision
            if decision.lowers:
                result.gains[name] = decision.gain_bytes
            if decision.state.managed:
                result.state_choices[name] = decision.state
                result.benefits[Candidate.state(name)] = decision.state_benefit
            if decision.master.managed:
                result.master_choices[name] = decision.master
                result.benefits[Candidate.master(name)] = decision.master_benefit
        return result

    def _groups(self, pl_module: nn.Module, decisions: dict[str, OperatorDecision]) -> dict[str, list[nn.Parameter]]:
        """Operator -> its trainable parameters, for operators with at least :data:`MIN_GROUP_PARAMS` of them that the
        search may change (not excluded)."""
        groups: dict[str, list[nn.Parameter]] = {}
        for owned in parameter_owners(pl_module):
            if owned.owner is None or owned.owner not in decisions or not owned.parameter.requires_grad:
                continue
            if decisions[owned.owner].excluded or owned.parameter.dtype != torch.float32:
                continue
            groups.setdefault(owned.owner, []).append(owned.parameter)
        return {name: params for name, params in groups.items() if sum(p.numel() for p in params) >= MIN_GROUP_PARAMS}

    def _decide(self, name: str, module_type: type | None, params: list[nn.Parameter],
                optimizer: torch.optim.Optimizer, base: PrecisionPlan, times: dict[UpdateVariant, list[float]],
                budget: StepBudget) -> ParameterDecision:
        """One operator's state and master precision from its measurements."""
        amsgrad = any(group.get("amsgrad", False) for group in optimizer.param_groups)
        numel = sum(p.numel() for p in params)
        fp32_ms = statistics.median(times[FP32])
        decision = ParameterDecision(params=numel, tensors=len(params),
                                     update_ms={k: statistics.median(v) for k, v in times.items()})
        own_state = sum(state_nbytes(p, StatePrecision.FP32, amsgrad) for p in params)
        decision.bytes[FP32] = own_state
        reasons = []
        for option in self.config.tried(Dimension.STATE):  # smallest first
            variant = UpdateVariant.of(option)
            lowered = sum(state_nbytes(p, option, amsgrad) for p in params)
            time = paired_ratio(times[FP32], times[variant])
            decision.bytes[variant] = lowered
            decision.time_ratios[variant] = [time.ratio, time.low, time.high]
            if decision.state.managed:
                continue
            ok, why, benefit = judge_lowering(self.config, budget, own_state, lowered, fp32_ms, time)
            if ok:
                decision.state, decision.state_benefit, decision.gain_bytes = option, benefit, own_state - lowered
                reasons.append(f"state {option.value} pays: {why}")
            else:
                reasons.append(f"state {option.value}: {why}")
        master = MASTER_FP32_COPIES if MASTER_FP32_COPIES in times else MASTER
        if master in times:
            weights = 2 * sum(p.numel() * p.element_size() for p in params)  # the parameters and their gradients
            lowered = weights // 2
            decision.bytes[master] = lowered
            time = paired_ratio(times[FP32], times[master])
            decision.time_ratios[master] = [time.ratio, time.low, time.high]
            compute = base.of(Dimension.COMPUTE, name, module_type)
            copies = " (computing in fp32 with fp32 copies of them)" if master is MASTER_FP32_COPIES else ""
            if compute not in (ComputePrecision.BF16, ComputePrecision.FP32):
                reasons.append(f"master bf16: the operator computes in {compute.value} in the candidate plan")
            else:
                ok, why, benefit = judge_lowering(self.config, budget, weights, lowered, fp32_ms, time)
                forced = self.config.included(Dimension.MASTER).matches(name, module_type)
                if ok or forced:
                    decision.master, decision.master_benefit = MasterPrecision.BF16, benefit if ok else 0.0
                    decision.gain_bytes += weights - lowered
                    decision.forced = decision.forced or (forced and not ok)
                    reasons.append(f"master bf16{copies} pays: {why}" if ok else
                                   f"master bf16{copies}: included by CoMPSearch(include_dimensions={{'master': ...}})"
                                   f" ({why})")
                else:
                    reasons.append(f"master bf16{copies}: {why}")
        if self.config.included(Dimension.STATE).matches(name, module_type) and self.config.tried(Dimension.STATE):
            decision.forced = True
            if not decision.state.managed:
                smallest = self.config.tried(Dimension.STATE)[0]
                decision.state = smallest
                decision.gain_bytes += own_state - decision.bytes[UpdateVariant.of(smallest)]
                reasons.append(f"state {smallest.value}: included by CoMPSearch(include_dimensions={{'state': ...}})")
        decision.reason = "; ".join(reasons)
        return decision


def _persistent_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Bytes of the trainable parameters, their gradients (one per parameter) and the optimizer's state."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return float(2 * weights + state_bytes(optimizer))
