"""The parameter stage's update timing with and without an untimed update of the same configuration before each
timed one, side by side (default example's model, its 19 groups, after one AdamW step).

    PYTHONPATH=. python benchmarks/results/issue34_avx2/tenth_pass/update_timing_order_probe.py

For each set of configurations the search may time together (FP32 alone; FP32 and 8-bit; all four), twice in turn:
the sum over the groups of each configuration's median update, timed as before 524767c (each configuration right
after the previous one's timed update) and as :func:`time_updates` times it now.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
from compare_suite import SUITE  # type: ignore[import-not-found]  # noqa: E402
from compare_workers import _build  # type: ignore[import-not-found]  # noqa: E402

from lightning_comp.execution.update_path import CompiledUpdates  # noqa: E402
from lightning_comp.numerics.precision import StatePrecision  # noqa: E402
from lightning_comp.search.measurement import optimizer_timing  # noqa: E402
from lightning_comp.search.measurement.clocks import WallClock  # noqa: E402
from lightning_comp.search.measurement.optimizer_timing import UpdateConfig, UpdateVariant, time_updates  # noqa: E402

FP32, INT8, BF16, MASTER = UpdateVariant.FP32, UpdateVariant.INT8, UpdateVariant.BF16, UpdateVariant.MASTER
SETS = {"fp32 alone": {FP32: UpdateConfig(None)},
        "fp32 + 8-bit": {FP32: UpdateConfig(None), INT8: UpdateConfig(StatePrecision.INT8)},
        "all four": {FP32: UpdateConfig(None), INT8: UpdateConfig(StatePrecision.INT8),
                     BF16: UpdateConfig(StatePrecision.BF16), MASTER: UpdateConfig(StatePrecision.INT8, master=True)}}


def timed_as_before(optimizer: torch.optim.Optimizer, groups: Mapping[str, Sequence[nn.Parameter]],
                    configs: Mapping[UpdateVariant, UpdateConfig], rounds: int, warmup: int,
                    updates: CompiledUpdates) -> dict[str, dict[UpdateVariant, list[float]]]:
    """:func:`time_updates` before 524767c: each configuration's update timed right after the previous one's."""
    hyper = {id(p): {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
             for p in group["params"]}
    managed = sum(p.numel() for params in groups.values() for p in params)
    clock = WallClock()
    out: dict[str, dict[UpdateVariant, list[float]]] = {}
    for name, params in groups.items():
        runs = {label: optimizer_timing._update(optimizer, name, params, hyper, config, updates, managed)
                for label, config in configs.items()}
        series: dict[UpdateVariant, list[float]] = {label: [] for label in runs}
        for index in range(warmup + rounds):
            for label, run in runs.items():
                start = clock.now()
                run()
                end = clock.now()
                if index >= warmup:
                    series[label].append(clock.elapsed_ms(start, end))
        out[name] = series
    return out


def main() -> None:
    spec = SUITE["gpt"]
    model, _ = _build({"model": spec.model, "model_kwargs": spec.model_kwargs, "data": spec.data,
                       "data_kwargs": spec.data_kwargs}, 0)
    groups = {name: [p for p in module.parameters(recurse=False) if p.requires_grad]
              for name, module in model.named_modules()}
    groups = {name: params for name, params in groups.items() if params and sum(p.numel() for p in params) >= 4096}
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    print(f"{len(groups)} groups; sums over them of each configuration's median update (ms), 5 rounds after 2")
    for turn in range(2):
        for name, configs in SETS.items():
            for how, timer in (("as before", timed_as_before), ("now", None)):
                if timer is None:
                    times = time_updates(optimizer, groups, configs, WallClock(), 5, 2, CompiledUpdates("auto"))
                else:
                    times = timer(optimizer, groups, configs, 5, 2, CompiledUpdates("auto"))
                sums = {k.value: sum(statistics.median(s[k]) for s in times.values()) for k in configs}
                print(f"turn {turn} {name:13s} {how:9s}", "  ".join(f"{k} {v:6.2f}" for k, v in sums.items()),
                      flush=True)


if __name__ == "__main__":
    main()
