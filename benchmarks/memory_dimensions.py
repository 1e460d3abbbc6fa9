"""What each memory dimension of a CoMP plan buys: step peak tensor memory split up, and throughput against AMP.

A ``PrecisionPlan`` sets, per operator, besides its compute precision: what it saves for backward (``saved``: as
computed, ``bf16``, ``fp8`` or ``recompute``), the precision of the Adam(W) state of the parameters it owns
(``state``: ``fp32``/``bf16``/``8bit``) and of those parameters themselves (``master``: ``fp32``/``bf16``). This
script trains the compare suite's ``gpt`` and ``cnn`` (``benchmarks/compare_suite.py``; the zoo models train with
AdamW) under, per model:

1. FP32 (``Trainer(precision="32-true")``),
2. AMP (``Trainer(precision="bf16-mixed")``),
3. a CoMP plan (``--plan-<model> PATH``, or ``lean``; default: the chosen plan of a memory search,
   ``benchmarks/results/memory_dims/seed0/compare_search_<model>_comp-memory/plan.json``, where it fits the model and
   sets a state, master or recompute entry; else the built-in *lean* plan of :func:`lean_plan`),
4. that plan with each dimension removed in turn: no optimizer-state precision, no BF16 master weights, no
   recomputation (recompute entries back to ``fp32``), no saved-for-backward lowering at all (a dimension the plan
   does not set gives no row).

How it measures (all configurations in one process, ``benchmarks/compare_probes.py``'s probes):

- **Memory**: the peak tensor memory of one steady training step, split into the parameters, gradients and optimizer
  state alive at the step's start (``_static_bytes``: every tensor of every optimizer state dict, 8-bit moments' codes
  and block scales included) and the peak increase of live tensors during the step (``torch.profiler`` memory events,
  ``_tensor_peak_delta``; on CUDA ``torch.cuda.max_memory_allocated`` over the step minus what was allocated at its
  start). The step peak is their sum. Bytes do not depend on the CPU. (Profiled in a training thread, the numbers
  equal those of ``benchmarks/compare.py``'s process per mode: cnn AMP 82.20 MiB, gpt FP32 190.22 MiB; kineto may
  print "External init callback must run in same thread as registerClient" once, which changes nothing.)
- **Throughput**: every configuration has its own ``Trainer.fit`` in a thread of its own, and a coordinator hands out
  turns (``segment`` optimizer steps each; only one configuration runs at any time) in an order that rotates every
  round. The first ``--warmup-rounds`` rounds (they hold the profiled step) are warm-up; each batch is timed from
  ``on_train_batch_start`` to ``on_train_batch_end``. A configuration's throughput in a round = batch size / median
  batch time; its ratio to AMP is the median over the measured rounds of the per-round ratios (interval: min-max over
  rounds). Throughput depends on the CPU (the report names its class).

Usage::

    python benchmarks/memory_dimensions.py                      # gpt and cnn, ~6 min on 2 cores
    python benchmarks/memory_dimensions.py --smoke --out /tmp/md   # tiny models, seconds
    python benchmarks/memory_dimensions.py --models gpt --steps 12 --plan-gpt my_plan.json

Writes ``memory_dimensions.md``, ``memory_dimensions.json`` and the plan trained per model (``plan_<model>.json``)
under ``--out`` (default ``benchmarks/results/memory_dimensions``).
"""

from __future__ import annotations

import argparse
import gc
import math
import queue
import statistics
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the compare benchmark's modules, also when imported

from compare_analysis import round_ratio  # noqa: E402
from compare_probes import _make_baton_callback  # noqa: E402
from compare_suite import RESULTS_DIR, ROOT, SUITE, smoke_spec  # noqa: E402
from compare_workers import _build, _quiet, _trainer_common  # noqa: E402
from harness import load_average, run_header, write_json, write_text  # noqa: E402

MODELS = ("gpt", "cnn")
OUT_DIR = RESULTS_DIR / "memory_dimensions"
MiB = 2**20

