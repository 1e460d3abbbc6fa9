"""The recompute levers' price, timed directly: each backward re-run of a recompute operator's forward is charged to
that operator, by the search's clock, step by step (no Trainer here: the executor runs the steps)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_comp import PrecisionPlan
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.search.measurement.clocks import ThreadCpuClock, WallClock
from lightning_comp.search.measurement.recompute_timing import RecomputeTimes

SPIN_S = 0.004


class SpinningGELU(nn.GELU):
    """A GELU whose forward keeps the CPU busy for ``SPIN_S`` of this thread's CPU time: its re-run costs that."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        until = time.thread_time() + SPIN_S
        while time.thread_time() < until:
            pass
        return super().forward(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), SpinningGELU(), nn.Linear(32, 8), nn.GELU(), nn.Linear(8, 2))


def _steps(plan: dict[str, Any], steps: int, clock: Any | None) -> tuple[RecomputeTimes | None, list[float]]:
    """``steps`` training steps of a fresh model under ``plan``, each timed by ``clock`` (``None``: untimed)."""
    model, executor = _model(), PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict(plan))
    times = None if clock is None else RecomputeTimes(clock)
    activate = (lambda: executor.step(StepKind.TRAIN)) if times is None else times.around(
        executor.recomputer, lambda: executor.step(StepKind.TRAIN))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
        with activate():
            loss = F.cross_entropy(model(x), y)
            with executor.recomputing():
                loss.backward()
        losses.append(float(loss))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        model.zero_grad(set_to_none=True)
    assert executor.recomputer.unpack_timer is None  # set for the timed steps only
    return times, losses


BOTH = {"1": {"saved": "recompute"}, "3": {"saved": "recompute"}}


def test_each_re_run_is_charged_to_its_operator_step_by_step() -> None:
    times, losses = _steps(BOTH, 3, ThreadCpuClock())
    assert times is not None and len(times.steps) == 3, times
    assert all(set(step) == {"1", "3"} for step in times.steps), times.steps
    # the spinning GELU is re-run once per step: at least its spin, in the thread's CPU time; the plain one is not
    assert all(step["1"] >= SPIN_S * 1e3 > step["3"] for step in times.steps), times.steps
    spun, plain, both = times.median_ms(["1"]), times.median_ms(["3"]), times.median_ms(["1", "3"])
    assert spun is not None and plain is not None and both is not None
    assert both == sorted(s["1"] + s["3"] for s in times.steps)[1]  # the median of the per-step sums
    assert times.median_ms(["1"], skip=2) == times.steps[2]["1"]  # warm-up steps left out
    assert times.median_ms(["0"]) == 0.0  # timed steps in which it re-ran nothing
    # timing the re-runs changes nothing the steps compute
    assert losses == _steps(BOTH, 3, None)[1]


def test_nothing_recomputed_nothing_timed() -> None:
    times, _ = _steps({}, 2, WallClock())
    assert times is not None and times.steps == [{}, {}] and times.median_ms(["1"]) == 0.0
    assert RecomputeTimes(WallClock()).median_ms(["1"]) is None  # no step timed
    assert times.median_ms(["1"], skip=2) is None
