"""Why CoMP misses a target: in-process diagnostics for one model of ``benchmarks/compare.py``'s suite.

    python benchmarks/compare_diagnose.py --model gpt [--plan benchmarks/results/compare_search_gpt/plan.json]

Everything is measured on one fixed batch, without Lightning, in interleaved rounds (minimum and median over rounds):

1. **Step time per execution strategy** (forward + backward + AdamW step): FP32; AMP (one global ``torch.autocast``);
   CoMP with the searched plan; CoMP lowering only the compute operators (Linear/Conv/LSTM); CoMP lowering every
   operator that can be lowered. CPU autocast runs norms and activations in their input dtype, so AMP lies between
   the last two (CNN: BatchNorm sees bf16 as in all-low; GPT: LayerNorm on the FP32 residual stream runs FP32 as in
   compute-only): the closer one isolates the engine's own overhead (hooks, autocast regions, boundary casts).
2. **Cast time** per strategy (``aten::_to_copy`` + ``aten::copy_`` self time under ``torch.profiler``) and the
   number of hooked operators.
3. **Memory of the calibration step**: the first step after a plan is applied traces cast boundaries; its peak live
   tensor bytes against the following steps'.
4. **The search's per-operator attribution**, as ``lightning_comp.search.measurement.profiling.OperatorProfiler``
   measures it and with a one-line fix (register the backward-timing hook only once per tensor, so an operator that
   returns its input, such as ``Dropout(p=0)``, does not take over the backward time of the operator that produced
   the tensor): which operators the batch stage would accept with and without the fix.

It writes ``benchmarks/results/compare_diagnose_<model>.json`` and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_suite import RESULTS_DIR, SUITE  # noqa: E402

from lightning_comp import PrecisionPlan, zoo  # noqa: E402
from lightning_comp.devices.lowering import Lowering, lowering_for  # noqa: E402
from lightning_comp.execution import PlanExecutor, StepKind
from lightning_comp.numerics import ComputePrecision
from lightning_comp.operators import classify, iter_operators  # noqa: E402


def _batch(model_key: str, seed: int) -> tuple[Any, Any, Any]:
    spec = SUITE[model_key]
    torch.manual_seed(seed)
    datamodule = getattr(zoo, spec.data)(**spec.data_kwargs)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    x, y = next(iter(loader))
    torch.manual_seed(seed)
    model = getattr(zoo, spec.model)(**spec.model_kwargs)
    return model, x, y


def _plans(model: torch.nn.Module, searched: dict[str, Any] | None) -> dict[str, PrecisionPlan]:
    ops = dict(iter_operators(model))
    lowerable = [n for n, m in ops.items()
                 if lowering_for(m, ComputePrecision.BF16, "cpu") not in (None, Lowering.NONE)]
    compute = [n for n in lowerable if classify(ops[n]).value == "compute"]
    plans = {"comp_all_low": PrecisionPlan.from_dict({n: "bf16" for n in lowerable}),
             "comp_compute_only": PrecisionPlan.from_dict({n: "bf16" for n in compute})}
    if searched is not None:
        entries = searched.get("entries", searched)
        plans["comp_searched"] = PrecisionPlan.from_dict(dict(entries))
    return plans


def step_times(model: torch.nn.Module, x: Any, y: Any, plans: dict[str, PrecisionPlan], rounds: int,
               ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, Any]]]:
    executor = PlanExecutor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-9)  # steps that barely move the weights
    modes = ["fp32", "amp", *plans]

    def run(mode: str, profile: bool = False) -> tuple[float, Any]:
        if mode in plans:
            executor.apply(model, plans[mode], "cpu")
            ctx: Any = executor.step(StepKind.TRAIN)
        else:
            executor.remove()
            ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "amp")
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
        start = time.perf_counter()
        if prof is not None:
            prof.__enter__()
        with ctx:
            loss = model.loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if prof is not None:
            prof.__exit__(None, None, None)
        return (time.perf_counter() - start) * 1e3, prof

    for mode in modes:  # warm-up (and the calibration step of each plan)
        run(mode)
        run(mode)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        for mode in order:
            times[mode].append(run(mode)[0])
    profiles: dict[str, dict[str, Any]] = {}
    for mode in modes:
        ms, prof = run(mode, profile=True)
        cast = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ("aten::_to_copy", "aten::copy_"))
        calls = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
        ops_total = sum(e.self_cpu_time_total for e in prof.key_averages())
        hooked = len(executor._operators) if mode in plans else 0  # noqa: SLF001 - diagnostics
        profiles[mode] = {"profiled_ms": ms, "cast_ms": cast / 1e3, "to_copy_calls": int(calls),
                          "op_self_ms": ops_total / 1e3, "outside_ops_ms": ms - ops_total / 1e3,
                          "hooked_operators": hooked}
    executor.remove()
    stats = {m: {"min_ms": min(v), "median_ms": statistics.median(v)} for m, v in times.items()}
    return stats, profiles


def _step_peaks(model: torch.nn.Module, run: Any, steps: int = 3) -> list[int]:
    """Peak live-tensor increase (profiler memory events) of each of ``steps`` training steps run by ``run``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_probes import _tensor_peak_delta

    peaks = []
    for _ in range(steps):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
            model.zero_grad(set_to_none=True)
        peaks.append(_tensor_peak_delta(prof, "cpu") or 0)
    return peaks


