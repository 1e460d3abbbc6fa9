"""The batch stage's third compute level: which of the Linears it lowers to bf16 compute in fp8 instead.

Runs where fp8 is searched (``CoMPSearch(fp8=...)``: by default where the device has native fp8 matmuls) once the
compute candidates are decided. On top of the candidate plan, the training step is profiled with every eligible
compute candidate (a Linear fp8 kernels take, or a group of such Linears playing the same part in repeated blocks) in
bf16 and in fp8, interleaved, at the plan's own cast boundaries: each candidate's forward and backward time includes
its dynamic scaling and its casts to and from float8 (:mod:`lightning_comp.execution.float8_calls`). A candidate that
is faster in fp8 by the speed margin beyond doubt (:mod:`lightning_comp.search.decisions.fp8`) becomes an fp8
candidate; the plan with every one of them is then timed as a whole step against the plan without, and where it is
not faster as a whole none is kept (but those ``include_fp8`` forces).

fp8 candidates join the epoch stage's group testing as a lever of their own
(:class:`~lightning_comp.search.candidates.Candidate` with ``fp8``): a failing group splits them apart from the
16-bit lowerings, so an operator whose fp8 breaks convergence is demoted to bf16, not to FP32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_comp.devices.device_classes import model_device
from lightning_comp.devices.lowering import fp8_refusal
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.plan.selectors import Selectors
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.decisions.batch_result import Fp8StageResult
from lightning_comp.search.decisions.fp8 import judge_fp8
from lightning_comp.search.decisions.groups import OperatorGroup
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.trialled import members_of
from lightning_comp.search.measurement.estimates import paired_ratio
from lightning_comp.search.measurement.profiling import OperatorProfiler, ProfileResult
from lightning_comp.search.measurement.step_timing import StepTimer
from lightning_comp.search.ranks import reduce_profile
from lightning_comp.search.stages.context import StageContext

__all__ = ["Fp8Stage"]

LOW, FP8 = "low", "fp8"


class Fp8Stage:
    """Measures and decides which compute candidates compute in fp8 (see the module docstring).

    Args:
        ctx: the batch stage's run.
        precision: the fp8 precision searched (its recipe).
    """

    def __init__(self, ctx: StageContext, precision: ComputePrecision) -> None:
        self.ctx = ctx
        self.precision = precision

    def eligible(self, compute: Sequence[Candidate], groups: Sequence[OperatorGroup]) -> dict[str, tuple[str, ...]]:
        """The compute candidates fp8 can serve (every member a Linear fp8 kernels take on the device, none
        excluded), and the Linears ``include_fp8`` names that no candidate lowers: candidate -> its members."""
        modules, config = self.ctx.modules, self.ctx.config
        device = model_device(self.ctx.pl_module)
        excluded, forced = config.excluded, Selectors.of(config.include_fp8)

        def serves(name: str) -> bool:
            module = modules.get(name)
            return module is not None and fp8_refusal(module, device) is None and not excluded.matches(name, module)

        out: dict[str, tuple[str, ...]] = {}
        for candidate in compute:
            members = tuple(members_of(candidate, list(groups)))
            if members and all(serves(m) for m in members):
                out[candidate.operator] = members
        lowered = {m for members in out.values() for m in members}
        for name, module in modules.items():
            if name not in lowered and forced.matches(name, module) and serves(name):
                out[name] = (name,)
        return out

    def measure(self, base: PrecisionPlan, compute: Sequence[Candidate], groups: Sequence[OperatorGroup],
                decisions: dict[str, OperatorDecision]) -> Fp8StageResult:
        """Measure on top of the candidate plan ``base`` and decide per candidate (into each member's
        ``decisions[name].fp8``)."""
        ctx = self.ctx
        result = Fp8StageResult(precision=self.precision)
        eligible = self.eligible(compute, groups)
        if not eligible:
            result.skipped = ("no compute candidate is a Linear fp8 kernels take (in and out features multiples of"
                              " 16)")
            return result
        with_fp8 = base.with_assignment(Dimension.COMPUTE, dict.fromkeys(eligible, self.precision.value))
        results = self._profile({LOW: base, FP8: with_fp8})
        forced = Selectors.of(ctx.config.include_fp8)
        for name, members in eligible.items():
            if not all(m in results[LOW].operators and m in results[FP8].operators for m in members):
                continue  # (did not run on this batch)
            low_ms = sum(results[LOW].operators[m].total_ms for m in members)
            fp8_ms = sum(results[FP8].operators[m].total_ms for m in members)
            time = paired_ratio(results[LOW].summed_series(members), results[FP8].summed_series(members))
            decision = judge_fp8(ctx.config, self.precision, ctx.low, time, low_ms, fp8_ms)
            if any(forced.matches(m, ctx.modules[m]) for m in members):
                decision.forced = True
                if not decision.lowers:
                    decision.lowers = True
                    decision.reason = f"included by CoMPSearch(include_fp8=...): {decision.reason}"
            decision.group = members if len(members) > 1 else ()
            for member in members:
                decisions[member].fp8 = decision
            if decision.lowers:
                result.choices[name] = self.precision
                result.benefits[Candidate.in_fp8(name)] = decision.gain_ms
        self._check_whole_step(base, eligible, decisions, result)
        result.choices, result.benefits = ctx.agree((result.choices, result.benefits))
        return result

    def _profile(self, plans: dict[str, PrecisionPlan]) -> dict[str, ProfileResult]:
        """Every operator's time under each plan at its training cast boundaries, interleaved; averaged over ranks."""
        ctx = self.ctx
        measurement = ctx.config.measurement
        for plan in plans.values():  # each plan's calibrating step (it traces, slower than a step): never measured
            with ctx.plugin.measured_step(plan):
                ctx.step()
        configs: dict[str, Callable[[], Any]] = {label: ctx.measured(plan) for label, plan in plans.items()}
        profiler = OperatorProfiler(ctx.pl_module, ctx.clock, measurement.profile_steps, measurement.profile_warmup)
        profiler.on_round = ctx.show_rounds(ctx.first_rounds, f"{self.precision.value}/{ctx.low.value}, per operator")
        results = profiler.profile(configs, ctx.step)
        reduce_profile(ctx.trainer, results)
        return results

    def _check_whole_step(self, base: PrecisionPlan, eligible: dict[str, tuple[str, ...]],
                          decisions: dict[str, OperatorDecision], result: Fp8StageResult) -> None:
        """Time the plan with every fp8 candidate whole against ``base``; where it is not faster, keep only the
        forced ones."""
        if not result.choices:
            return
        ctx = self.ctx
        measurement = ctx.config.measurement
        chosen = base.with_assignment(Dimension.COMPUTE, {n: p.value for n, p in result.choices.items()})
        timer = StepTimer(ctx.clock, measurement.profile_steps, measurement.profile_warmup)
        timer.on_round = ctx.show_rounds(0, f"whole steps, {self.precision.value} candidates")
        times = timer.time({LOW: ctx.measured(base), FP8: ctx.measured(chosen)}, ctx.step, rounds=1)
        if measurement.profile_steps > 1:
            timer.time({LOW: ctx.measured(base), FP8: ctx.measured(chosen)}, ctx.step, into=times,
                       rounds=measurement.profile_steps - 1, warmup=0)
        low = [ctx.reduce_mean(ms) for ms in times.ms[LOW]]
        fp8 = [ctx.reduce_mean(ms) for ms in times.ms[FP8]]
        ratio = ctx.agree(paired_ratio(low, fp8))
        if ratio.ratio < 1.0:
            return
        why = (f"the plan with every {self.precision.value} candidate is not faster as a whole step (step time"
               f" {ratio.describe()} of the plan without)")
        for name, members in eligible.items():
            decision = decisions[members[0]].fp8
            if name in result.choices and decision is not None and not decision.forced:
                decision.drop(why)
                del result.choices[name]
                result.benefits.pop(Candidate.in_fp8(name), None)
