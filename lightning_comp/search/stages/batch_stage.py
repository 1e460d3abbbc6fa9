"""The batch stage: which operators are worth a convergence trial, measured on one batch of the user's training.

At the first batch of the search, the training step is run repeatedly on that batch, in FP32 and with every
operator lowered, to measure each operator's forward and backward time and the bytes it saves for backward.
Operators whose low-precision cost (casts included) does not beat FP32 by the margin stay FP32 and are never
trialled. Cheap operators (norms, activations) between two lowered operators are lowered too when that costs no
time, so activations stay low across the run. The candidate plan is then timed as a whole step beside the all-low
and the compute-only plans (:mod:`lightning_comp.search.decisions.comparison` decides); if nothing beats FP32, the
search ends.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_comp.devices.device_class import model_device
from lightning_comp.errors import SearchConfigError
from lightning_comp.numerics.precision import Precision
from lightning_comp.operators.discovery import Lowering, OperatorKind, classify, iter_operators, lowering_for
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.search.config import Objective, SearchConfig, Timing
from lightning_comp.search.decisions.comparison import StepComparison, judge_operator, plan_pays, whole_step_winner
from lightning_comp.search.measurement.clock_choice import TimingChoice, choose_timing, cpu_clock, is_busy, sample_load
from lightning_comp.search.measurement.clocks import ClockKind, single_intra_op_thread
from lightning_comp.search.measurement.estimates import Verdict, paired_ratio
from lightning_comp.search.measurement.machine_load import LoadMeter
from lightning_comp.search.measurement.profiling import OperatorProfiler, ProfileResult, StepTimer
from lightning_comp.search.ranks import agree, reduce_mean, reduce_profile
from lightning_comp.search.record.progress import SearchProgress
from lightning_comp.search.rewind.snapshot import capture_rng, restore_rng
from lightning_comp.search.stages.activation import activate, with_weight_recording
from lightning_comp.search.stages.saved_stage import SavedStage, merge_candidates
from lightning_comp.search.stages.trials import plan_for

__all__ = ["BatchStage", "cheap_runs"]

_HEAVY_KINDS = (OperatorKind.COMPUTE, OperatorKind.EMBEDDING, OperatorKind.OTHER)


class BatchStage:
    """Measures the operators of a model on one batch and decides the candidates of the epoch stage.

    Args:
        config: the search's settings.
        low: the 16-bit precision searched.
        plugin: the plugin that puts each measured plan into effect.
        progress: where measured rounds are shown (nothing is shown without it).
    """

    def __init__(self, config: SearchConfig, low: Precision, plugin: CoMPPrecision,
                 progress: SearchProgress | None = None) -> None:
        self.config = config
        self.low = low
        self.plugin = plugin
        self.progress = progress

    def run(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
            restore: Callable[[], None]) -> dict[str, Any]:
        """Measure and decide; ``restore`` puts the run's state back afterwards (the stage trains nothing).

        Returns:
            Rank 0's ``decisions`` per operator, ``candidates`` (``"saved:<name>"`` for a saved-precision
            lowering, whose precision ``saved`` gives), their ``gains``, whole-step ``step_ms`` (and
            ``step_wall_ms``, ``step_ratios``, ``step_saved_bytes``), cheap-operator ``runs``, the execution
            ``order``, ``memory`` per configuration, and the ``timing`` it measured with.
        """
        plugin, config = self.plugin, self.config
        device = model_device(pl_module)
        rng = capture_rng()
        step = TrainingStepRunner(pl_module, batch, batch_idx)
        try:
            plugin._set_search_plan(PrecisionPlan())
            timing = agree(trainer, choose_timing(config.timing, device.type, lambda: sample_load(step)))
            meter = LoadMeter()
            meter.start()
            payload = self.measure(trainer, pl_module, step, timing)
            load = meter.stop()
            if config.timing is Timing.AUTO and timing.clock is ClockKind.WALL and agree(trainer, is_busy(load)):
                timing = cpu_clock("this process's CPU time with one intra-op thread: the machine became busy during"
                                   f" the wall-time measurement ({load.describe()}), which was repeated", load)
                payload = self.measure(trainer, pl_module, step, timing)
        finally:
            if self.progress is not None:
                self.progress.close_stage()
            restore()
            restore_rng(rng)
            plugin._set_search_plan(PrecisionPlan().with_provenance(role="trial", trial="fp32 reference"))
        payload["timing"] = timing.to_dict()
        return agree(trainer, payload)

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Callable[[], None],
                timing: TimingChoice) -> dict[str, Any]:
        """Per-operator and whole-step measurements with ``timing``'s clock, and the decisions they give."""
        plugin, low, config = self.plugin, self.low, self.config
        device = model_device(pl_module)
        modules = dict(iter_operators(pl_module))
        lowerable = [n for n, m in modules.items() if lowering_for(m, low, device) not in (None, Lowering.NONE)]
        all_low = PrecisionPlan.from_dict({n: low.value for n in lowerable})
        clock = timing.make_clock()
        progress = self.progress
        first = config.profile_warmup + config.profile_steps
        if progress is not None:  # per-operator rounds, then whole-step rounds
            progress.start_stage(len(lowerable), 2 * first)
        with single_intra_op_thread(timing.single_thread):
            profiler = OperatorProfiler(pl_module, clock, config.profile_steps, config.profile_warmup)
            if progress is not None:
                profiler.on_round = functools.partial(progress.round_done, f"per operator, fp32/{low.value}")
            # weight copies saved as recipes, as in training (recast_weights_in_backward): not counted as saved bytes
            configs: dict[str, Callable[[], Any]] = {
                "fp32": functools.partial(with_weight_recording, plugin, PrecisionPlan()),
                "low": functools.partial(with_weight_recording, plugin, all_low)}
            started = time.perf_counter()
            results = profiler.profile(configs, step)
            budget = ExtraRounds(config, time.perf_counter() - started, config.profile_warmup + config.profile_steps)
            while True:  # more rounds while an operator's comparison is undecided, within the budget
                undecided = any(d.get("settled") is False for d in self.select(modules, lowerable, results)[0].values())
                more = agree(trainer, budget.next_rounds() if undecided else 0)
                if not more:
                    break
                if progress is not None:
                    progress.extend_stage(more)
                with budget.spending():
                    profiler.extend(results, configs, step, more)
            reduce_profile(trainer, results)
            # every rank must time the same whole-step plans (each timing is a collective): rank 0's decisions
            decisions, runs = agree(trainer, self.select(modules, lowerable, results))
            order = results["fp32"].order
            candidates = tuple(n for n in order if decisions.get(n, {}).get("decision") == "candidate")
            alternatives = self.alternatives(modules, lowerable, order, decisions, candidates, runs)
            plans = dict(alternatives)
            if candidates:
                plans = {"candidates": plan_for(low, runs, candidates), **plans}
            step_configs: dict[str, Any] = {"fp32": lambda: plugin._set_search_plan(PrecisionPlan())}
            for label, plan in plans.items():
                step_configs[label] = functools.partial(activate, plugin, plan)
            timer = StepTimer(clock, config.profile_steps, config.profile_warmup)
            if progress is not None:
                timer.on_round = functools.partial(progress.round_done, f"whole steps, {len(step_configs)} plans")
            started = time.perf_counter()
            times = timer.time(step_configs, step)
            budget = ExtraRounds(config, time.perf_counter() - started, config.profile_warmup + config.profile_steps)
            while True:
                steps = StepComparison(times.ms)
                more = agree(trainer, budget.next_rounds() if self.whole_step_undecided(steps, list(plans)) else 0)
                if not more:
                    break
                if progress is not None:
                    progress.extend_stage(more)
                with budget.spending():
                    timer.time(step_configs, step, into=times, rounds=more, warmup=0)
            step_saved: dict[str, float] = {}
            if config.objective is not Objective.THROUGHPUT:
                saved = timer.saved_bytes(pl_module, step_configs, step)
                step_saved = {k: reduce_mean(trainer, float(v)) for k, v in saved.items()}
        step_ms = {k: reduce_mean(trainer, min(v)) for k, v in times.ms.items()}
        winner = agree(trainer, whole_step_winner(config, steps, step_saved, list(alternatives), bool(candidates)))
        if winner is not None:
            candidates, runs = self.adopt(winner, alternatives[winner], order, decisions, step_ms, step_saved)
        elif candidates:
            verdict = agree(trainer, plan_pays(config, steps))
            if verdict is not Verdict.BELOW:
                ratio = steps.ratio("candidates", "fp32").describe()
                why = ("cannot be told apart from fp32 as a whole step" if verdict is Verdict.UNDECIDED
                       else "candidate plan as a whole not better than fp32")
                for name in candidates:
                    if not decisions[name].get("forced"):
                        decisions[name]["decision"] = "fp32"
                        decisions[name]["reason"] = f"{why} (step time {ratio})"
                candidates = tuple(n for n in candidates if decisions[n].get("forced"))
        memory = {label: {"saved_bytes": r.saved_bytes, "peak_bytes": r.peak_bytes} for label, r in results.items()}
        gains = {n: decisions[n]["gain_ms"] for n in candidates}
        lowered_saved: dict[str, Any] = {"choices": {}, "gains": {}, "step": {}}
        if config.saved_options() and not plugin.compiled:  # compiled graphs: AOTAutograd decides what is saved
            base = plan_for(low, runs, candidates) if candidates else PrecisionPlan()
            with single_intra_op_thread(timing.single_thread):
                lowered_saved = SavedStage(config, plugin, progress).measure(
                    trainer, pl_module, step, clock, base, modules, order, decisions)
            candidates = tuple(merge_candidates(order, candidates, lowered_saved["choices"]))
            gains.update(lowered_saved["gains"])
        return {"decisions": decisions, "candidates": list(candidates), "saved": lowered_saved["choices"],
                "saved_step": lowered_saved["step"], "gains": gains, "step_ms": step_ms,
                "step_wall_ms": {k: reduce_mean(trainer, min(v)) for k, v in times.wall_ms.items()},
                "step_ratios": steps.ratios(), "step_saved_bytes": step_saved, "runs": runs, "order": order,
                "memory": memory}

    def whole_step_undecided(self, steps: StepComparison, labels: list[str]) -> bool:
        """Whether a whole-step comparison that decides something could not tell its plans apart."""
        margin = self.config.speed_margin
        if self.config.objective is Objective.THROUGHPUT:
            pairs = [(label, "fp32") for label in labels]
            pairs += [(label, "candidates") for label in labels if label != "candidates" and "candidates" in labels]
            return any(steps.faster(a, b, margin) is Verdict.UNDECIDED for a, b in pairs)
        limit = self.config.max_memory_slowdown if self.config.objective is Objective.MEMORY else 1 - margin
        return any(steps.ratio(label, "fp32").against(limit) is Verdict.UNDECIDED for label in labels)

    def alternatives(self, modules: dict[str, torch.nn.Module], lowerable: list[str], order: list[str],
                     decisions: dict[str, dict[str, Any]], candidates: tuple[str, ...],
                     runs: list[dict[str, Any]]) -> dict[str, PrecisionPlan]:
        """Whole-step alternatives to the per-operator candidate plan, timed side by side with it.

        Per-operator timings miss effects that only show in a whole step: casts vanish inside long low-precision
        runs (``all_low``), and cheap operators lowered between lowered ones can cost more than the casts they
        save, e.g. a bf16 LayerNorm on a CPU (``compute``: the compute operators alone). Only plans that differ
        from the candidate plan and from each other are timed.
        """
        low = self.low.value
        allowed = [n for n in order if n in lowerable and not decisions[n].get("excluded")]
        heavy = [n for n in allowed if classify(modules[n]) in _HEAVY_KINDS]
        options = {
            "all_low": PrecisionPlan.from_dict({n: low for n in allowed}),
            "compute": PrecisionPlan.from_dict({n: low for n in heavy}),
        }
        seen = {plan_for(self.low, runs, candidates).entries} if candidates else set()
        seen.add(PrecisionPlan().entries)
        out: dict[str, PrecisionPlan] = {}
        for label, plan in options.items():
            if plan.entries not in seen:
                seen.add(plan.entries)
                out[label] = plan
        return out

    def adopt(self, winner: str, plan: PrecisionPlan, order: list[str], decisions: dict[str, dict[str, Any]],
              step_ms: dict[str, float], saved: dict[str, float] | None = None,
              ) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
        """Make the operators of ``plan`` the candidates (no cheap-operator fills: the plan was timed as is)."""
        lowered = {selector for selector, precision in plan.entries if precision is not Precision.FP32}
        what = {"all_low": f"the all-{self.low} plan", "compute": "the plan of compute operators only"}[winner]
        better = {Objective.THROUGHPUT: "faster as a whole", Objective.MEMORY: "leaner as a whole",
                  Objective.BALANCED: "better in time x memory as a whole"}[self.config.objective]
        timing = f"({step_ms[winner]:.3f} vs {step_ms['fp32']:.3f} ms per step in fp32"
        timing += f", {step_ms['candidates']:.3f} ms for the candidates)" if "candidates" in step_ms else ")"
        if saved:
            incumbent = "candidates" if "candidates" in saved else "fp32"
            timing += (f"; {saved[winner] / 2**20:.1f} MiB saved for backward vs {saved[incumbent] / 2**20:.1f} MiB"
                       f" for the {incumbent}")
        for name in order:
            if name in lowered:
                decisions[name].update(decision="candidate", reason=f"lowered as in {what}, {better} {timing}")
            elif decisions.get(name, {}).get("decision") in ("candidate", "fill") and not decisions[name].get("forced"):
                decisions[name].update(decision="fp32", reason=f"left fp32: {what} is {better} {timing}")
        candidates = tuple(n for n in order if n in lowered or decisions[n].get("forced"))
        return candidates, []

    def select(self, modules: dict[str, torch.nn.Module], lowerable: list[str],
               results: dict[str, ProfileResult]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        """Each operator's decision from its measurements, and the runs of cheap operators between candidates."""
        config = self.config
        fp32, low = results["fp32"].operators, results["low"].operators
        decisions: dict[str, dict[str, Any]] = {}
        fillable: set[str] = set()
        include, exclude = config.included, config.excluded
        for name, module in modules.items():
            kind = classify(module)
            entry: dict[str, Any] = {"type": type(module).__name__, "kind": kind.value,
                                     "params": sum(p.numel() for p in module.parameters())}
            a, b = fp32.get(name), low.get(name)
            ratio = None
            if a is not None:
                entry["fp32"] = a.to_dict()
            if b is not None:
                entry["low"] = b.to_dict()
            if a is not None and b is not None:
                ratio = paired_ratio(results["fp32"].series(name), results["low"].series(name))
                entry.update(time_ratio=ratio.ratio, time_spread=[ratio.low, ratio.high], rounds=ratio.rounds)
            entry["gain_ms"] = 0.0
            if name not in lowerable:
                entry.update(decision="fp32", reason="shape-only" if kind is OperatorKind.SHAPE
                             else f"no {self.low} kernel on this device")
            elif exclude.matches(name, module):
                entry.update(decision="fp32", reason="excluded by CoMPSearch(exclude=...)", excluded=True)
            elif include.matches(name, module):
                entry.update(decision="candidate", reason="included by CoMPSearch(include=...)", forced=True,
                             gain_ms=(a.total_ms - b.total_ms) if a is not None and b is not None else 0.0)
            elif a is None or b is None:
                entry.update(decision="fp32", reason="not run in the training step")
            elif kind in _HEAVY_KINDS:
                entry.update(judge_operator(config, a.total_ms, b.total_ms, a.saved_bytes, b.saved_bytes, ratio))
                entry["own_decision"] = entry["decision"]  # from its own measurement, before whole-step checks
            else:
                cheap_ok = b.compute_ms <= a.compute_ms * (1 + config.speed_margin) + config.min_gain_ms
                entry.update(decision="fill" if cheap_ok else "fp32",
                             reason="lowered only between lowered operators" if cheap_ok
                             else f"slower in {self.low} ({b.compute_ms:.4f} vs {a.compute_ms:.4f} ms)")
                if cheap_ok:
                    fillable.add(name)
            decisions[name] = entry
        return decisions, cheap_runs(results["fp32"].order, decisions, fillable, modules)


def cheap_runs(order: list[str], decisions: dict[str, dict[str, Any]], fillable: set[str],
               modules: dict[str, torch.nn.Module]) -> list[dict[str, Any]]:
    """Maximal runs of fillable cheap operators between two candidate operators, in execution order."""
    runs = []
    before: str | None = None
    pending: list[str] = []
    for name in order:
        decision = decisions.get(name, {}).get("decision")
        if decision == "candidate":
            if before is not None and pending:
                runs.append({"before": before, "after": name, "operators": list(pending)})
            before, pending = name, []
        elif name in fillable:
            pending.append(name)
        elif classify(modules[name]) is OperatorKind.SHAPE:
            continue
        else:
            before, pending = None, []
    return runs


class ExtraRounds:
    """The budget of extra measured rounds: a fraction (``extra_profile_time``) of the first rounds' time.

    Args:
        config: the search's settings.
        first_seconds: how long the first rounds took (warm-up included).
        first_rounds: how many rounds that was.
    """

    MAX_CHUNK = 16  # rounds added at a time (tiny models: many rounds fit the budget; re-check between chunks)
    MIN_SECONDS = 0.5  # small models get at least this much: their rounds are short and noisy, and cheap

    def __init__(self, config: SearchConfig, first_seconds: float, first_rounds: int) -> None:
        self.per_round = first_seconds / max(first_rounds, 1)
        fraction = config.extra_profile_time
        self.left = max(first_seconds * fraction, self.MIN_SECONDS) if fraction > 0 else 0.0
        self.chunk = max(config.profile_steps, 2)

    def next_rounds(self) -> int:
        """How many rounds to add now (0: the budget is spent)."""
        affordable = int(self.left // self.per_round) if self.per_round > 0 else self.MAX_CHUNK
        return max(0, min(self.chunk, affordable, self.MAX_CHUNK))

    @contextmanager
    def spending(self) -> Iterator[None]:
        """Charge the block's time to the budget."""
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self.left -= elapsed
            self.chunk = min(self.chunk * 2, self.MAX_CHUNK)


class TrainingStepRunner:
    """Runs the user's ``training_step`` plus backward on one batch, without logging, stepping or gradient sync."""

    def __init__(self, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.pl_module = pl_module
        self.batch = batch
        self.batch_idx = batch_idx

    def __call__(self) -> None:
        module = self.pl_module
        module.log = _ignore  # type: ignore[method-assign]
        module.log_dict = _ignore  # type: ignore[method-assign]
        try:
            output = module.training_step(self.batch, self.batch_idx)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if module.automatic_optimization:
                if not isinstance(loss, torch.Tensor):
                    raise SearchConfigError(
                        "CoMPSearch profiles the training step, but training_step returned"
                        f" {type(output).__name__} instead of a loss tensor (or a dict with 'loss')."
                    )
                loss.backward()
        finally:
            del module.log
            del module.log_dict
            for param in module.parameters():
                param.grad = None


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
