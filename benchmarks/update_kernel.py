"""The managed optimizer step by parameter size: eager against compiled against native, per state format, against
torch's AdamW.

``benchmarks/update_speed.py`` times the whole update in training, on a model whose tensors are what they are; this
script separates the two costs that make it up: a compiled call's fixed cost (Dynamo's guards, the runtime wrapper)
and its cost per element. For each size it steps one parameter of that many elements through
:class:`~lightning_comp.execution.optimizer_states.OptimizerStates` (the plugin's own update) with a plan entry per
format, eagerly, compiled and natively (:mod:`lightning_comp.execution.native_adam`), and through
``torch.optim.AdamW`` (single-tensor and ``foreach``), in interleaved rounds,
each turn the median of ``--repeats`` steps, the first round left out (it compiles). Reported: microseconds per step
and nanoseconds per element, medians over rounds.

With ``--tensors K`` every configuration steps K parameters of each size (one optimizer, one step), and a
``native-per-tensor`` row steps them natively in one call per parameter (as the plugin did before it gathered every
managed parameter of a step into one native call): what that gathering buys on models of many tensors.

    python benchmarks/update_kernel.py                   # 4096 .. 4 M elements, 5 rounds
    python benchmarks/update_kernel.py --sizes 16384,262144 --tensors 32 --formats state-8bit,state-bf16
    python benchmarks/update_kernel.py --smoke           # two small sizes, for the test suite
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import RESULTS_DIR, interleaved_rounds, median, run_header, write_json, write_text  # noqa: E402

OUT_DIR = RESULTS_DIR / "update_kernel"
FORMATS = {"state-bf16": ("bf16", "fp32"), "state-8bit": ("8bit", "fp32"), "master-bf16": ("fp32", "bf16"),
           "8bit+master": ("8bit", "bf16")}
SIZES = (4096, 65536, 1 << 20, 1 << 22)


def _parameters(numel: int, tensors: int, dtype: Any = None) -> list[Any]:
    """``tensors`` parameters of ``numel`` elements, with gradients, of ``dtype`` (default FP32)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    params = []
    for _ in range(tensors):
        p = nn.Parameter(torch.randn(numel) * 0.1)
        if dtype is not None:
            p.data = p.data.to(dtype)
        p.grad = torch.randn_like(p) * 1e-2
        params.append(p)
    return params


def _plugin_step(numel: int, tensors: int, state: str, master: str, path: str) -> tuple[Callable[[], None], Any]:
    """One step of ``tensors`` parameters of ``numel`` elements, their state and master as given, on ``path``
    (``"native-per-tensor"``: natively, a call per parameter); and the ``OptimizerStates`` that steps them (its
    ``updates`` count the compiled and native steps)."""
    import torch

    from lightning_comp.execution.optimizer_states import OptimizerStates, ParameterTreatment
    from lightning_comp.execution.update_path import CompiledUpdates
    from lightning_comp.numerics.precision import MasterPrecision, StatePrecision

    params = _parameters(numel, tensors, torch.bfloat16 if master == "bf16" else None)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    states = OptimizerStates("native" if path == "native-per-tensor" else path)
    if path == "native-per-tensor":
        updates = states.updates
        updates.step_many = lambda steps: [  # type: ignore[method-assign]
            left for one in steps for left in CompiledUpdates.step_many(updates, [one])]
    treatment = ParameterTreatment(StatePrecision.parse(state), MasterPrecision.parse(master))
    states._treatments = {id(p): treatment for p in params}
    states._names = {id(p): f"w{index}" for index, p in enumerate(params)}

    def step() -> None:
        states.step(optimizer, optimizer.step)

    return step, states


def _torch_step(numel: int, tensors: int, foreach: bool) -> Callable[[], None]:
    import torch

    optimizer = torch.optim.AdamW(_parameters(numel, tensors), lr=1e-3, foreach=foreach)
    return lambda: optimizer.step()


def _timed(step: Callable[[], None], repeats: int) -> Callable[[], float]:
    """A turn: ``repeats`` steps, the median step's seconds."""
    def turn() -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        return median(times)

    return turn


