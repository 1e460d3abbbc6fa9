"""How the calibrated cost model moves the batch stage's decisions: the same batch stage, old and new, side by side.

For each model of the suite (``benchmarks/compare_suite.py``), the batch stage of a ``CoMPSearch`` (BF16 pinned, the
default example's settings, one-batch trials) runs twice in one process, alternately, ``--repeats`` times each:

- ``old``: the cost model before it was calibrated: every lowered operator measured with its output cast back to
  FP32 (``measured_step(all_low, calibrated=False)``), no re-check at the candidate plan's boundaries, and no AMP plan
  among the whole-step alternatives;
- ``new``: the shipped batch stage.

It prints, per model, the operators whose own decision differs, with their measured BF16/FP32 time ratios, and the
whole-step times of each plan, and writes ``benchmarks/results/cost_model_shift.json``.

Usage::

    python benchmarks/cost_model_shift.py [--models cnn,gpt,litgpt] [--repeats 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from compare_suite import RESULTS_DIR, SUITE, smoke_spec  # (benchmarks/ is the script's own directory on sys.path)

from lightning_comp import CoMPPrecision, CoMPSearch, PrecisionPlan, zoo
from lightning_comp.search.stages import batch_stage


@contextlib.contextmanager
def old_cost_model() -> Iterator[None]:
    """The batch stage as it was: uncalibrated per-operator profile, no boundary re-check, no AMP alternative."""
    saved = (batch_stage.BatchStage._profile_operators, batch_stage.BatchStage._profile_at_boundaries,
             batch_stage.lowered_under_autocast)
    original_measured = CoMPPrecision.measured_step

    def uncalibrated(self: CoMPPrecision, plan: Any, *, calibrated: bool = True) -> Any:
        return original_measured(self, plan, calibrated=False)

    def profile(self: Any, *args: Any) -> Any:
        CoMPPrecision.measured_step = uncalibrated  # type: ignore[method-assign]
        try:
            return saved[0](self, *args)
        finally:
            CoMPPrecision.measured_step = original_measured  # type: ignore[method-assign]

    def no_recheck(self: Any, trainer: Any, pl_module: Any, step: Any, clock: Any, plan: PrecisionPlan) -> Any:
        return {"fp32": batch_stage.ProfileResult(), "plan": batch_stage.ProfileResult()}  # nothing to re-judge

    batch_stage.BatchStage._profile_operators = profile  # type: ignore[method-assign]
    batch_stage.BatchStage._profile_at_boundaries = no_recheck  # type: ignore[method-assign]
    batch_stage.lowered_under_autocast = lambda *args, **kwargs: frozenset()  # type: ignore[assignment]
    try:
        yield
    finally:
        (batch_stage.BatchStage._profile_operators, batch_stage.BatchStage._profile_at_boundaries,
         batch_stage.lowered_under_autocast) = saved  # type: ignore[method-assign]


def batch_stage_record(key: str, root: Path, seed: int, smoke: bool, old: bool) -> dict[str, Any]:
    """One search's decision record on suite model ``key`` (its batch stage and one one-batch trial); ``old``: with
    the tie rule of before (an alternative had to beat the candidates by the speed margin, 5 %)."""
    spec = smoke_spec(SUITE[key]) if smoke else SUITE[key]
    pl.seed_everything(seed, verbose=False)
    search = CoMPSearch(low_precision="bf16", warmup_epochs=0, trial_batches=1, verbose=False, record_dir=str(root),
                        tolerance=0.02, profile_steps=4, profile_warmup=1, switch_margin=0.05 if old else 0.02)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=1,
                         plugins=[CoMPPrecision()], callbacks=[search], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root))
    model = getattr(zoo, spec.model)(**spec.model_kwargs)
    trainer.fit(model, datamodule=getattr(zoo, spec.data)(**spec.data_kwargs))
    assert search.record is not None, "the search did not finish"
    return search.record


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """Per operator its own decision and ratio, the final plan and the whole-step times."""
    ops = {name: {"type": op["type"], "own": op.get("own_decision", op["decision"]), "final": op["decision"],
                  "ratio": op.get("time_ratio"), "in_plan_ratio": op.get("in_plan_time_ratio"),
                  "reason": op["reason"]}
           for name, op in record["operators"].items() if "time_ratio" in op}
    return {"operators": ops, "lowered": sorted(record["lowered_operators"]),
            "step_ms": {k: round(v, 2) for k, v in record["step_ms"].items()},
            "profiling_seconds": record["cost"]["profiling_seconds"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="cnn,gpt,litgpt")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="tiny models (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "cost_model_shift.json")
    args = parser.parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.models.split(","):
            runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
            for i in range(args.repeats):
                for label in ("old", "new"):
                    context = old_cost_model() if label == "old" else contextlib.nullcontext()
                    with context:
                        runs[label].append(summary(batch_stage_record(key, Path(tmp) / f"{key}-{label}-{i}", i,
                                                                      args.smoke, old=label == "old")))
            report[key] = runs
            old, new = runs["old"][-1], runs["new"][-1]
            print(f"== {key}: old lowered {len(old['lowered'])}, new {len(new['lowered'])};"
                  f" step ms old {old['step_ms']}, new {new['step_ms']}")
            for name, op in new["operators"].items():
                before = old["operators"].get(name)
                if before is not None and (before["own"], before["final"]) != (op["own"], op["final"]):
                    print(f"  {name:30s} {op['type']:12s} old {before['own']}/{before['final']} x{before['ratio']:.2f}"
                          f" -> new {op['own']}/{op['final']} x{op['ratio']:.2f}"
                          + (f" (at the plan's boundaries x{op['in_plan_ratio']:.2f})" if op["in_plan_ratio"] else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

