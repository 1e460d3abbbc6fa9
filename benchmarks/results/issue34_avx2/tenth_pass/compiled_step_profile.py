"""Where one parameter's compiled 8-bit managed step spends its time: the plugin's whole ``OptimizerStates.step``
(8-bit moments, FP32 weights) at 4096 and 1 Mi elements, its wall time (median of 20 steps) and torch.profiler's
table over 5 steps (Dynamo's cache lookup, AOTAutograd's wrapper, the compiled graph, the optimizer's own step).

    PYTHONPATH=. python benchmarks/results/issue34_avx2/tenth_pass/compiled_step_profile.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
from update_kernel import _plugin_step  # type: ignore[import-not-found]  # noqa: E402


def main() -> None:
    for numel in (4096, 1 << 20):
        step, _ = _plugin_step(numel, "8bit", "fp32", "compiled")
        for _ in range(3):
            step()  # creates the state, compiles, warms
        times = []
        for _ in range(20):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        print(f"{numel} elements: {statistics.median(times) * 1e6:.0f} us per step (wall, median of 20)")
        with torch.profiler.profile() as profile:
            for _ in range(5):
                step()
        print(profile.key_averages().table(sort_by="cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