def run_size(numel: int, args: argparse.Namespace) -> dict[str, Any]:
    tensors = args.tensors
    steps: dict[str, Callable[[], None]] = {"torch-adamw": _torch_step(numel, tensors, False),
                                            "torch-adamw-foreach": _torch_step(numel, tensors, True)}
    plugin_states: dict[str, Any] = {}
    paths = ("eager", "compiled", "native") + (("native-per-tensor",) if tensors > 1 else ())
    for name in args.formats:
        state, master = FORMATS[name]
        for path in paths:
            steps[f"{name}/{path}"], plugin_states[f"{name}/{path}"] = _plugin_step(numel, tensors, state, master,
                                                                                    path)
    for step in steps.values():
        step()  # creates the state (eagerly): the compiled path covers the steps after
    rounds = interleaved_rounds({k: _timed(s, args.repeats) for k, s in steps.items()}, args.rounds + 1)
    rows = {}
    for name, seconds in rounds.items():
        us = median(seconds[1:]) * 1e6
        rows[name] = {"us": us, "ns_per_element": us * 1e3 / (numel * tensors)}
        if name in plugin_states:
            rows[name]["compiled_steps"] = plugin_states[name].updates.compiled_steps
            rows[name]["native_steps"] = plugin_states[name].updates.native_steps
    print(f"[update_kernel] {numel}: " + ", ".join(f"{k} {v['us']:.0f} us" for k, v in rows.items()), flush=True)
    return rows


def markdown(report: dict[str, Any]) -> str:
    names = list(next(iter(report["sizes"].values())))
    tensors = report["settings"].get("tensors", 1)
    lines = [f"# The managed step by parameter size ({report['date']})", "",
             f"`{report['command']}` at {report['commit']}; {report['machine'].get('lscpu Model name', '?')}"
             f" ({report['machine']['device_class'].get('capability', '?')}), {report['torch_threads']} threads,"
             f" torch {report['torch']}; median over {report['settings']['rounds']} rounds of the median of"
             f" {report['settings']['repeats']} steps; {tensors} parameter(s) of each size per step."
             " Cells: us per step (ns per element).", "",
             "| configuration | " + " | ".join(f"{'' if tensors == 1 else f'{tensors} x '}{int(n):,} elements"
                                              for n in report["sizes"]) + " |",
             "|---|" + "---|" * len(report["sizes"])]
    for name in names:
        cells = [f"{size[name]['us']:.0f} ({size[name]['ns_per_element']:.2f})" for size in report["sizes"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="comma-separated element counts")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {list(FORMATS)}")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 5, --smoke 1)")
    parser.add_argument("--repeats", type=int, default=None, help="steps per turn (default 9, --smoke 2)")
    parser.add_argument("--tensors", type=int, default=1,
                        help="parameters of each size per step (default 1; above 1 adds native-per-tensor rows)")
    parser.add_argument("--smoke", action="store_true", help="sizes 4096 and 65536, 1 round of 2 steps")
    parser.add_argument("--out", default=str(OUT_DIR), help="results folder (default %(default)s)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes = "4096,65536"
    args.rounds = args.rounds or (1 if args.smoke else 5)
    args.repeats = args.repeats or (2 if args.smoke else 9)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.formats = args.formats.split(",")
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown or any(s % 256 or s < 4096 for s in args.sizes) or args.tensors < 1:
        parser.error(f"formats {unknown} unknown (valid: {list(FORMATS)}), sizes {args.sizes} not multiples of"
                     f" 256 of at least 4096 (8-bit moments need whole blocks), or --tensors {args.tensors} under 1")
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {**run_header("update_kernel.py", argv), "torch": torch.__version__,
                              "torch_threads": torch.get_num_threads(),
                              "settings": {"rounds": args.rounds, "repeats": args.repeats, "formats": args.formats,
                                           "tensors": args.tensors},
                              "sizes": {}}
    for numel in args.sizes:
        report["sizes"][str(numel)] = run_size(numel, args)
    write_json(out / "update_kernel.json", report)
    write_text(out / "update_kernel.md", markdown(report))
    print(markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
