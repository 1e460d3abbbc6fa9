"""CoMP against FP32, AMP (``bf16-mixed``), pure BF16 (``bf16-true``) and, where fast, ``16-mixed``: side by side.

One run of this script trains every model of a suite under every precision mode and writes a Markdown table, a JSON
record (plus the raw measurements), a CSV and PNG plots. CoMP runs in three modes, each with the plan of its own
search: ``comp`` (``objective="throughput"``, the shipped default), ``comp-balanced`` and ``comp-memory`` (which also
lower the precision of saved-for-backward tensors; the report's "Memory axis" table). Beside them trains the one-line
type rule a user would write, ``type-linear`` (``{"type:Linear": "bf16"}``, a fixed plan, no search); the report
compares CoMP with the best fixed policy that converges like FP32 and the batch stage's trialled plan and forecast with
what it measured and what training then ran (``## CoMP vs fixed policies and the batch stage's forecast``). Reproduce
``docs/benchmark.md`` with::

    python benchmarks/compare.py                   # full suite: ~7 min on 2 quiet CPU cores before the two
                                                   # memory-axis modes (two more searches per model: longer now)
    python benchmarks/compare.py --models cnn,gpt  # a subset
    python benchmarks/compare.py --models gpt,cnn --modes fp32,bf16-mixed,comp,comp-memory   # some modes only
    python benchmarks/compare.py --smoke           # tiny models, a few steps (integration/test_benchmark_smoke.py)
    python benchmarks/compare.py --compile         # every mode with torch.compile'd forward (Inductor): FP32, AMP
                                                   # and CoMP, graph breaks counted (results/compile/)
    python benchmarks/compare.py --reanalyse benchmarks/results/compare_raw.json.gz   # re-render without measuring

How each number is measured: ``compare_run.py``. The other pieces: ``compare_suite.py`` (models, modes, paths),
``compare_workers.py`` (the worker processes and their coordinator), ``compare_probes.py`` (what a worker measures),
``compare_analysis.py`` (throughput, ratios, targets), ``compare_searches.py`` (what each CoMP search cost and
chose), ``compare_report.py`` (Markdown, CSV, JSON, console lines) and
``compare_plots.py`` (PNG plots).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from compare_analysis import reanalyse
from compare_report import markdown, print_ratios, write_outputs
from compare_run import run_benchmark
from compare_suite import DEFAULT_MODELS, IMG_DIR, MODES, RESULTS_DIR, SUITE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line and fill in the default output folders.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The options; ``out`` and ``img`` are always set (``--smoke`` writes under ``results/compare_smoke``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None,
                        help=f"comma-separated keys of {sorted(SUITE)}, 'default' ({','.join(DEFAULT_MODELS)})"
                             " or 'all'")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--smoke", action="store_true", help="tiny models and a few steps (seconds per model)")
    parser.add_argument("--compile", action="store_true",
                        help="compile every model's forward with torch.compile (Inductor) in every mode and search;"
                             " modes default to fp32,bf16-mixed,comp; outputs under results/compile")
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply every model's step count")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in every worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for any one worker answer")
    parser.add_argument("--out", default=None, help="directory of the JSON/CSV/Markdown (default benchmarks/results,"
                                                   " or benchmarks/results/compare_smoke with --smoke)")
    parser.add_argument("--img", default=None, help="directory of the PNG plots (default docs/img, or --out with"
                                                   " --smoke)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--reanalyse", default=None, metavar="RAW_JSON",
                        help="rebuild the outputs from a compare_raw.json.gz instead of measuring")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler step per mode")
    parser.add_argument("--wait-quiet", type=float, default=0.0,
                        help="wait up to this many minutes for the 1-minute load average to fall below --quiet-load")
    parser.add_argument("--quiet-load", type=float, default=1.5)
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(RESULTS_DIR / "compare_smoke") if args.smoke else str(RESULTS_DIR)
        if args.compile:
            args.out = str(Path(args.out) / "compile")
    if args.img is None:
        args.img = args.out if args.smoke or args.compile else str(IMG_DIR)
    return args


def wait_quiet(minutes: float, threshold: float) -> None:
    """Wait until the 1-minute load average falls below ``threshold``, for ``minutes`` at most.

    Args:
        minutes: The longest wait.
        threshold: The load average to wait for.
    """
    deadline = time.monotonic() + 60 * minutes
    while True:
        load = os.getloadavg()[0]
        if load < threshold or time.monotonic() >= deadline:
            print(f"[compare] 1-min load average {load:.2f} (threshold {threshold}); starting", flush=True)
            return
        print(f"[compare] 1-min load average {load:.2f} >= {threshold}; waiting ...", flush=True)
        time.sleep(min(60.0, max(1.0, deadline - time.monotonic())))


def main(argv: list[str] | None = None) -> int:
    """Measure (or re-analyse a raw record), write every output and print the tables, ratios and targets.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 1 where a run or a search failed, else 0.
    """
    args = parse_args(argv)
    if args.wait_quiet > 0:
        wait_quiet(args.wait_quiet, args.quiet_load)
    report = reanalyse(Path(args.reanalyse)) if args.reanalyse else run_benchmark(args)
    paths = write_outputs(report, Path(args.out), Path(args.img), "compare", not args.no_plots)
    print("\n" + markdown(report))
    print_ratios(report)
    print("\nwrote:\n  " + "\n  ".join(str(p) for p in paths))
    failed = [f"{k}/{m}" for k, model in report["models"].items() for m, e in model["modes"].items() if "error" in e]
    failed += [f"{k}/search" for k, model in report["models"].items() if "error" in model["search"]
               and model["search"]["error"] != "CoMP not benchmarked"]
    failed += [f"{k}/{m} search" for k, model in report["models"].items()
               for m, s in model.get("searches", {}).items() if "error" in s]
    if failed:
        print(f"\nfailed runs: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
