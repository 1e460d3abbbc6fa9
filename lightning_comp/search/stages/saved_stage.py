"""The batch stage's second dimension: in which precision each operator stores what it saves for backward.

Runs for ``objective="memory"`` and ``objective="balanced"`` once the compute candidates are known. On top of the
candidate plan, the training step is profiled with every eligible operator saving as computed, ``bf16`` and
``fp8`` (interleaved rounds, as for compute precision): per operator, the bytes it saves and its time, pack and
unpack included. Operators that save the same tensor (a ReLU's output is the next Linear's saved input) are judged
as one group (:func:`sharing_groups`): only together do they free it. A saved lowering becomes a candidate when it
saves at least ``speed_margin`` of the bytes and the time stays within the objective's bound (:func:`judge_saved`);
of two that qualify the smaller wins. A lowering another operator would still hold as computed is dropped
(:func:`unshared_choices`: both forms would be held). The plan with every remaining lowering is then timed as a
whole step beside the candidate plan, and kept only if it is leaner (memory) or better in time x memory (balanced)
as a whole.

Saved lowerings join the compute candidates in the epoch stage's group testing as keys ``"saved:<operator>"``, in
execution order beside their operator, so a layer whose gradients suffer is isolated like any other candidate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_comp.numerics.saved_precision import SavedPrecision
from lightning_comp.operators.discovery import OperatorKind, classify
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.search.config import Objective, SearchConfig
from lightning_comp.search.decisions.comparison import StepComparison
from lightning_comp.search.measurement.clocks import Clock
from lightning_comp.search.measurement.estimates import RatioEstimate, Verdict, compare_to, paired_ratio
from lightning_comp.search.measurement.profiling import OperatorProfiler, ProfileResult, StepTimer
from lightning_comp.search.ranks import agree, reduce_mean, reduce_profile
from lightning_comp.search.record.progress import SearchProgress
from lightning_comp.search.stages.activation import activate

__all__ = ["SAVED_PREFIX", "SavedStage", "judge_saved", "merge_candidates", "saved_key", "sharing_groups",
           "split_group", "unshared_choices"]

SAVED_PREFIX = "saved:"


def saved_key(name: str) -> str:
    """The group-testing key of ``name``'s saved lowering."""
    return SAVED_PREFIX + name


def split_group(group: Sequence[str]) -> tuple[list[str], list[str]]:
    """The operators a group lowers in compute precision, and those whose saved tensors it lowers."""
    compute = [key for key in group if not key.startswith(SAVED_PREFIX)]
    saved = [key[len(SAVED_PREFIX):] for key in group if key.startswith(SAVED_PREFIX)]
    return compute, saved


def merge_candidates(order: Sequence[str], candidates: Sequence[str], choices: dict[str, str]) -> list[str]:
    """Compute candidates and saved lowerings in one list, in execution order, each saved key after its operator."""
    compute = set(candidates)
    out = [key for name in order
           for key in ((name,) if name in compute else ()) + ((saved_key(name),) if name in choices else ())]
    return out + [name for name in candidates if name not in out]  # forced candidates that did not run


