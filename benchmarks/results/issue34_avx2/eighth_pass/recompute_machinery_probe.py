"""Where the recompute hooks' time goes on the default example's CharGPT (batch 32 x 128), one process.

Three configurations side by side (nothing recomputed; the nine LayerNorms; the four GELUs), rounds in alternating
order, each step timed whole by the wall clock, with the recompute hooks' parts accumulated per step: the pack hook,
the recompute operators' pre- and post-hooks, and the re-runs in backward. Beside them, the operators' own forwards
alone (nine LayerNorms, four GELUs). Prints the medians after 3 warm-up rounds.

Usage: ``python recompute_machinery_probe.py [ROUNDS]`` (default 30).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import lightning_comp.execution.recompute.recipe as recipe_module
import lightning_comp.execution.recompute.recomputer as recomputer_module
from lightning_comp import PrecisionPlan
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.zoo import CharGPT

WARMUP = 3
PARTS = ("pack", "recompute", "pre", "post")
acc: dict[str, float] = dict.fromkeys(PARTS, 0.0)


def _timed(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            acc[part] += time.perf_counter() - start

    return timed


def _instrument() -> None:
    recomputer = recomputer_module.Recomputer
    recomputer._pack = _timed("pack", recomputer._pack)  # type: ignore[method-assign]
    recipe_module.Recipe._recompute = _timed("recompute", recipe_module.Recipe._recompute)  # type: ignore[method-assign]
    wrap = recomputer.wrap

    def wrapped(self: Any, op: Any, pre_hook: Any, post_hook: Any) -> tuple[Any, Any]:
        pre, post = wrap(self, op, pre_hook, post_hook)
        return _timed("pre", pre), _timed("post", post)

    recomputer.wrap = wrapped  # type: ignore[method-assign]


def main(rounds: int) -> None:
    _instrument()
    plans = {"none": {},
             "ln": {"blocks.*.ln1": {"saved": "recompute"}, "blocks.*.ln2": {"saved": "recompute"},
                    "ln_f": {"saved": "recompute"}},
             "act": {"blocks.*.mlp.act": {"saved": "recompute"}}}
    runs = {}
    for key, plan in plans.items():
        torch.manual_seed(0)
        model, executor = CharGPT(), PlanExecutor()
        executor.apply(model, PrecisionPlan.from_dict(plan))
        runs[key] = (model, executor)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (32, 128), generator=g), torch.randint(0, 256, (32, 128), generator=g)

    def step(key: str) -> None:
        model, executor = runs[key]
        with executor.step(StepKind.TRAIN):
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        with executor.recomputing():
            loss.backward()
        model.zero_grad(set_to_none=True)

    norm, z, h = torch.nn.LayerNorm(256), torch.randn(32, 128, 256), torch.randn(32, 128, 1024)

    def norms() -> None:
        with torch.no_grad():
            for _ in range(9):
                norm(z)

    def gelus() -> None:
        with torch.no_grad():
            for _ in range(4):
                F.gelu(h)

    work: dict[str, Callable[[], None]] = {key: (lambda key=key: step(key)) for key in plans}
    work.update({"9 ln fwd": norms, "4 gelu fwd": gelus})
    times: dict[str, list[float]] = {key: [] for key in work}
    parts: dict[str, list[dict[str, float]]] = {key: [] for key in plans}
    for index in range(rounds):
        order = list(work.items()) if index % 2 == 0 else list(work.items())[::-1]
        for key, run in order:
            acc.update(dict.fromkeys(PARTS, 0.0))
            start = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - start)
            if key in parts:
                parts[key].append(dict(acc))
    print("median ms", {k: round(statistics.median(v[WARMUP:]) * 1e3, 2) for k, v in times.items()})
    for key in ("ln", "act"):
        paired = [a - b for a, b in zip(times[key][WARMUP:], times["none"][WARMUP:], strict=True)]
        print(key, "whole-step paired difference, median ms", round(statistics.median(paired) * 1e3, 2))
    for key, measured in parts.items():
        print(key, {p: round(statistics.median(m[p] for m in measured[WARMUP:]) * 1e3, 3) for p in PARTS})


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
