"""Per-operator attribution of the batch stage's profiler (structural checks, no wall-clock thresholds)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_comp.search.measurement.profiling import OperatorProfiler


def _profile(model: nn.Module) -> dict[str, float]:
    torch.manual_seed(0)
    x = torch.randn(64, 32)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    result = OperatorProfiler(model, "cpu", rounds=2, warmup=1).profile({"fp32": lambda: None}, step)["fp32"]
    return {name: m.backward_ms for name, m in result.operators.items()}


def test_operator_returning_its_input_is_not_charged_its_producers_backward() -> None:
    # Dropout(p=0) in training returns the very tensor it received; before the fix the Linear's backward
    # was charged to the Dropout and the Linear looked free.
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32), nn.Dropout(0.0), nn.Linear(32, 32)).train()
    backward = _profile(model)
    assert backward["3"] == 0.0  # the Dropout hooks nothing: it has no backward of its own
    assert backward["2"] > 0.0  # the Linear that produced the tensor keeps its backward
    assert backward["0"] > 0.0


def test_in_place_activation_does_not_steal_the_backward() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(inplace=True), nn.Linear(64, 32), nn.Identity(), nn.Linear(32, 8))
    backward = _profile(model)
    assert backward["1"] == 0.0 and backward["3"] == 0.0
    assert all(backward[name] > 0.0 for name in ("0", "2"))


def test_every_round_is_kept_paired_and_more_rounds_can_be_added_with_any_clock() -> None:
    from lightning_comp.search.measurement.clocks import ClockKind, make_clock, single_intra_op_thread
    from lightning_comp.search.measurement.step_timing import StepTimer

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(16, 32)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    configs = {"a": lambda: None, "b": lambda: None}
    with single_intra_op_thread():
        profiler = OperatorProfiler(model, make_clock(ClockKind.THREAD_CPU), rounds=3, warmup=1)
        results = profiler.profile(configs, step)
        assert [len(r.rounds) for r in results.values()] == [3, 3]
        profiler.extend(results, configs, step, 2)
    for result in results.values():
        assert len(result.rounds) == 5 and len(result.series("0")) == 5
        m = result.operators["0"]
        assert m.total_ms == min(r["0"].total_ms for r in result.rounds) or m.forward_ms > 0
        assert m.wall_ms > 0  # wall time kept beside the CPU time
        # each measured round's step kept in round order (what a time measured within a round is a share of)
        assert len(result.step_rounds) == 5 and min(result.step_rounds) == result.step_ms > 0
        assert min(result.step_rounds) >= sum(r.total_ms for r in result.rounds[result.step_rounds.index(
            result.step_ms)].values()) * 0.999  # a step holds its operators' times
    assert results["a"].series("missing") == [0.0] * 5
    timer = StepTimer("cpu", rounds=2, warmup=0)
    times = timer.time(configs, step)
    timer.time(configs, step, into=times, rounds=3, warmup=0)
    assert {k: len(v) for k, v in times.ms.items()} == {"a": 5, "b": 5} and times.wall_ms["a"] == times.ms["a"]


class _Slow(nn.Module):
    """A child whose forward takes 30 ms of wall time and no CPU (a sleep)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.03)
        return x * 1.0


class _Container(nn.Module):
    """Computes between its children: a matmul on its own weight, handed to a slow child, then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 256))
        self.slow = _Slow()
        self.out = nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.slow(torch.relu(x @ self.w)))


def test_a_functional_operator_is_charged_its_own_work_only() -> None:
    from lightning_comp.operators.owned_work import WorkRecorder
    from lightning_comp.search.measurement.clocks import ClockKind, make_clock

    model = nn.Sequential(nn.Linear(32, 32), _Container())
    x = torch.randn(64, 32)
    with WorkRecorder(model):  # the first step's trace: the container computes between its children
        model(x)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    result = OperatorProfiler(model, make_clock(ClockKind.WALL), rounds=2, warmup=1).profile(
        {"fp32": lambda: None}, step)["fp32"]
    ops = result.operators
    assert set(ops) == {"0", "1", "1.slow", "1.out"}
    assert ops["1.slow"].forward_ms >= 25.0  # the sleep is the child's
    assert ops["1"].forward_ms < ops["1.slow"].forward_ms  # ... and not counted again in the container's
    assert ops["1"].backward_ms > 0.0  # the backward of its matmul, from the slow child's input gradient on
    assert ops["1.out"].backward_ms > 0.0