def _plan_step(model: torch.nn.Module, x: Any, y: Any, executor: PlanExecutor) -> Any:
    def run() -> None:
        with executor.step(StepKind.TRAIN):
            loss = model.loss(model(x), y)
        loss.backward()

    return run


def plan_memory(model: torch.nn.Module, x: Any, y: Any, plans: dict[str, PrecisionPlan]) -> dict[str, Any]:
    """Step peak tensor memory of AMP and of each plan, with CoMP's weight copies kept or re-cast in backward.

    Step peak = FP32 masters + gradients + AdamW moments (4 x 4 bytes per parameter) + the peak of live tensors in a
    calibrated step (profiler memory events, the third of three steps).
    """
    static = sum(p.numel() for p in model.parameters()) * 16

    def amp() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(model(x), y)
        loss.backward()

    out: dict[str, Any] = {"static_bytes": static, "amp": {"in_step_bytes": _step_peaks(model, amp)[-1]}}
    for label, plan in plans.items():
        for recast in (False, True):
            executor = PlanExecutor(recast_weights_in_backward=recast)
            executor.apply(model, plan, "cpu")
            try:
                peak = _step_peaks(model, _plan_step(model, x, y, executor))[-1]
            finally:
                executor.remove()
            out[f"{label}{'' if recast else '_keep_weights'}"] = {"in_step_bytes": peak}
    amp_total = static + out["amp"]["in_step_bytes"]
    for value in out.values():
        if isinstance(value, dict):
            value["step_peak_bytes"] = static + value["in_step_bytes"]
            value["vs_amp"] = value["step_peak_bytes"] / amp_total
    return out


def calibration_memory(model: torch.nn.Module, x: Any, y: Any, plan: PrecisionPlan, steps: int = 3) -> dict[str, Any]:
    """Peak live-tensor increase (profiler memory events) of the first step after a plan is applied, in which
    ``PlanExecutor`` traces cast boundaries, against the following steps (same plan, same batch)."""
    executor = PlanExecutor()
    executor.apply(model, plan, "cpu")
    try:
        peaks = _step_peaks(model, _plan_step(model, x, y, executor), steps)
    finally:
        executor.remove()
    return {"peak_delta_bytes_per_step": peaks, "first_step_extra_bytes": peaks[0] - min(peaks[1:])}


