"""What Dynamo's guards cost a compiled managed step: one parameter's step (the plugin's ``OptimizerStates``, compiled
path) by size and format, with guards evaluated and with ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``,
in alternating turns of 15 steps (median), 5 turns each, the first left out.

    PYTHONPATH=. python benchmarks/results/issue34_avx2/tenth_pass/guard_cost_probe.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
from update_kernel import _plugin_step  # type: ignore[import-not-found]  # noqa: E402

Key = tuple[int, str, str]


def turn(steps: dict[Key, Callable[[], None]], skip: bool) -> dict[Key, float]:
    out = {}
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip):
        for key, step in steps.items():
            times = []
            for _ in range(15):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            out[key] = statistics.median(times) * 1e6
    return out


def main() -> None:
    steps: dict[Key, Callable[[], None]] = {}
    for numel in (4096, 65536, 1 << 20):
        for state, master in (("8bit", "fp32"), ("fp32", "bf16")):
            step, _ = _plugin_step(numel, state, master, "compiled")
            step()  # creates the state
            step()  # compiles
            steps[(numel, state, master)] = step
    rows: dict[bool, list[dict[Key, float]]] = {False: [], True: []}
    for _ in range(5):
        for skip in (False, True):
            rows[skip].append(turn(steps, skip))
    for key in steps:
        guarded = statistics.median(r[key] for r in rows[False][1:])
        skipped = statistics.median(r[key] for r in rows[True][1:])
        print(f"{key[0]:>8} elements, state {key[1]}, master {key[2]}: guards {guarded:.0f} us, skipped"
              f" {skipped:.0f} us, difference {guarded - skipped:.0f} us")


if __name__ == "__main__":
    main()
