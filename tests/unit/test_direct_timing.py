"""The recompute levers' price, timed directly: each backward re-run of a recompute operator's forward is charged to
that operator, by the search's clock, step by step (no Trainer here: the executor runs the steps)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_comp import PrecisionPlan
from lightning_comp.errors import UsageError
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.search.measurement.clocks import ThreadCpuClock, WallClock
from lightning_comp.search.measurement.direct_timing import DirectTimes

SPIN_S = 0.02  # far above what a loaded machine adds to a tiny re-run's CPU time (4 ms seen under contention)


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


def _steps(plan: dict[str, Any], steps: int, clock: Any | None) -> tuple[DirectTimes | None, list[float]]:
    """``steps`` training steps of a fresh model under ``plan``, each timed by ``clock`` (``None``: untimed)."""
    model, executor = _model(), PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict(plan))
    times = None if clock is None else DirectTimes(clock)
    activate = (lambda: executor.step(StepKind.TRAIN)) if times is None else times.around(
        lambda timer: setattr(executor.recomputer, "unpack_timer", timer), lambda: executor.step(StepKind.TRAIN))
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
    times, losses = _steps(BOTH, 5, ThreadCpuClock())
    assert times is not None and len(times.steps) == 5, times
    assert all(set(step) == {"1", "3"} for step in times.steps), times.steps
    # the spinning GELU is re-run once per step: at least its spin, in the thread's CPU time, every step
    assert all(step["1"] >= SPIN_S * 1e3 for step in times.steps), times.steps
    # the plain one is re-run too, in far less once warm (a first step can spend 8 ms of CPU time setting up)
    spun, plain, both = times.median_ms(["1"], skip=1), times.median_ms(["3"], skip=1), times.median_ms(["1", "3"])
    assert spun is not None and plain is not None and both is not None
    assert spun >= SPIN_S * 1e3 > plain > 0, times.steps
    assert both == sorted(s["1"] + s["3"] for s in times.steps)[2]  # the median of the per-step sums
    assert times.median_ms(["1"], skip=4) == times.steps[4]["1"]  # warm-up steps left out
    assert times.median_ms(["0"]) == 0.0  # timed steps in which it re-ran nothing
    # timing the re-runs changes nothing the steps compute
    assert losses == _steps(BOTH, 5, None)[1]


def test_nothing_recomputed_nothing_timed() -> None:
    times, _ = _steps({}, 2, WallClock())
    assert times is not None and times.steps == [{}, {}] and times.median_ms(["1"]) == 0.0
    assert DirectTimes(WallClock()).median_ms(["1"]) is None  # no step timed
    assert times.median_ms(["1"], skip=2) is None


def test_a_codec_is_charged_its_compressions_and_decompressions() -> None:
    """Each operator saving bf16 or fp8 is charged what its own casts took, in the forward and in backward; an
    operator saving as computed is not charged."""
    plan = {"0": {"saved": "fp8"}, "2": {"saved": "bf16"}}
    model, executor = _model(), PlanExecutor(min_saved_bytes=0)
    executor.apply(model, PrecisionPlan.from_dict(plan))
    times = DirectTimes(ThreadCpuClock())
    reads: list[str] = []

    def install(timer: Any) -> None:
        if timer is None:
            executor.saved_tensors.codec_timer = None
            return

        def counted(name: str) -> Any:
            reads.append(name)
            return timer(name)

        executor.saved_tensors.codec_timer = counted

    activate = times.around(install, lambda: executor.step(StepKind.TRAIN))
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    with activate():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
    assert executor.saved_tensors.codec_timer is None and executor.saved_tensors.compressed_bytes > 0
    # each Linear saves its input: compressed once in the forward, decompressed once in backward
    assert sorted(reads) == ["0", "0", "2", "2"], reads
    assert set(times.steps[0]) == {"0", "2"} and all(ms > 0 for ms in times.steps[0].values()), times.steps


def test_a_price_is_its_share_of_the_step_timed_in_the_same_round() -> None:
    """The room is a share of a step the whole-step rounds timed: a price taken as a share of the step profiled in its
    own round does not move with the machine's load between the two measurements, a median time does."""
    times = DirectTimes(WallClock())
    # a warm-up step, then two quiet rounds and two in which the machine's load doubles every time
    times.steps = [{"a": 50.0, "b": 1.0}, {"a": 2.0}, {"a": 2.0, "b": 1.0}, {"a": 4.0}, {"a": 4.0, "b": 2.0}]
    reference = [100.0, 100.0, 200.0, 200.0]  # the plan without the lever, profiled in the same rounds
    assert times.median_share(["a"], reference, skip=1) == pytest.approx(0.02)
    assert times.median_ms(["a"], skip=1) == pytest.approx(3.0)  # the load's midpoint: no share of any one step
    # steps in which the work did not run count as a share of 0; several operators' work is summed per step
    assert times.median_share(["b"], reference, skip=1) == pytest.approx(0.005)
    assert times.median_share(["a", "b"], reference, skip=1) == pytest.approx(0.025)
    with pytest.raises(UsageError, match="3 reference steps for 4 timed steps"):
        times.median_share(["a"], reference[:3], skip=1)
