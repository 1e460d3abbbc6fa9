"""How much of a step's floating-point work a plan leaves in FP32 where no plan entry decided it: a warning.

A trace of the first step (:mod:`lightning_comp.operators.owned_work`) counts the forward's matmul, convolution and
attention operations by the module that runs them. Two kinds of that work stay FP32 without anyone having chosen so:

- work **outside every operator**: code in ``training_step`` or a loss that computes between modules, which no plan
  can lower (move it into a module, or accept it in FP32);
- work of ``FUNCTIONAL`` operators (containers computing between their children, found by tracing: attention
  products, einsums) that only the plan's **default** leaves in FP32, while the plan lowers others: a plan that
  lowers ``type:Linear`` and nothing else leaves every attention product in FP32. (A leaf operator left to the
  default is in plain sight in the model's modules; these are not.)

:func:`unplanned_work` measures both; when together they exceed :data:`UNPLANNED_SHARE` of the step's counted work,
:meth:`UnplannedWork.message` says which modules hold it and how to plan them. A plan made by a search decides every
operator on purpose, so only the first kind is reported for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_comp.execution.executor import PlanExecutor
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.operators.kinds import OperatorKind, classify
from lightning_comp.operators.owned_work import OUTSIDE, StepWork
from lightning_comp.plan.plan import PrecisionPlan

__all__ = ["UNPLANNED_SHARE", "UnplannedWork", "UnplannedWorkWarnings", "unplanned_work"]

#: The share of a step's counted floating-point work left in FP32 unplanned above which a warning is given.
UNPLANNED_SHARE = 0.05


@dataclass(frozen=True)
class UnplannedWork:
    """The work a plan leaves in FP32 where no plan entry decided it.

    Attributes:
        total_flops: the step's counted forward floating-point operations.
        outside: ``(module, flops)`` of work outside every operator (:data:`OUTSIDE`: outside every module).
        by_default: ``(operator, class name, flops)`` of ``FUNCTIONAL`` operators only the plan's default leaves in
            FP32.
    """

    total_flops: int
    outside: tuple[tuple[str, int], ...] = ()
    by_default: tuple[tuple[str, str, int], ...] = ()

    @property
    def share(self) -> float:
        """Their share of the step's counted work (0 when nothing was counted)."""
        if not self.total_flops:
            return 0.0
        flops = sum(f for _, f in self.outside) + sum(f for _, _, f in self.by_default)
        return flops / self.total_flops

    def message(self, limit: int = 6) -> str:
        """The warning's text: the share, each module holding such work with its own share, and what to do."""
        def pct(flops: int) -> str:
            return f"{100 * flops / self.total_flops:.0f}%"

        parts = []
        if self.by_default:
            shown = sorted(self.by_default, key=lambda r: -r[2])
            names = ", ".join(f"{n or '<root>'} ({t}, {pct(f)})" for n, t, f in shown[:limit])
            more = f", ... ({len(shown)} in all)" if len(shown) > limit else ""
            types = sorted({t for _, t, _ in shown})
            parts.append(
                f"in modules computing between their children (found by tracing) that only the plan's default leaves"
                f" in fp32: {names}{more}. Plan them by name or type"
                f" (e.g. {{'type:{types[0]}': 'bf16'}}), or assign them 'fp32' explicitly to keep them so"
            )
        if self.outside:
            shown_out = sorted(self.outside, key=lambda r: -r[1])
            names = ", ".join(f"{'code outside every module (training_step, the loss)' if n == OUTSIDE else n}"
                              f" ({pct(f)})" for n, f in shown_out[:limit])
            parts.append(f"outside every operator, where no plan reaches: {names}. Compute it inside a module's"
                         " forward to make it plannable")
        return (f"{100 * self.share:.0f}% of the step's matmul/convolution/attention work (counted in the first"
                f" step's forward) stays in fp32 although the plan lowers other operators: {'; '.join(parts)}.")


def unplanned_work(work: StepWork, plan: PrecisionPlan, model: nn.Module, precisions: Mapping[str, ComputePrecision], *,
                   by_default: bool) -> UnplannedWork:
    """What of ``work`` the plan in force leaves in FP32 unplanned.

    Args:
        work: the traced step's work, by owning module.
        plan: the plan in force.
        model: the model (its operators now, found-by-tracing ones included).
        precisions: each operator's effective precision (FP32 where a low one cannot apply).
        by_default: report ``FUNCTIONAL`` operators the plan's default leaves in FP32 (a user's plan; not a
            search's).
    """
    operators = dict(iter_operators(model))
    explained = plan.explain(model) if by_default else {}
    outside: dict[str, int] = {}
    defaulted: list[tuple[str, str, int]] = []
    for owner, owned in work.by_module.items():
        if not owned.flops:
            continue
        operator = owner if owner in operators else _covering(owner, operators)
        if operator is None:
            outside[owner] = outside.get(owner, 0) + owned.flops
            continue
        if precisions.get(operator, ComputePrecision.FP32).is_low:
            continue
        if by_default and explained.get(operator) == "<default>" and classify(operators[operator]) is \
                OperatorKind.FUNCTIONAL:
            defaulted.append((operator, type(operators[operator]).__name__, owned.flops))
    merged: dict[str, tuple[str, int]] = {}
    for name, type_name, flops in defaulted:  # atomic operators' children: one row per operator
        merged[name] = (type_name, merged.get(name, (type_name, 0))[1] + flops)
    return UnplannedWork(work.total_flops, tuple(sorted(outside.items())),
                         tuple((n, t, f) for n, (t, f) in sorted(merged.items())))


def _covering(module: str, operators: Mapping[str, nn.Module]) -> str | None:
    """The operator whose module holds ``module`` (an atomic operator's inside), if any."""
    if module == OUTSIDE:
        return None
    best = None
    for name in operators:
        if (not name or module.startswith(name + ".")) and (best is None or len(name) > len(best)):
            best = name
    return best


class UnplannedWorkWarnings:
    """A plugin's warnings about unplanned work: once per plan (and traced work), never for a search's trials."""

    def __init__(self) -> None:
        self._seen: set[tuple[object, ...]] = set()

    def check(self, executor: PlanExecutor, users_own: bool, owner: str) -> UnplannedWork | None:
        """Look at the plan ``executor`` has in force, once it has traced the model's work; warn (prefixed with
        ``owner``) when its unplanned share exceeds :data:`UNPLANNED_SHARE`. Returns the report, if one was made.

        Args:
            executor: the plugin's executor.
            users_own: the plan is the user's own (``FUNCTIONAL`` operators the default leaves in FP32 are reported);
                else a search's or a checkpoint's plan (only work outside every operator is).
            owner: the plugin's name, for the message.
        """
        work, plan, model = executor.work, executor.plan, executor.model
        if work is None or plan is None or model is None or plan.is_all_fp32:
            return None
        key = (plan.assignments, users_own, tuple(sorted(work.by_module)))
        if key in self._seen:
            return None
        self._seen.add(key)
        report = unplanned_work(work, plan, model, executor.precisions(), by_default=users_own)
        if report.share > UNPLANNED_SHARE:
            rank_zero_warn(f"{owner}: {report.message()}", stacklevel=5)
        return report
