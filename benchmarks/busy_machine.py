"""Do the batch stage's decisions hold on a busy machine? Repeated quiet and busy runs of the same search.

Runs ``tests/scripts/busy_search.py``'s scenario (``BusyMLP``, BF16 pinned, the batch stage on a real Trainer)
``--repeats`` times on the quiet machine and as many times beside ``tests/scripts/competitor.py``'s processes (a
2-thread PyTorch matmul loop plus a Python spinner: every CPU busy), for each ``--timing`` setting. For each run it
keeps every operator's own decision, its measured ratio and interval, the clock used and the final plan.

An operator is *clear* when every quiet run measured it 1.5x or more from 1 (its whole interval, or, for records
without intervals, its ratio of minima). The report counts, per setting, the busy runs whose own decisions on clear
operators equal the quiet runs', the runs whose final plan equals the quiet runs' most common plan, and how often a
clearly slower operator became a candidate of its own.

Usage::

    python benchmarks/busy_machine.py [--repeats 5] [--timing auto,wall] [--out benchmarks/results]
    python benchmarks/busy_machine.py --scenario default_example --timing auto --tag default_example

``--scenario default_example`` runs the batch stage of the default example (``python examples/train.py``) instead.

``--timing none`` runs without the argument (for versions of the package that did not have it). Run under
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` to see the AVX2-only class on a newer CPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository: tests.scripts

from tests.scripts.busy_search import CLEAR, batch_stage_record, default_example_record  # noqa: E402
from tests.scripts.competitor import competing_load  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import RESULTS_DIR, median, run_header, write_json, write_text  # noqa: E402


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """What a run decided: per operator its own decision, ratio and interval; the clock; the final plan."""
    ops = {}
    for name, op in record["operators"].items():
        if "fp32" not in op or "low" not in op or op.get("kind") not in ("compute", "embedding", "other"):
            continue
        ratio = op.get("time_ratio", op["low"]["total_ms"] / max(op["fp32"]["total_ms"], 1e-9))
        ops[name] = {"own": op.get("own_decision", op["decision"]), "final": op["decision"], "ratio": ratio,
                     "spread": op.get("time_spread", [ratio, ratio]), "reason": op["reason"]}
    plan = sorted(record["lowered_operators"])
    return {"operators": ops, "plan": plan, "clock": (record.get("timing") or {}).get("clock", "wall (old)")}


def clear_set(quiet: list[dict[str, Any]]) -> dict[str, str]:
    """Operators every quiet run measured 1.5x or more from 1, and which way (``"slower"``/``"faster"``)."""
    out: dict[str, str] = {}
    names = set.intersection(*(set(r["operators"]) for r in quiet)) if quiet else set()
    for name in sorted(names):
        spreads = [r["operators"][name]["spread"] for r in quiet]
        if all(low >= CLEAR for low, _ in spreads):
            out[name] = "slower"
        elif all(high <= 1 / CLEAR for _, high in spreads):
            out[name] = "faster"
    return out


def analyse(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Agreement of busy runs with quiet runs on clear operators and on the final plan."""
    quiet, busy = runs["quiet"], runs["busy"]
    clear = clear_set(quiet)
    quiet_own = {name: collections.Counter(r["operators"][name]["own"] for r in quiet).most_common(1)[0][0]
                 for name in clear}
    plans = collections.Counter(tuple(r["plan"]) for r in quiet)
    usual_plan = list(plans.most_common(1)[0][0]) if plans else []

    def agreeing(group: list[dict[str, Any]]) -> int:
        return sum(all(r["operators"][n]["own"] == quiet_own[n] for n in clear) for r in group)

    slow_candidates = sum(1 for r in busy for n, way in clear.items()
                          if way == "slower" and r["operators"][n]["own"] == "candidate")
    return {
        "clear_operators": clear,
        "quiet_own_decisions": quiet_own,
        "quiet_runs_agreeing_on_clear": agreeing(quiet),
        "busy_runs_agreeing_on_clear": agreeing(busy),
        "quiet_plans": {",".join(p) or "(fp32)": c for p, c in plans.items()},
        "busy_plans": {",".join(p) or "(fp32)": c
                       for p, c in collections.Counter(tuple(r["plan"]) for r in busy).items()},
        "busy_runs_with_the_usual_quiet_plan": sum(r["plan"] == usual_plan for r in busy),
        "clearly_slower_operators_made_candidates_under_load": slow_candidates,
        "clocks": {"quiet": sorted({r["clock"] for r in quiet}), "busy": sorted({r["clock"] for r in busy})},
        "runs": len(busy),
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table."""
    m = report["machine"]
    machine = (f"{m.get('lscpu Model name', m['platform'])}, torch {m['torch']}, ATen CPU capability"
               f" {m['aten_cpu_capability']}, {m['torch_threads']} threads")
    lines = [f"Machine: {machine}; {report['repeats']} quiet and {report['repeats']} busy runs per setting;"
             f" load during busy runs: {report['busy_load']}.", "",
             "| timing | clocks (quiet / busy) | clear operators | own decisions on clear ops as quiet: quiet runs"
             " / busy runs | busy runs with the usual quiet plan | clearly slower ops made candidates under load |"
             " quiet plans | busy plans |",
             "|---|---|---|---|---|---|---|---|"]
    for setting, a in report["settings"].items():
        clear = ", ".join(f"{n} ({w})" for n, w in a["clear_operators"].items()) or "none"
        lines.append(
            f"| {setting} | {'/'.join(a['clocks']['quiet'])} / {'/'.join(a['clocks']['busy'])} | {clear} |"
            f" {a['quiet_runs_agreeing_on_clear']}/{a['runs']} / {a['busy_runs_agreeing_on_clear']}/{a['runs']} |"
            f" {a['busy_runs_with_the_usual_quiet_plan']}/{a['runs']} |"
            f" {a['clearly_slower_operators_made_candidates_under_load']} |"
            f" {json.dumps(a['quiet_plans'])} | {json.dumps(a['busy_plans'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timing", default="auto,wall", help="comma-separated: auto, wall, cpu, none")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tag", default="", help="suffix of the output files, e.g. avx2")
    parser.add_argument("--scenario", choices=["busy_mlp", "default_example"], default="busy_mlp",
                        help="busy_mlp: BusyMLP, BF16 pinned; default_example: the batch stage of examples/train.py")
    args = parser.parse_args(argv)
    run = batch_stage_record if args.scenario == "busy_mlp" else default_example_record
    settings = [s.strip() for s in args.timing.split(",") if s.strip()]
    report: dict[str, Any] = {
        **run_header("busy_machine.py", argv),
        "repeats": args.repeats, "scenario": args.scenario, "settings": {}, "raw": {},
    }
    loads = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for setting in settings:
            timing = None if setting == "none" else setting
            runs: dict[str, list[dict[str, Any]]] = {"quiet": [], "busy": []}
            for i in range(args.repeats):
                runs["quiet"].append(summarize(run(Path(tmp) / f"{setting}-q{i}", timing, seed=i)))
            with competing_load() as load:
                loads.append(load.others_cpus)
                for i in range(args.repeats):
                    runs["busy"].append(summarize(run(Path(tmp) / f"{setting}-b{i}", timing, seed=i)))
            report["settings"][setting] = analyse(runs)
            report["raw"][setting] = runs
            print(setting, json.dumps(report["settings"][setting], indent=1), flush=True)
    report["busy_load"] = (f"other processes used {median(x for x in loads if x is not None):.2f} CPUs"
                           if any(x is not None for x in loads) else "unknown")
    report["seconds"] = round(time.perf_counter() - started, 1)
    suffix = f"_{args.tag}" if args.tag else ""
    write_json(args.out / f"busy_machine{suffix}.json", report)
    write_text(args.out / f"busy_machine{suffix}.md", markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
