"""The managed optimizer step's cost in training: eager, compiled, native, per state format, against torch's AdamW.

Each configuration trains the suite's model (default ``gpt``, the default example's CharGPT) through the real
Trainer with ``CoMPPrecision(plan, update_path=...)``, in one process, in interleaved rounds (the first round, which
compiles, left out). A callback times every optimizer step from ``on_before_optimizer_step`` (the gradients are
ready) to ``on_train_batch_end`` (the managed update plus the optimizer's own step of the rest), and the whole
step from ``on_train_batch_start``. Reported per configuration: the update's median ms, ns per trainable parameter,
and the ratios of eager to compiled and of compiled to native measured in the same round. The
plans put every ``Linear`` in one format:

- ``state-bf16``: BF16 moments; ``state-8bit``: 8-bit moments (FP32 compute, FP32 weights);
- ``master-bf16``: BF16 compute and BF16 masters rounded stochastically (FP32 moments);
- ``8bit+master``: both.

``torch-adamw`` is torch's own FP32 step as the model configures it (single-tensor on a CPU, where ``foreach`` is
not the default), ``torch-adamw-foreach`` the same with ``foreach=True``: the floors. BF16 compute is emulated on an
AVX2-only CPU, so the ``master`` configurations' steps are slow there; their update is not.

    python benchmarks/update_speed.py                 # gpt, 3 rounds of 2 + 6 steps
    python benchmarks/update_speed.py --smoke         # a tiny model, for the test suite
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_suite import SUITE, smoke_spec  # noqa: E402
from compare_workers import _build, _quiet, _trainer_common  # noqa: E402
from harness import (  # noqa: E402
    RESULTS_DIR,
    interleaved_rounds,
    load_average,
    median,
    ratio_summary,
    run_header,
    write_json,
    write_text,
)

OUT_DIR = RESULTS_DIR / "update_speed"
PLANS: dict[str, dict[str, Any]] = {
    "state-bf16": {"type:Linear": {"state": "bf16"}},
    "state-8bit": {"type:Linear": {"state": "8bit"}},
    "master-bf16": {"type:Linear": {"compute": "bf16", "master": "bf16"}},
    "8bit+master": {"type:Linear": {"compute": "bf16", "state": "8bit", "master": "bf16"}},
}
PATHS = ("eager", "compiled", "native")  # on CUDA "native" compiles


@dataclass(frozen=True)
class Config:
    """One configuration: a plan (``None``: torch's own step) on an update path."""

    key: str
    plan: str | None
    path: str | None = None
    foreach: bool = False


def configurations(plans: list[str]) -> list[Config]:
    configs = [Config("torch-adamw", None), Config("torch-adamw-foreach", None, foreach=True)]
    configs += [Config(f"{plan}/{path}", plan, path) for plan in plans for path in PATHS]
    return configs


class _StepClock:
    """Times each optimizer step's update and the whole step (ms), skipping the first ``warmup`` steps."""

    def __init__(self, warmup: int) -> None:
        import lightning.pytorch as pl

        clock = self

        class Callback(pl.Callback):
            def on_train_batch_start(self, *args: Any) -> None:
                clock.step_start = time.perf_counter()

            def on_before_optimizer_step(self, *args: Any) -> None:
                clock.update_start = time.perf_counter()

            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                now = time.perf_counter()
                if trainer.global_step > warmup:
                    clock.update_ms.append((now - clock.update_start) * 1e3)
                    clock.step_ms.append((now - clock.step_start) * 1e3)

        self.callback = Callback()
        self.update_ms: list[float] = []
        self.step_ms: list[float] = []
        self.step_start = self.update_start = 0.0


class _Foreach:
    """Sets ``foreach=True`` on the optimizer the model configured (torch's multi-tensor step)."""

    def __new__(cls) -> Any:
        import lightning.pytorch as pl

        class Callback(pl.Callback):
            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                for optimizer in trainer.optimizers:
                    for group in optimizer.param_groups:
                        group["foreach"] = True

        return Callback()


def _turn(spec: dict[str, Any], config: Config, args: argparse.Namespace) -> dict[str, Any]:
    """One training run of ``config``: its update and step times."""
    import lightning.pytorch as pl
    import torch

    from lightning_comp import CoMPPrecision

    model, datamodule = _build(spec, args.seed)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    clock = _StepClock(args.warmup_steps)
    callbacks: list[Any] = [clock.callback] + ([_Foreach()] if config.foreach else [])
    plugins = [] if config.plan is None else [CoMPPrecision(PLANS[config.plan], update_path=config.path)]
    common = {**_trainer_common(), "enable_checkpointing": False}
    trainer = pl.Trainer(**common, max_steps=args.warmup_steps + args.steps, limit_val_batches=0,
                         plugins=plugins, callbacks=callbacks)
    trainer.fit(model, datamodule=datamodule)
    out: dict[str, Any] = {"update_ms": median(clock.update_ms), "step_ms": median(clock.step_ms),
                           "params": params}
    if config.plan is not None:
        states = trainer.precision_plugin._runtime.optimizer_states
        out["compiled_steps"] = states.updates.compiled_steps
        out["native_steps"] = states.updates.native_steps
        out["fallback"] = states.updates.failure
        out["native_fallback"] = states.updates.native_failure
    del trainer, model, datamodule
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def run_model(key: str, args: argparse.Namespace) -> dict[str, Any]:
    spec_obj = smoke_spec(SUITE[key]) if args.smoke else SUITE[key]
    spec = asdict(spec_obj)
    configs = configurations(args.plans)
    variants = {c.key: (lambda c=c: _turn(spec, c, args)) for c in configs}

    def progress(r: int, measured: dict[str, dict[str, Any]]) -> None:
        cells = ", ".join(f"{k} {v['update_ms']:.1f}" for k, v in measured.items())
        print(f"[update_speed] {key} round {r}: update ms {cells}", flush=True)

    rounds = interleaved_rounds(variants, args.rounds + 1, progress)
    measured = {name: runs[1:] for name, runs in rounds.items()}  # round 0 compiles
    params = measured[configs[0].key][0]["params"]
    rows: dict[str, Any] = {}
    for c in configs:
        runs = measured[c.key]
        update = median(r["update_ms"] for r in runs)
        rows[c.key] = {"plan": c.plan, "path": c.path, "update_ms": update, "ns_per_param": update * 1e6 / params,
                       "step_ms": median(r["step_ms"] for r in runs), "runs": runs}
    for plan in args.plans:
        eager, compiled = measured[f"{plan}/eager"], measured[f"{plan}/compiled"]
        rows[f"{plan}/compiled"]["eager_over_compiled"] = ratio_summary(
            [e["update_ms"] / c["update_ms"] for e, c in zip(eager, compiled)])
        rows[f"{plan}/native"]["compiled_over_native"] = ratio_summary(
            [c["update_ms"] / n["update_ms"] for c, n in zip(compiled, measured[f"{plan}/native"])])
    foreach = measured["torch-adamw-foreach"]
    for c in configs:
        rows[c.key]["over_torch_foreach"] = ratio_summary(
            [r["update_ms"] / f["update_ms"] for r, f in zip(measured[c.key], foreach)])
    return {"title": spec_obj.title, "params": params, "configs": rows}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# The managed optimizer step in training ({report['date']})", "",
             f"`{report['command']}` at {report['commit']}; {report['machine'].get('lscpu Model name', '?')}"
             f" ({report['machine']['device_class'].get('capability', '?')}),"
             f" {report['torch_threads']} threads, torch {report['torch']}, device {report['device']};"
             f" {report['settings']['rounds']} measured rounds of {report['settings']['steps']} steps.", ""]
    for key, model in report["models"].items():
        lines += [f"## {key}: {model['title']} ({model['params'] / 1e6:.2f} M parameters)", "",
                  "| configuration | update ms | ns / param | x torch foreach | eager / compiled | compiled / native"
                  " | step ms |",
                  "|---|---|---|---|---|---|---|"]
        for name, row in model["configs"].items():
            cells = []
            for column in ("eager_over_compiled", "compiled_over_native"):
                ratio = row.get(column)
                cells.append("" if ratio is None else f"{ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}]")
            torch_ratio = row["over_torch_foreach"]["median"]
            lines.append(f"| {name} | {row['update_ms']:.2f} | {row['ns_per_param']:.2f} | {torch_ratio:.2f} |"
                         f" {cells[0]} | {cells[1]} | {row['step_ms']:.1f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt", help=f"comma-separated, of {sorted(SUITE)}")
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of {list(PLANS)}")
    parser.add_argument("--smoke", action="store_true", help="the suite's tiny model, 1 round of 2 steps")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 3, --smoke 1)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 6, --smoke 2)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps of each run left out (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(OUT_DIR), help="results folder (default %(default)s)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.smoke else 3)
    args.steps = args.steps or (2 if args.smoke else 6)
    args.plans = args.plans.split(",")
    unknown = sorted(set(args.plans) - set(PLANS)) + sorted(set(args.models.split(",")) - set(SUITE))
    if unknown:
        parser.error(f"unknown plans or models {unknown}: plans are {list(PLANS)}, models {sorted(SUITE)}")
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    _quiet()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {**run_header("update_speed.py", argv), "torch": torch.__version__,
                              "torch_threads": torch.get_num_threads(),
                              "device": "cuda" if torch.cuda.is_available() else "cpu", "smoke": args.smoke,
                              "settings": {"rounds": args.rounds, "steps": args.steps,
                                           "warmup_steps": args.warmup_steps, "plans": args.plans},
                              "models": {}}
    for key in args.models.split(","):
        report["models"][key] = run_model(key, args)
    report["load_average_end"] = load_average()
    report["seconds"] = time.perf_counter() - started
    write_json(out / "update_speed.json", report)
    write_text(out / "update_speed.md", markdown(report))
    print(markdown(report), flush=True)
    bad = [f"{k}/{c}" for k, m in report["models"].items() for c, row in m["configs"].items()
           if not math.isfinite(row["update_ms"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