def attribution(model: torch.nn.Module, x: Any, y: Any, rounds: int) -> dict[str, Any]:
    """The batch stage's per-operator judgement of Linear-like operators (fp32 vs bf16 time, casts included).

    Before the fix in ``profiling._RoundRecorder`` (an operator that returns its input tensor no longer takes its
    producer's backward time), ``Dropout(p=0)`` made 8 of the default GPT's 19 Linears look 2.5x slower in bf16.
    """
    from lightning_comp.search.measurement import profiling

    ops = dict(iter_operators(model))
    lowerable = [n for n, m in ops.items()
                 if lowering_for(m, ComputePrecision.BF16, "cpu") not in (None, Lowering.NONE)]
    all_low = PrecisionPlan.from_dict({n: "bf16" for n in lowerable})
    executor = PlanExecutor()

    def step() -> None:
        with executor.step(StepKind.TRAIN):
            loss = model.loss(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    configs = {"fp32": lambda: executor.remove(), "low": lambda: executor.apply(model, all_low, "cpu")}
    try:
        results = profiling.OperatorProfiler(model, "cpu", rounds=rounds, warmup=2).profile(configs, step)
    finally:
        executor.remove()
    rows = {}
    for name in results["fp32"].order:
        if classify(ops[name]).value not in ("compute", "embedding"):
            continue
        a, b = results["fp32"].operators[name], results["low"].operators.get(name)
        if b is None:
            continue
        gain = a.total_ms - b.total_ms
        rows[name] = {"fp32_ms": round(a.total_ms, 3), "bf16_ms": round(b.total_ms, 3),
                      "fp32_backward_ms": round(a.backward_ms, 3), "pays": gain >= max(0.05 * a.total_ms, 0.005)}
    cheap_backward = {n: round(results["fp32"].operators[n].backward_ms, 3) for n in results["fp32"].order
                      if classify(ops[n]).value in ("elementwise",) and n in results["fp32"].operators}
    return {"shipped": {"operators": rows, "accepted": sorted(n for n, r in rows.items() if r["pays"]),
                        "elementwise_backward_ms_fp32": cheap_backward}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=sorted(SUITE))
    parser.add_argument("--plan", default=None, help="a plan.json from compare.py (default: the one it wrote)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-attribution", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    plan_path = Path(args.plan) if args.plan else RESULTS_DIR / f"compare_search_{args.model}" / "plan.json"
    searched = json.loads(plan_path.read_text()) if plan_path.exists() else None
    model, x, y = _batch(args.model, args.seed)
    plans = _plans(model, searched)
    stats, profiles = step_times(model, x, y, plans, args.rounds)
    report: dict[str, Any] = {"model": args.model, "plan": str(plan_path) if searched else None, "rounds": args.rounds,
                              "step": stats, "profile": profiles}
    plan_for_memory = plans.get("comp_searched", plans["comp_all_low"])
    report["calibration_memory"] = calibration_memory(model, x, y, plan_for_memory)
    report["plan_memory"] = plan_memory(model, x, y, plans)
    if not args.skip_attribution:
        report["attribution"] = attribution(model, x, y, args.rounds)
    out = RESULTS_DIR / f"compare_diagnose_{args.model}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    amp = stats["amp"]["min_ms"]
    print(f"{args.model}: step time (min over {args.rounds} interleaved rounds; ratio = AMP time / mode time)")
    for mode, s in stats.items():
        p = profiles[mode]
        print(f"  {mode:<18} min {s['min_ms']:8.1f} ms  median {s['median_ms']:8.1f} ms  speed vs AMP"
              f" {amp / s['min_ms']:.3f}  casts {p['cast_ms']:6.1f} ms ({p['to_copy_calls']} _to_copy)"
              f"  outside ops {p['outside_ops_ms']:6.1f} ms  hooked ops {p['hooked_operators']}")
    cm = report["calibration_memory"]
    print(f"  tensor peak per step with the plan (first = calibration/tracing step): "
          f"{[round((p or 0) / 2**20, 1) for p in cm['peak_delta_bytes_per_step']]} MiB;"
          f" extra in the first step {cm['first_step_extra_bytes'] / 2**20:.1f} MiB")
    pm = report["plan_memory"]
    print(f"  step peak tensor memory (MiB; masters + grads + AdamW state {pm['static_bytes'] / 2**20:.1f} MiB +"
          " in-step peak):")
    for label, m in pm.items():
        if isinstance(m, dict):
            print(f"    {label:<32} in-step {m['in_step_bytes'] / 2**20:7.1f}  step peak"
                  f" {m['step_peak_bytes'] / 2**20:7.1f}  vs AMP {m['vs_amp']:.3f}")
    if "attribution" in report:
        for label, a in report["attribution"].items():
            print(f"  batch stage {label}: accepted {len(a['accepted'])}/{len(a['operators'])}: {a['accepted']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