# The lean plan: what computes in BF16 (saving FP8), and the cheap operators recomputed in backward.
LOW_TYPES = frozenset({"Linear", "Conv1d", "Conv2d", "Conv3d", "ScaledDotProductAttention", "MultiheadAttention"})
RECOMPUTE_TYPES = frozenset({"GELU", "LayerNorm", "ReLU", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"})


def search_plan_path(key: str) -> Path:
    """Where ``benchmarks/compare.py --out benchmarks/results/memory_dims/seed0`` (docs/benchmark.md, "Memory
    dimensions") leaves the memory search's chosen plan."""
    return RESULTS_DIR / "memory_dims" / "seed0" / f"compare_search_{key}_comp-memory" / "plan.json"


# --------------------------------------------------------------------------------------------------------- plans
def lean_plan(model: Any) -> Any:
    """The built-in lean plan for ``model``.

    Every Linear/Conv/attention operator computes in BF16 and saves FP8; the cheap operators (GELU, LayerNorm, ReLU,
    BatchNorm) save ``recompute`` (those ``recompute_unsuitable`` refuses, e.g. in-place ones, stay as computed);
    every operator owning parameters keeps their Adam state in 8 bit (so do parameters no operator owns: the state
    default) and, where it computes in BF16, holds them as BF16 master weights.
    """
    from lightning_comp import PrecisionPlan
    from lightning_comp.execution.parameter_groups import parameter_owners
    from lightning_comp.operators import discover_operators
    from lightning_comp.operators.discovery import iter_operators

    try:
        from lightning_comp.execution.recompute import recompute_unsuitable
    except ImportError:  # recomputation not there yet: offer it everywhere the type says, and let the run tell
        def recompute_unsuitable(module: Any) -> str | None:
            return None

    modules = dict(iter_operators(model))
    owners = {p.owner for p in parameter_owners(model) if p.owner is not None}
    mapping: dict[str, dict[str, str]] = {}
    for info in discover_operators(model):
        entry: dict[str, str] = {}
        if info.type_name in LOW_TYPES:
            entry.update(compute="bf16", saved="fp8")
        elif info.type_name in RECOMPUTE_TYPES and recompute_unsuitable(modules[info.name]) is None:
            entry["saved"] = "recompute"
        if info.name in owners:
            entry["state"] = "8bit"
            if entry.get("compute") == "bf16":
                entry["master"] = "bf16"
        if entry:
            mapping[info.name] = entry
    plan = PrecisionPlan.from_dict(mapping, default={"state": "8bit"})
    return plan.with_provenance(made_by="benchmarks/memory_dimensions.py lean_plan")


def plan_dimensions(plan: Any) -> dict[str, Any]:
    """Which of the new dimensions ``plan`` sets, with entry counts."""
    saved = [p.value for p in plan["saved"].values() if p.changes]
    return {
        "compute_bf16": sum(1 for p in plan["compute"].values() if p.value == "bf16"),
        "saved_lowered": sum(1 for v in saved if v in ("bf16", "fp8")),
        "recompute": sum(1 for v in saved if v == "recompute"),
        "state": sum(1 for p in plan["state"].values() if p.managed),
        "master": sum(1 for p in plan["master"].values() if p.managed),
    }


def without(plan: Any, dimension: str) -> Any:
    """``plan`` with ``dimension`` back at FP32 for every operator."""
    return replace(plan, assignments=tuple(a for a in plan.assignments if a.dimension.value != dimension))


def ablations(plan: Any) -> dict[str, tuple[str, Any]]:
    """``plan`` with each dimension it sets removed in turn: key -> (label, plan)."""
    from lightning_comp.numerics import SavedPrecision

    dims = plan_dimensions(plan)
    out: dict[str, tuple[str, Any]] = {}
    if dims["state"]:
        out["plan-no-state"] = ("plan without optimizer-state precision (fp32 state)",
                                without(plan, "state"))
    if dims["master"]:
        out["plan-no-master"] = ("plan without BF16 master weights", without(plan, "master"))
    if dims["recompute"]:
        saved = {s: SavedPrecision.FP32 if p.recomputes else p for s, p in plan["saved"].entries}
        default = "fp32" if plan["saved"].default.recomputes else plan["saved"].default
        out["plan-no-recompute"] = ("plan without recompute (those entries fp32)",
                                    without(plan, "saved").with_assignment("saved", saved, default))
    if dims["saved_lowered"] or dims["recompute"]:
        out["plan-no-saved"] = ("plan without any saved lowering (fp8/bf16/recompute)",
                                without(plan, "saved"))
    return out


def choose_plan(key: str, model: Any, path: str | None, smoke: bool) -> tuple[Any, str, str, Any]:
    """The CoMP plan to measure for ``key``: (plan, source, note on how it was chosen, reference plan or ``None``).

    The reference is the memory search's plan where it fits the model but sets no state, master or recompute entry
    (made before those dimensions existed): the lean plan is measured instead, and the search's plan beside it.
    """
    from lightning_comp import PrecisionPlan
    from lightning_comp.errors import PlanError

    if path == "lean":
        return lean_plan(model), "built-in lean plan", f"asked for with --plan-{key} lean", None
    if path:
        plan = PrecisionPlan.load(path)
        plan.validate(model)  # a plan made for another model fails here, naming the difference
        return plan, f"--plan-{key} {path}", "given on the command line", None
    default = search_plan_path(key)
    note, reference = "", None
    if smoke:
        note = "--smoke: the memory search's plan was made for the full-size model"
    elif not default.exists():
        note = f"no memory search plan at {default.relative_to(ROOT)}"
    else:
        try:
            plan = PrecisionPlan.load(default)
            plan.validate(model)
        except PlanError as err:
            note = f"the memory search plan {default.relative_to(ROOT)} does not fit: {str(err)[:200]}"
        else:
            dims = plan_dimensions(plan)
            if dims["state"] or dims["master"] or dims["recompute"]:
                return plan, str(default.relative_to(ROOT)), "the memory search's chosen plan", None
            reference = plan
            note = (f"the memory search plan {default.relative_to(ROOT)} sets no state, master or recompute entry"
                    f" (compute and saved only: {dims}); its ablations would show nothing")
    return lean_plan(model), "built-in lean plan", note + "; measured the built-in lean plan instead", reference


# ------------------------------------------------------------------------------------------------ configurations
@dataclass
class Config:
    """One configuration of one model: a Lightning precision or a CoMP plan."""

    key: str
    label: str
    precision: str | None = None  # Trainer precision; None: CoMPPrecision(plan)
    plan: Any = None


def configurations(plan: Any, plan_label: str, amp: bool = True) -> list[Config]:
    """FP32, AMP (unless not ``amp``), the plan and its ablations (in this order)."""
    configs = [Config("fp32", "FP32 (32-true)", "32-true")]
    configs += [Config("amp", "AMP (bf16-mixed)", "bf16-mixed")] if amp else []
    configs += [Config("plan", plan_label, None, plan)]
    configs += [Config(k, label, None, p) for k, (label, p) in ablations(plan).items()]
    return configs


# ------------------------------------------------------------------------------------------- in-process baton
class _ThreadConn:
    """One end of a pipe between the coordinator and a training thread (what ``compare_probes``'s Baton talks to)."""

    def __init__(self, inbox: queue.Queue[Any], outbox: queue.Queue[Any]) -> None:
        self.inbox, self.outbox = inbox, outbox

    def send(self, message: Any) -> None:
        self.outbox.put(message)

    def recv(self, timeout: float | None = None) -> Any:
        return self.inbox.get(timeout=timeout)


def _pipe() -> tuple[_ThreadConn, _ThreadConn]:
    a: queue.Queue[Any] = queue.Queue()
    b: queue.Queue[Any] = queue.Queue()
    return _ThreadConn(a, b), _ThreadConn(b, a)


def _make_step_start_callback(profile_step: int) -> Any:
    """Runs before the Baton: collects garbage before the profiled step and, on CUDA, notes the bytes allocated at its
    start (the other configurations' tensors live in this process too)."""
    import torch
    from lightning.pytorch.callbacks import Callback

    class StepStart(Callback):
        def __init__(self) -> None:
            self.allocated: int | None = None
            self.dtypes: dict[str, dict[str, int]] = {}

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step != profile_step:
                return
            gc.collect()
            self.dtypes = _dtypes(pl_module, trainer.optimizers)
            if torch.cuda.is_available() and next(pl_module.parameters()).is_cuda:
                torch.cuda.synchronize()
                self.allocated = int(torch.cuda.memory_allocated())

    return StepStart()


def _dtypes(model: Any, optimizers: list[Any]) -> dict[str, dict[str, int]]:
    """How many parameters, and optimizer state tensors (step counters aside), there are of each dtype."""
    import torch

    def count(tensors: Any) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in tensors:
            key = str(t.dtype).replace("torch.", "")
            out[key] = out.get(key, 0) + 1
        return out

    states = [v for opt in optimizers for st in opt.state.values() for k, v in st.items()
              if isinstance(v, torch.Tensor) and k != "step"]
    return {"parameters": count(model.parameters()), "optimizer_state": count(states)}


class _Run:
    """One configuration's model, Trainer and training thread."""

    def __init__(self, config: Config, spec: dict[str, Any], steps: int, profile_step: int, seed: int,
                 threads: int) -> None:
        import lightning.pytorch as pl

        from lightning_comp import CoMPPrecision

        self.config = config
        self.model, self.datamodule = _build(spec, seed)
        self.coordinator, self.worker = _pipe()
        self.baton = _make_baton_callback(self.worker, spec, -1, profile_step)  # -1: no saved-bytes probe step
        self.step_start = _make_step_start_callback(profile_step)
        kwargs = _trainer_common()
        if config.precision is None:
            kwargs["plugins"] = [CoMPPrecision(plan=config.plan)]
        else:
            kwargs["precision"] = config.precision
        self.trainer = pl.Trainer(max_steps=steps, limit_val_batches=0, callbacks=[self.step_start, self.baton],
                                  **kwargs)
        self.threads = threads
        self.error: str | None = None
        self.thread = threading.Thread(target=self._fit, name=f"train-{config.key}", daemon=True)

    def _fit(self) -> None:
        import torch

        torch.set_num_threads(self.threads)  # intra-op threads are set per calling thread
        try:
            self.trainer.fit(self.model, datamodule=self.datamodule)
            self.worker.send(("done", None))
        except BaseException:  # noqa: BLE001 - every failure goes to the coordinator
            self.worker.send(("error", traceback.format_exc()))


def run_model(spec: dict[str, Any], configs: list[Config], args: argparse.Namespace) -> dict[str, Any]:
    """Train every configuration of one model side by side in this process; measure memory and throughput.

    Returns:
        ``configs``: per configuration its memory split, throughput per round, ratios to AMP (or its ``error``);
        ``orders``: the order of every round.
    """
    import torch

    segment, warmup = int(spec["segment"]), int(args.warmup_rounds)
    rounds = warmup + int(args.steps)
    steps = rounds * segment
    profile_step = max(1, warmup * segment - 1)
    threads = args.threads or torch.get_num_threads()
    runs: dict[str, _Run] = {}
    results: dict[str, dict[str, Any]] = {}
    active: list[str] = []
    for config in configs:  # set up one at a time: each fit runs up to on_train_start, then waits for its turn
        try:
            run = runs[config.key] = _Run(config, spec, steps, profile_step, args.seed, threads)
            run.thread.start()
            kind, payload = run.coordinator.recv(timeout=args.timeout)
        except Exception:  # noqa: BLE001 - a configuration that cannot even start is reported, the others run
            kind, payload = "error", traceback.format_exc()
        if kind == "ready":
            active.append(config.key)
        else:
            results[config.key] = {"error": payload}
            print(f"[memory_dimensions] {spec['key']}/{config.key} failed at setup:\n{payload}", flush=True)
    orders: list[list[str]] = []
    round_index = 0
    while active:
        shift = round_index % len(active)
        order = active[shift:] + active[:shift]
        orders.append(order)
        for key in order:
            run = runs[key]
            run.coordinator.send(("go", round_index))
            try:
                kind, payload = run.coordinator.recv(timeout=args.timeout)
            except queue.Empty:
                kind, payload = "error", f"no answer within {args.timeout:.0f} s in round {round_index}"
            if kind == "yield":
                continue
            active.remove(key)
            if kind == "error":
                results[key] = {"error": payload}
                print(f"[memory_dimensions] {spec['key']}/{key} failed in round {round_index}:\n{payload}", flush=True)
        round_index += 1
    for run in runs.values():
        run.thread.join(timeout=30)
    batch = int(spec["data_kwargs"]["batch_size"])
    for config in configs:
        if config.key in results:
            results[config.key].update(label=config.label)
            continue
        results[config.key] = _measured(runs[config.key], batch, warmup)
    amp = results.get("amp", {})
    for entry in results.values():
        if "error" in entry or not amp or "error" in amp:
            continue
        entry["step_peak_vs_amp"] = entry["memory"]["step_peak_bytes"] / amp["memory"]["step_peak_bytes"]
        entry["throughput_vs_amp"] = round_ratio(entry["throughput"], amp["throughput"])
    return {"configs": results, "orders": orders, "steps": steps, "profile_step": profile_step,
            "warmup_rounds": warmup, "measured_rounds": int(args.steps), "segment": segment}


def _measured(run: _Run, batch: int, warmup: int) -> dict[str, Any]:
    """A finished configuration's memory split, throughput per round, and what its optimizer and parameters hold."""
    baton = run.baton
    peak = baton.step_peak
    if peak is None or peak.get("delta_bytes") is None and run.step_start.allocated is None:
        return {"label": run.config.label, "error": "the profiled step recorded no memory events"}
    static = peak["static"]
    if run.step_start.allocated is not None:  # CUDA: the allocator's peak over the step, from what it held at start
        in_step = int(peak["bytes"]) - run.step_start.allocated
        method = "torch.cuda.max_memory_allocated over the step - torch.cuda.memory_allocated at its start"
    else:
        in_step = int(peak["delta_bytes"])
        method = "torch.profiler peak of live tensors during the step (memory events)"
    memory = {"weights_bytes": static["parameters"], "gradients_bytes": static["gradients"],
              "optimizer_state_bytes": static["optimizer_state"], "in_step_peak_bytes": in_step,
              "step_peak_bytes": static["total"] + in_step, "profiled_step": peak["step"],
              "static_method": "parameters + gradients + every tensor of every optimizer state dict at the step's start"
                               " (compare_probes._static_bytes)", "in_step_method": method}
    per_round: dict[int, list[float]] = {}
    for b in baton.batches:
        if b["round"] >= warmup and not b["special"]:
            per_round.setdefault(int(b["round"]), []).append(float(b["ms"]))
    sps = {str(r): batch / (statistics.median(ms) / 1e3) for r, ms in sorted(per_round.items())}
    values = list(sps.values())
    losses = [b["loss"] for b in baton.batches if b["round"] == max(per_round, default=-1) and b["loss"] is not None]
    return {
        "label": run.config.label,
        "precision": run.config.precision or "CoMPPrecision(plan)",
        "plan": None if run.config.plan is None else run.config.plan.to_dict(),
        "memory": memory,
        "throughput": {"samples_per_s": statistics.median(values) if values else math.nan,
                       "min": min(values, default=math.nan), "max": max(values, default=math.nan), "rounds": sps},
        "optimizer": type(run.trainer.optimizers[0]).__name__,
        # at the profiled step's start; uint8 state tensors: 8-bit moments (codes and block scales, packed)
        "optimizer_state_tensors_by_dtype": run.step_start.dtypes.get("optimizer_state", {}),
        "parameters_by_dtype": run.step_start.dtypes.get("parameters", {}),
        "last_round_train_loss": statistics.median(losses) if losses else None,
        "global_step": int(run.trainer.global_step),
    }


def effects(configs: dict[str, Any]) -> dict[str, Any]:
    """Each dimension's effect: the plan against the plan without it (MiB, points of x AMP, throughput ratio)."""
    plan = configs.get("plan", {})
    out: dict[str, Any] = {}
    if "error" in plan:
        return out
    for key, entry in configs.items():
        if not key.startswith("plan-no-") or "error" in entry:
            continue
        saved = entry["memory"]["step_peak_bytes"] - plan["memory"]["step_peak_bytes"]
        out[key[len("plan-no-"):]] = {
            "step_peak_saved_bytes": saved,
            "parts_saved_bytes": {part: entry["memory"][part] - plan["memory"][part] for part in _PARTS},
            "step_peak_vs_amp_points": (entry.get("step_peak_vs_amp", math.nan) - plan.get("step_peak_vs_amp",
                                                                                           math.nan)),
            "throughput_plan_vs_without": round_ratio(plan["throughput"], entry["throughput"]),
        }
    return out


_PARTS = ("weights_bytes", "gradients_bytes", "optimizer_state_bytes", "in_step_peak_bytes")


# ------------------------------------------------------------------------------------------------------ report
def _mib(value: float) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value / MiB:.2f}"


def _ratio_cell(r: dict[str, Any] | None) -> str:
    if not r or not math.isfinite(r.get("median", math.nan)):
        return "n/a"
    return f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: the machine, the table per model and configuration, each dimension's effect."""
    m = report["machine"]
    lines = [
        f"# Memory dimensions of a CoMP plan: results of `{report['command']}`", "",
        f"- date: {report['date']}; commit {report['commit']}"
        + (" (with uncommitted changes in the working tree)" if report["dirty"] else "")
        + f"; total {report['total_seconds']:.0f} s",
        f"- machine: {report['device_class']}; {m.get('lscpu Model name', '?')}, {m.get('cpu_count')} CPUs, torch"
        f" {m['torch']} ({report['torch_threads']} threads), lightning {m['lightning']}, device {report['device']};"
        f" load average at start {report['load_average_start']}, at end {report['load_average_end']}",
        "- bytes do not depend on the CPU; throughput does (the ratios are this CPU class's)",
        f"- per configuration: {report['settings']['warmup_rounds']} warm-up round(s) (holding the profiled step) and"
        f" {report['settings']['measured_rounds']} measured round(s) of `segment` optimizer steps, interleaved in"
        " one process in a rotating order; optimizer AdamW (the zoo's)",
        "- memory: weights, gradients and optimizer state alive at the start of one steady step (every tensor of every"
        " optimizer state dict: 8-bit moments' codes and block scales) + the in-step peak (torch.profiler peak of"
        " live tensors during the step; CUDA: max_memory_allocated over it) = step peak; x AMP = step peak / AMP's",
        "- throughput x AMP: median over measured rounds of the per-round ratio of samples/s to AMP's [min-max over"
        " rounds]",
        "",
        "| model | configuration | weights MiB | grads MiB | optimizer state MiB | in-step peak MiB | step peak MiB |"
        " x AMP | throughput x AMP [interval] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, model in report["models"].items():
        for ckey, e in model["configs"].items():
            if "error" in e:
                first = e["error"].strip().splitlines()[-1][:160].replace("|", "/")
                lines.append(f"| {key} | {e.get('label', ckey)} | error: {first} | | | | | | |")
                continue
            mem = e["memory"]
            lines.append(
                f"| {key} | {e['label']} | {_mib(mem['weights_bytes'])} | {_mib(mem['gradients_bytes'])} |"
                f" {_mib(mem['optimizer_state_bytes'])} | {_mib(mem['in_step_peak_bytes'])} |"
                f" {_mib(mem['step_peak_bytes'])} | {e.get('step_peak_vs_amp', math.nan):.3f} |"
                f" {_ratio_cell(e.get('throughput_vs_amp'))} |")
    lines += ["", "## Each dimension's effect", "",
              "The plan against the plan without the dimension: step peak bytes the dimension saves (and in which"
              " part), the points of x AMP it takes off, and the plan's throughput over that of the plan without it"
              " (median of per-round ratios [min-max]).", "",
              "| model | dimension | step peak saved MiB | of which weights / grads / state / in-step MiB |"
              " x AMP it takes off | throughput plan / without [interval] |", "|---|---|---|---|---|---|"]
    for key, model in report["models"].items():
        for dim, e in model["effects"].items():
            parts = " / ".join(_mib(e["parts_saved_bytes"][p]) for p in _PARTS)
            lines.append(f"| {key} | {dim} | {_mib(e['step_peak_saved_bytes'])} | {parts} |"
                         f" {e['step_peak_vs_amp_points']:+.3f} | {_ratio_cell(e['throughput_plan_vs_without'])} |")
    lines += ["", "## Plans", ""]
    for key, model in report["models"].items():
        dims = model["plan_dimensions"]
        lines.append(f"- {key}: {model['plan_source']} ({model['plan_note']}): {dims['compute_bf16']} operators"
                     f" compute bf16, {dims['saved_lowered']} save bf16/fp8, {dims['recompute']} recompute,"
                     f" {dims['state']} state entries, {dims['master']} bf16-master entries; written to"
                     f" `plan_{key}.json`")
        for ckey, why in model.get("skipped", {}).items():
            lines.append(f"  - no `{ckey}` row: {why}")
        for e in model["configs"].values():
            if "error" not in e:
                loss = e["last_round_train_loss"]
                lines.append(f"  - {e['label']}: at the profiled step, parameters by dtype {e['parameters_by_dtype']},"
                             f" optimizer state tensors by dtype {e['optimizer_state_tensors_by_dtype']}, last-round"
                             " train loss"
                             f" {'n/a' if loss is None else format(loss, '.4f')}")
    failed = [(k, c, e["error"]) for k, m in report["models"].items() for c, e in m["configs"].items() if "error" in e]
    if failed:
        lines += ["", "## Configurations that did not run", ""]
        for key, ckey, error in failed:
            lines += [f"- {key}/{ckey}:", "", "```", error.strip()[-2000:], "```"]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {MODELS}")
    parser.add_argument("--smoke", action="store_true", help="tiny models (compare_suite.smoke_spec), 2 rounds")
    parser.add_argument("--steps", type=int, default=None,
                        help="measured rounds per configuration (default 8, --smoke 2), each of the spec's segment")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds left out of the throughput (default 1)")
    parser.add_argument("--out", default=str(OUT_DIR), help="results folder (default %(default)s)")
    for key in MODELS:
        parser.add_argument(f"--plan-{key}", default=None, metavar="PATH",
                            help=f"plan file for {key}, or 'lean' for the built-in lean plan (default: its memory"
                                 " search's plan where it sets a state, master or recompute entry, else the lean plan)")
    parser.add_argument("--no-reference", action="store_true",
                        help="no reference row for a memory search plan that the lean plan replaced")
    parser.add_argument("--no-amp", action="store_true",
                        help="no AMP row (where bf16 is emulated, an AVX2-only CPU, it runs 30-100x slower than FP32);"
                             " the plan and its ablations are then compared with each other and FP32 only")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for any one turn")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.smoke else 8
    if args.steps < 1 or args.warmup_rounds < 1:
        parser.error("--steps and --warmup-rounds must be at least 1")
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {MODELS}")
    return args


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every model of ``args.models``; write and return the report."""
    import torch

    _quiet()
    from lightning_comp.devices import device_class

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {
        **run_header("memory_dimensions.py"),
        "device": device,
        "device_class": device_class(device).describe(),
        "torch": torch.__version__,
        "torch_threads": args.threads or torch.get_num_threads(),
        "smoke": bool(args.smoke),
        "settings": {"measured_rounds": args.steps, "warmup_rounds": args.warmup_rounds, "seed": args.seed},
        "models": {},
    }
    for key in args.models.split(","):
        spec_obj = smoke_spec(SUITE[key]) if args.smoke else SUITE[key]
        spec = asdict(spec_obj)
        probe_model, _ = _build(spec, args.seed)
        plan, source, note, reference = choose_plan(key, probe_model, getattr(args, f"plan_{key}"), args.smoke)
        del probe_model
        plan.save(out / f"plan_{key}.json")
        label = "CoMP lean plan" if source == "built-in lean plan" else "CoMP plan"
        configs = configurations(plan, label, amp=not args.no_amp)
        if reference is not None and not args.no_reference:
            configs.append(Config("search-plan", "memory search plan (compute + saved only; reference)", None,
                                  reference))
        dims = plan_dimensions(plan)
        skipped = {k: f"the plan sets no {what}" for k, what in (
            ("plan-no-state", "optimizer-state precision"), ("plan-no-master", "BF16 master weights"),
            ("plan-no-recompute", "recompute entry"), ("plan-no-saved", "saved lowering"))
            if k not in {c.key for c in configs}}
        print(f"[memory_dimensions] {key}: {', '.join(c.key for c in configs)} ({source}: {dims})", flush=True)
        t0 = time.perf_counter()
        measured = run_model(spec, configs, args)
        model_report = {"title": spec_obj.title, "spec": spec, "plan_source": source, "plan_note": note,
                        "plan_dimensions": dims, "skipped": skipped, **measured,
                        "effects": effects(measured["configs"]), "seconds": time.perf_counter() - t0}
        report["models"][key] = model_report
        for ckey, e in measured["configs"].items():
            if "error" not in e:
                print(f"    {ckey:<18} step peak {e['memory']['step_peak_bytes'] / MiB:8.2f} MiB"
                      f" (x AMP {e.get('step_peak_vs_amp', math.nan):.3f})  throughput x AMP"
                      f" {_ratio_cell(e.get('throughput_vs_amp'))}", flush=True)
        print(f"[memory_dimensions] {key}: done in {model_report['seconds']:.0f} s", flush=True)
    report["load_average_end"] = load_average()
    report["total_seconds"] = time.perf_counter() - started
    write_json(out / "memory_dimensions.json", report)
    write_text(out / "memory_dimensions.md", markdown(report))
    print(f"[memory_dimensions] wrote {out / 'memory_dimensions.md'} and memory_dimensions.json", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    report = run_benchmark(parse_args(argv))
    failed = [f"{k}/{c}" for k, m in report["models"].items() for c, e in m["configs"].items() if "error" in e]
    if failed:
        print(f"[memory_dimensions] configurations that did not run: {', '.join(failed)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