def sharing_groups(names: Sequence[str], sharing: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """``names`` grouped by the tensors they save: connected through :attr:`ProfileResult.sharing`, in order."""
    position = {name: i for i, name in enumerate(names)}
    seen: set[str] = set()
    groups = []
    for name in names:
        if name in seen:
            continue
        group, todo = set(), [name]
        while todo:
            current = todo.pop()
            if current in group or current not in position:
                continue
            group.add(current)
            todo.extend(sharing.get(current, ()))
        seen |= group
        groups.append(tuple(sorted(group, key=position.__getitem__)))
    return groups


def _summed(result: ProfileResult, names: Sequence[str]) -> list[float]:
    """The per-round total time of ``names`` together."""
    series = [result.series(name) for name in names]
    return [sum(values) for values in zip(*series)]


def unshared_choices(choices: dict[str, str], sharing: dict[str, set[str]], forced: set[str]) -> dict[str, str]:
    """The lowerings in ``choices`` that cannot pay because another operator keeps the same tensor as computed.

    A tensor saved by two operators is held once; if one of them stores it compressed and the other as computed,
    both forms are held and nothing is saved. Such a lowering is dropped (unless forced), which may make others
    unshared in turn, so this repeats until nothing changes.

    Args:
        choices: operator -> saved precision chosen from its own measurement.
        sharing: operator -> the other operators that save one of its tensors (:attr:`ProfileResult.sharing`).
        forced: operators whose lowering ``include_saved`` forces (never dropped).

    Returns:
        operator -> why its lowering is dropped.
    """
    kept, dropped = dict(choices), {}
    changed = True
    while changed:
        changed = False
        for name in sorted(kept):
            holders = sorted(other for other in sharing.get(name, ()) if other not in kept)
            if holders and name not in forced:
                shown = ", ".join(holders[:3]) + (f" and {len(holders) - 3} more" if len(holders) > 3 else "")
                dropped[name] = (f"saves as computed: a tensor it saves is also saved by {shown}, which keep(s) it"
                                 " as computed, so both forms would be held")
                del kept[name]
                changed = True
    return dropped


def judge_saved(config: SearchConfig, base_bytes: int, options: dict[SavedPrecision, tuple[int, RatioEstimate]],
                ) -> dict[str, Any]:
    """One operator's saved precision from its measurements.

    Args:
        config: the search's settings (objective, margin, slowdown accepted for memory).
        base_bytes: bytes it saves as computed.
        options: per saved precision, the bytes it saves and its time relative to saving as computed.

    Returns:
        ``decision`` (``"fp32"``, ``"bf16"`` or ``"fp8"``), ``reason``, ``gain`` (bytes for memory, score gain for
        balanced) and per option its ``bytes`` and ``time_ratio``.
    """
    keep = 1 - config.speed_margin
    out: dict[str, Any] = {"bytes": {"fp32": int(base_bytes)}, "time_ratio": {}}
    reasons = []
    chosen: tuple[SavedPrecision, float, str] | None = None
    for saved, (nbytes, time) in sorted(options.items(), key=lambda item: item[1][0]):
        out["bytes"][saved.value] = int(nbytes)
        out["time_ratio"][saved.value] = [time.ratio, time.low, time.high]
        if chosen is not None:
            continue
        mem = nbytes / base_bytes if base_bytes > 0 else 1.0
        shown = f"{saved.value}: bytes x{mem:.2f}, time {time.describe()}"
        if mem > keep:
            reasons.append(f"{shown} saves too little")
            continue
        if config.objective is Objective.MEMORY:
            verdict = time.against(config.max_memory_slowdown)
            gain = float(base_bytes - nbytes)
        else:
            verdict = compare_to(math.sqrt(max(time.low, 0.0) * mem), math.sqrt(max(time.high, 0.0) * mem), keep)
            gain = 1.0 - math.sqrt(max(time.ratio, 0.0) * mem)
        if verdict is Verdict.BELOW:
            chosen = (saved, gain, shown)
        else:
            reasons.append(f"{shown} {'costs too much time' if verdict is Verdict.ABOVE else 'undecided in time'}")
    if chosen is None:
        why = "; ".join(reasons) or "saves nothing for backward"
        out.update(decision="fp32", reason=f"saves as computed: {why}", gain=0.0)
    else:
        out.update(decision=chosen[0].value, reason=f"pays: {chosen[2]}", gain=chosen[1])
    return out


class SavedStage:
    """Measures and decides the saved precision of each operator (see the module docstring).

    Args:
        config: the search's settings.
        plugin: the plugin that puts each measured plan into effect.
        progress: where measured rounds are shown.
    """

    def __init__(self, config: SearchConfig, plugin: CoMPPrecision, progress: SearchProgress | None = None) -> None:
        self.config = config
        self.plugin = plugin
        self.progress = progress

    def eligible(self, modules: dict[str, torch.nn.Module], order: list[str]) -> list[str]:
        """Operators whose saved precision may be lowered: all that ran, but shape-only and excluded ones."""
        excluded = self.config.excluded
        return [n for n in order if classify(modules[n]) is not OperatorKind.SHAPE
                and not excluded.matches(n, modules[n])]

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Callable[[], None], clock: Clock,
                base: PrecisionPlan, modules: dict[str, torch.nn.Module], order: list[str],
                decisions: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Measure, decide per operator (into ``decisions[name]["saved"]``), and check the plan as a whole step.

        Returns:
            ``choices`` (operator -> saved precision of the saved candidates), ``gains`` (per ``"saved:"`` key),
            and ``step`` (whole-step times, ratios and bytes of the check, with its ``verdict``).
        """
        config, plugin = self.config, self.plugin
        eligible = self.eligible(modules, order)
        # bf16 shrinks only what an operator computing in fp32 saves: not worth profiling when every one is lowered
        options = tuple(s for s in config.saved_options() if s is not SavedPrecision.BF16
                        or any(not base.precision_of(n, type(modules[n])).is_low for n in eligible))
        if not options:  # saved_precision="bf16" with every operator already computing in 16 bits
            return {"choices": {}, "gains": {}, "step": {}}
        plans = {"fp32": base, **{s.value: base.with_saved({n: s.value for n in eligible}) for s in options}}
        # Profiled as training steps run (calibrated cast boundaries, so a lowered operator's output stays low where
        # training keeps it low, and the tensors operators share are the ones training shares). A saved precision
        # does not move a cast boundary: one calibrating step of the base plan serves every configuration.
        with activate(plugin, base):
            step()
        configs: dict[str, Callable[[], Any]] = {
            label: functools.partial(activate, plugin, plan) for label, plan in plans.items()}
        profiler = OperatorProfiler(pl_module, clock, config.profile_steps, config.profile_warmup)
        if self.progress is not None:  # the bar counts rounds (each measures every configuration)
            self.progress.extend_stage(config.profile_warmup + config.profile_steps)
            profiler.on_round = functools.partial(self.progress.round_done, "saved precision, per operator")
        results = profiler.profile(configs, step)
        reduce_profile(trainer, results)
        included = config.included_saved
        choices: dict[str, str] = {}
        gains: dict[str, float] = {}
        ran = [n for n in eligible if n in results["fp32"].operators]
        for group in sharing_groups(ran, results["fp32"].sharing):
            # operators that save the same tensor are judged together: only together do they free it
            measured = {s: (sum(results[s.value].operators[n].own_saved_bytes for n in group),
                            paired_ratio(_summed(results["fp32"], group), _summed(results[s.value], group)))
                        for s in options if all(n in results[s.value].operators for n in group)}
            shared = judge_saved(config, sum(results["fp32"].operators[n].own_saved_bytes for n in group), measured)
            for name in group:
                entry = dict(shared, gain=shared["gain"] / len(group))
                if len(group) > 1:
                    entry.update(group=list(group), reason=f"{shared['reason']} (judged with {', '.join(group)}:"
                                                           " they save the same tensors)")
                if included.matches(name, modules[name]):
                    entry["forced"] = True
                    if entry["decision"] == "fp32":
                        smallest = options[0].value  # fp8 with saved_precision="auto"
                        entry.update(decision=smallest,
                                     reason=f"included by CoMPSearch(include_saved=...) at {smallest}")
                decisions.setdefault(name, {})["saved"] = entry
                if entry["decision"] != "fp32":
                    choices[name] = entry["decision"]
                    gains[saved_key(name)] = float(entry["gain"])
        forced = {n for n in choices if decisions[n]["saved"].get("forced")}
        for name, why in unshared_choices(choices, results["fp32"].sharing, forced).items():
            decisions[name]["saved"].update(decision="fp32", reason=why)
            del choices[name]
            gains.pop(saved_key(name))
        choices, gains = agree(trainer, (choices, gains))
        check = self.whole_step(trainer, pl_module, step, clock, base, choices) if choices else {}
        if check and check["verdict"] != "pays":
            for name in list(choices):
                entry = decisions[name]["saved"]
                if entry.get("forced"):
                    continue
                entry.update(decision="fp32", reason=f"saves as computed: {check['verdict']}")
                del choices[name]
                gains.pop(saved_key(name))
        return {"choices": choices, "gains": gains, "step": check}

    def whole_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Callable[[], None], clock: Clock,
                   base: PrecisionPlan, choices: dict[str, str]) -> dict[str, Any]:
        """Time the candidate plan with and without the saved lowerings as whole steps, and judge the difference."""
        config, plugin = self.config, self.plugin
        plans = {"fp32": PrecisionPlan(), "candidates": base, "saved": base.with_saved(choices)}
        configs: dict[str, Callable[[], Any]] = {
            label: functools.partial(activate, plugin, plan) for label, plan in plans.items()}
        timer = StepTimer(clock, config.profile_steps, config.profile_warmup)
        if self.progress is not None:
            self.progress.extend_stage(config.profile_warmup + config.profile_steps)
            timer.on_round = functools.partial(self.progress.round_done, "saved precision, whole steps")
        times = timer.time(configs, step)
        saved = {k: reduce_mean(trainer, float(v)) for k, v in timer.saved_bytes(pl_module, configs, step).items()}
        steps = StepComparison(times.ms)
        ratio = steps.ratio("saved", "fp32")
        keep = 1 - config.speed_margin
        mem = saved["saved"] / saved["candidates"] if saved["candidates"] > 0 else 1.0
        if config.objective is Objective.MEMORY:
            ok = mem <= keep and ratio.against(config.max_memory_slowdown) is Verdict.BELOW
            bound = f"leaner within x{config.max_memory_slowdown:g} of fp32's time"
        else:
            versus = steps.ratio("saved", "candidates")
            ok = compare_to(math.sqrt(max(versus.low, 0.0) * mem), math.sqrt(max(versus.high, 0.0) * mem),
                            keep) is Verdict.BELOW
            bound = f"better in time x memory than the candidates (step time {versus.describe()} of theirs)"
        shown = (f"saved bytes x{mem:.2f} of the candidates' ({saved['saved'] / 2**20:.1f} vs"
                 f" {saved['candidates'] / 2**20:.1f} MiB), step time {ratio.describe()} of fp32")
        verdict = agree(trainer, "pays" if ok else f"as a whole step not {bound}: {shown}")
        return {"verdict": verdict, "saved_bytes": saved, "step_ms": {k: min(v) for k, v in times.ms.items()},
                "step_ratios": steps.ratios(), "description": shown}
