"""fp8 where a GPU has it: per-Linear fp8/bf16 time over a range of shapes, and a short search of a ~100M model
against ``bf16-mixed`` and torchao's whole-model float8 conversions, trained side by side in one process.

Part ``linears``: for each ``(tokens, in, out)`` shape, one ``F.linear`` forward and backward in bf16 (bf16 input,
bf16 copy of the FP32 weight, as autocast computes it) against lightning-comp's fp8 path (torchao's float8 matmul,
tensorwise and rowwise), in interleaved rounds after warm-up; the median time of each and the ratio fp8/bf16.

Part ``training``: the zoo's CharGPT (width 768, 14 blocks: about 100M parameters) on the embedded text, each mode
trained for the same steps from the same seed and timed per step after warm-up (CUDA synchronised), with its final
validation loss:

- ``bf16-mixed``: Lightning's autocast;
- ``torchao-all``: ``convert_to_float8_training`` on every Linear fp8 kernels take, under ``bf16-mixed``;
- ``torchao-auto``: the same with torchao's own shape filter (``_auto_filter_for_recipe("tensorwise")``, the
  static rule written on H100), the head filtered as torchao's docs advise;
- ``comp``: the plan ``CoMPSearch(fp8="auto")`` chose in a short search on the same model and data (its cost
  reported), trained with ``CoMPPrecision(plan)``.

``--compile`` compiles the model's ``forward`` in the ``bf16-mixed`` and torchao modes (torchao's float8 is meant to
be compiled, which fuses its scaling and casts; lightning-comp's fp8 lowering runs eagerly). Without a GPU the script
runs on the CPU (``--device cpu``, where fp8 is emulated: no speed is meaningful there); ``--smoke`` shrinks every
size so the test suite can run it.

    python benchmarks/fp8_check.py --out benchmarks/results/gpu_check/fp8      # on a GPU
    python benchmarks/fp8_check.py --smoke --device cpu --out /tmp/fp8          # the test suite's smoke run
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import RESULTS_DIR, median, run_header, write_json, write_text  # noqa: E402

OUT_DIR = RESULTS_DIR / "gpu_check" / "fp8"
SHAPES = [(8192, 768, 768), (8192, 768, 3072), (8192, 3072, 768), (8192, 1024, 1024), (8192, 4096, 1024),
          (8192, 1024, 4096), (8192, 4096, 4096), (4096, 256, 256), (4096, 512, 512), (2048, 128, 128)]
SMOKE_SHAPES = [(48, 32, 64), (18, 64, 64)]
MODEL = {"width": 768, "depth": 14, "heads": 12, "block_size": 256}
SMOKE_MODEL = {"width": 64, "depth": 1, "heads": 2, "block_size": 32}
MODES = ("bf16-mixed", "torchao-all", "torchao-auto", "comp")


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_linears(device: str, shapes: list[tuple[int, int, int]], rounds: int, warmup: int) -> list[dict[str, Any]]:
    """Median forward+backward ms of each shape in bf16, fp8 (tensorwise) and fp8-rowwise, interleaved."""
    import torch
    import torch.nn.functional as F

    from lightning_comp.adapters.torchao_float8 import float8_linear

    rows = []
    for tokens, fan_in, fan_out in shapes:
        torch.manual_seed(0)
        x = torch.randn(tokens, fan_in, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.nn.Parameter(torch.randn(fan_out, fan_in, device=device) * fan_in**-0.5)
        grad = torch.ones(tokens, fan_out, device=device, dtype=torch.bfloat16)
        variants = {"bf16": lambda x=x, w=w: F.linear(x, w.to(torch.bfloat16)),
                    "fp8": lambda x=x, w=w: float8_linear(x, w, None, "tensorwise"),
                    "fp8-rowwise": lambda x=x, w=w: float8_linear(x, w, None, "rowwise")}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for index in range(warmup + rounds):
            for name, run in variants.items():
                x.grad, w.grad = None, None
                _sync(device)
                started = time.perf_counter()
                run().backward(grad)
                _sync(device)
                if index >= warmup:
                    times[name].append((time.perf_counter() - started) * 1e3)
        ms = {name: median(values) for name, values in times.items()}
        rows.append({"tokens": tokens, "in": fan_in, "out": fan_out, "ms": ms,
                     "fp8_over_bf16": ms["fp8"] / ms["bf16"], "rowwise_over_bf16": ms["fp8-rowwise"] / ms["bf16"]})
        print(f"[fp8] {tokens}x{fan_in}->{fan_out}: bf16 {ms['bf16']:.3f} ms, fp8 {ms['fp8']:.3f} ms"
              f" (x{rows[-1]['fp8_over_bf16']:.2f}), rowwise {ms['fp8-rowwise']:.3f} ms"
              f" (x{rows[-1]['rowwise_over_bf16']:.2f})", flush=True)
    return rows


class _StepClock:
    """Times every training step after ``warmup`` (synchronised on CUDA)."""

    def __init__(self, warmup: int) -> None:
        from lightning.pytorch.callbacks import Callback

        clock = self

        class Hook(Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                _sync(pl_module.device)
                clock.started = time.perf_counter()

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                   batch_idx: int) -> None:
                _sync(pl_module.device)
                if trainer.global_step > warmup:
                    clock.ms.append((time.perf_counter() - clock.started) * 1e3)

        self.callback = Hook()
        self.started = 0.0
        self.ms: list[float] = []


def _model_and_data(model_kwargs: dict[str, Any], data_kwargs: dict[str, Any], seed: int) -> tuple[Any, Any]:
    import lightning.pytorch as pl

    from lightning_comp.zoo import CharGPT, CharTextDataModule

    pl.seed_everything(seed, workers=True, verbose=False)
    data = CharTextDataModule(**data_kwargs)
    pl.seed_everything(seed, workers=True, verbose=False)
    return CharGPT(**model_kwargs), data


def _fp8_filter(auto: bool) -> Any:
    from torch import nn
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    if auto:
        return _auto_filter_for_recipe("tensorwise", filter_fqns=["head"])
    return lambda module, fqn: (isinstance(module, nn.Linear) and module.in_features % 16 == 0
                                and module.out_features % 16 == 0)


def search_plan(args: argparse.Namespace, model_kwargs: dict[str, Any], data_kwargs: dict[str, Any],
                out: Path) -> dict[str, Any]:
    """The plan a short ``CoMPSearch(fp8="auto")`` chooses for the model, and what the search cost."""
    import lightning.pytorch as pl

    from lightning_comp import CoMPPrecision, CoMPSearch

    model, data = _model_and_data(model_kwargs, data_kwargs, args.seed)
    search = CoMPSearch(fp8=args.search_fp8, measurement="quick", max_trials=args.max_trials,
                        trial_batches=args.trial_batches, record_dir=str(out / "search"), verbose=False)
    trainer = pl.Trainer(accelerator=args.device, devices=1, max_epochs=2 + args.max_trials,
                         limit_train_batches=args.search_batches, limit_val_batches=args.val_batches, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, plugins=[CoMPPrecision()], callbacks=[search])
    started = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - started
    record = search.record or {}
    plan = search.chosen_plan
    entries = {} if plan is None else {s: p.value for s, p in plan["compute"].entries}
    return {"plan": None if plan is None else plan.to_dict(), "entries": entries, "seconds": seconds,
            "fp8_candidates": (record.get("fp8_stage") or {}).get("candidates", {}),
            "trials": [(t.get("label"), t.get("verdict")) for t in record.get("trials", [])]}


def train_mode(mode: str, args: argparse.Namespace, model_kwargs: dict[str, Any], data_kwargs: dict[str, Any],
               plan: dict[str, Any] | None) -> dict[str, Any]:
    """``args.steps`` steps of ``mode``; its step times after warm-up and its last validation loss."""
    import lightning.pytorch as pl
    import torch
    from torch import nn

    from lightning_comp import CoMPPrecision, PrecisionPlan

    model, data = _model_and_data(model_kwargs, data_kwargs, args.seed)
    kwargs: dict[str, Any] = {}
    fp8_linears = 0
    if mode == "comp":
        if plan is None:
            return {"error": "the search chose no plan"}
        kwargs["plugins"] = [CoMPPrecision(PrecisionPlan.from_dict(plan))]
    else:
        kwargs["precision"] = "bf16-mixed"
        if mode.startswith("torchao"):
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model, module_filter_fn=_fp8_filter(mode == "torchao-auto"))
            fp8_linears = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        if args.compile:
            model.forward = torch.compile(model.forward)
    clock = _StepClock(args.warmup)
    trainer = pl.Trainer(accelerator=args.device, devices=1, max_steps=args.steps, limit_val_batches=args.val_batches,
                         val_check_interval=args.steps, check_val_every_n_epoch=None, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[clock.callback], **kwargs)
    trainer.fit(model, datamodule=data)
    if mode == "comp":
        resolved = trainer.precision_plugin.plan.resolve(model)  # type: ignore[attr-defined]
        fp8_linears = sum(1 for name, p in resolved.items() if p.is_fp8
                          and isinstance(dict(model.named_modules())[name], nn.Linear))
    step_ms = median(clock.ms) if clock.ms else math.nan
    return {"step_ms": step_ms, "steps_timed": len(clock.ms), "fp8_linears": fp8_linears,
            "val_loss": float(trainer.callback_metrics.get("val_loss", math.nan)),
            "params": sum(p.numel() for p in model.parameters())}


def report(result: dict[str, Any]) -> str:
    lines = ["# fp8 check", "", f"device: {result['device']}", "", "## Per Linear (forward + backward, median ms)", "",
             "| tokens | in | out | bf16 ms | fp8 ms | fp8/bf16 | rowwise ms | rowwise/bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result.get("linears", []):
        lines.append(f"| {r['tokens']} | {r['in']} | {r['out']} | {r['ms']['bf16']:.3f} | {r['ms']['fp8']:.3f} |"
                     f" {r['fp8_over_bf16']:.2f} | {r['ms']['fp8-rowwise']:.3f} | {r['rowwise_over_bf16']:.2f} |")
    training = result.get("training")
    if training:
        base = training["modes"].get("bf16-mixed", {}).get("step_ms", math.nan)
        lines += ["", f"## Training ({training['params'] / 1e6:.0f}M parameters, {training['steps']} steps)", "",
                  "| mode | step ms | throughput x bf16-mixed | fp8 Linears | val loss |", "|---|---|---|---|---|"]
        for mode, row in training["modes"].items():
            if "error" in row:
                lines.append(f"| {mode} | error: {row['error']} | | | |")
                continue
            lines.append(f"| {mode} | {row['step_ms']:.2f} | {base / row['step_ms']:.3f} | {row['fp8_linears']} |"
                         f" {row['val_loss']:.4f} |")
        search = training.get("search") or {}
        lines += ["", f"search: {search.get('seconds', math.nan):.0f} s, fp8 candidates"
                      f" {len(search.get('fp8_candidates', {}))}, trials {search.get('trials')}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--parts", default="linears,training")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    parser.add_argument("--compile", action="store_true", help="compile forward in the bf16-mixed/torchao modes")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--shapes", default="", help="per-Linear shapes TOKENSxINxOUT,... (default: the GPU set)")
    parser.add_argument("--search-fp8", default="auto", help="CoMPSearch(fp8=...) of the comp mode's search")
    parser.add_argument("--max-trials", type=int, default=3)
    parser.add_argument("--trial-batches", type=int, default=10)
    parser.add_argument("--search-batches", type=int, default=30)
    parser.add_argument("--val-batches", type=int, default=4)
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu (fp8 is emulated there; no speed is meaningful)")
        return 2
    warnings.filterwarnings("ignore")
    args.out.mkdir(parents=True, exist_ok=True)
    model_kwargs, shapes = (SMOKE_MODEL, SMOKE_SHAPES) if args.smoke else (MODEL, SHAPES)
    if args.shapes:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]  # type: ignore[misc]
    if args.smoke:
        args.steps, args.warmup, args.rounds, args.search_batches = 4, 1, 2, 4
        args.trial_batches, args.max_trials, args.val_batches = 2, 1, 1
    batch = 4 if args.smoke else 32  # 32 x 256 = 8192 tokens per step: the token count fp8 kernels are timed at
    data_kwargs = {"seq_len": model_kwargs["block_size"], "batch_size": batch,
                   "num_samples": (args.search_batches + args.steps + 8) * batch}
    device = (torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu")
    result: dict[str, Any] = {"header": run_header("fp8_check.py", argv), "device": device}
    parts = set(args.parts.split(","))
    if "linears" in parts:
        result["linears"] = time_linears(args.device, shapes, args.rounds, 3 if not args.smoke else 1)
        write_json(args.out / "fp8_check.json", result)
    if "training" in parts:
        modes = [m for m in args.modes.split(",") if m]
        unknown = sorted(set(modes) - set(MODES))
        if unknown:
            raise SystemExit(f"--modes: unknown {unknown}; choose from {list(MODES)}")
        search = search_plan(args, model_kwargs, data_kwargs, args.out) if "comp" in modes else None
        rows = {}
        for mode in modes:
            print(f"[fp8] training {mode} ...", flush=True)
            try:
                rows[mode] = train_mode(mode, args, model_kwargs, data_kwargs, (search or {}).get("plan"))
            except Exception as error:  # noqa: BLE001 - one failing mode is reported, the others still run
                rows[mode] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            print(f"[fp8] {mode}: {rows[mode]}", flush=True)
        params = next((r["params"] for r in rows.values() if "params" in r), 0)
        result["training"] = {"modes": rows, "search": search, "steps": args.steps, "params": params,
                              "compiled_baselines": args.compile}
    write_json(args.out / "fp8_check.json", result)
    text = report(result)
    write_text(args.out / "fp8_check.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
