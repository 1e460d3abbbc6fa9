"""The search times each optimizer-state and master variant on the code the plugin steps it with in training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_comp.execution.update_path import CompiledUpdates
from lightning_comp.numerics.precision import StatePrecision
from lightning_comp.search.measurement import optimizer_timing
from lightning_comp.search.measurement.clocks import WallClock
from lightning_comp.search.measurement.optimizer_timing import UpdateConfig, UpdateVariant, time_updates

CONFIGS = {UpdateVariant.FP32: UpdateConfig(None), UpdateVariant.INT8: UpdateConfig(StatePrecision.INT8),
           UpdateVariant.MASTER: UpdateConfig(StatePrecision.INT8, master=True)}


def _optimizer() -> tuple[torch.optim.Optimizer, dict[str, list[nn.Parameter]]]:
    torch.manual_seed(0)
    groups = {"a": [nn.Parameter(torch.randn(64, 128)), nn.Parameter(torch.randn(64))],
              "b": [nn.Parameter(torch.randn(128, 64))]}
    params = [p for ps in groups.values() for p in ps]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    optimizer.step()  # the run's own state, as after the search's warm-up
    return optimizer, groups


@pytest.mark.parametrize("path", ["eager", "compiled", "auto"])
def test_managed_variants_run_on_the_plugins_update_path_and_leave_the_run_untouched(path: str) -> None:
    """"auto" on a CPU: native, as training steps them, at any size (these groups hold 16 K elements, far under
    where "auto" would compile: before, the search timed them eagerly there)."""
    optimizer, groups = _optimizer()
    before = {id(p): (p.detach().clone(), {k: v.clone() for k, v in optimizer.state[p].items()})
              for ps in groups.values() for p in ps}
    updates = CompiledUpdates(path)
    times = time_updates(optimizer, groups, CONFIGS, WallClock(), rounds=2, warmup=0, updates=updates)
    assert set(times) == {"a", "b"}
    assert all(len(series) == 2 and all(t > 0 for t in series) for group in times.values()
               for series in group.values())
    # per managed variant (8-bit, master), 6 runs (2 prepared; 2 rounds of an untimed and a timed one): the weights
    # step compiled from the second run on (the first converts their moments to 8 bits), a's bias (too small to
    # quantise: FP32 moments, as the run's own) from the first: (5 + 5 + 6) x 2
    assert updates.compiled_steps == (32 if path == "compiled" else 0)
    assert updates.native_steps == (32 if path == "auto" else 0)
    for ps in groups.values():  # copies were stepped: the run's parameters and state are as they were
        for p in ps:
            weights, state = before[id(p)]
            assert torch.equal(p.detach(), weights)
            assert all(torch.equal(optimizer.state[p][k], v) for k, v in state.items())


def test_without_an_update_path_the_managed_variants_run_eagerly() -> None:
    optimizer, groups = _optimizer()
    times = time_updates(optimizer, groups, CONFIGS, WallClock(), rounds=1, warmup=1)
    assert set(times["a"]) == set(CONFIGS)


class _MarkingClock(WallClock):
    """A wall clock that marks in ``events`` each time it is read."""

    def __init__(self, events: list[tuple[str, ...]]) -> None:
        self.events = events

    def now(self) -> float:
        self.events.append(("clock",))
        return super().now()


def test_each_timed_update_follows_an_untimed_one_of_the_same_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed right after the other variants' updates, the FP32 update read slow (module docstring): every timed
    update is the second of two in a row of its own configuration, and only it is between the clock's reads."""
    events: list[tuple[str, ...]] = []

    def update(optimizer: object, name: str, params: object, hyper: object, config: UpdateConfig, updates: object,
               managed: int) -> object:
        return lambda: events.append(("run", name, repr(config)))

    monkeypatch.setattr(optimizer_timing, "_update", update)
    optimizer, groups = _optimizer()
    times = time_updates(optimizer, groups, CONFIGS, _MarkingClock(events), rounds=2, warmup=1)
    assert all(len(series) == 2 for group in times.values() for series in group.values())
    reads = [i for i, event in enumerate(events) if event == ("clock",)]
    assert len(reads) == 2 * 3 * len(CONFIGS) * len(groups)  # (1 + 2 rounds) x configurations x groups, start and end
    for start, end in zip(reads[::2], reads[1::2]):
        timed = events[start + 1:end]
        assert len(timed) == 1 and timed[0][0] == "run", events[start - 1:end + 1]
        assert events[start - 1] == timed[0], events[start - 1:end + 1]  # the same configuration of the same group
        assert start < 2 or events[start - 2] != timed[0]  # once untimed, not more


def test_a_master_of_an_fp32_operator_is_timed_with_its_fp32_copies_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each group is timed in the variants asked for it; the master variant of an operator computing in FP32 also
    makes, per timed update, the casts its FP32 copies cost training: two of each bf16 parameter to FP32 (forward, and
    backward's recast), one of each FP32 gradient to bf16."""
    optimizer, groups = _optimizer()
    configs = {**CONFIGS, UpdateVariant.MASTER_FP32_COPIES: UpdateConfig(StatePrecision.INT8, master=True,
                                                                         fp32_copies=True)}
    variants = {"a": {UpdateVariant.FP32, UpdateVariant.MASTER_FP32_COPIES}}
    casts: list[tuple[torch.dtype, torch.dtype]] = []
    real_to = torch.Tensor.to

    def counting_to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        out = real_to(self, *args, **kwargs)  # type: ignore[arg-type]
        if out.dtype != self.dtype:
            casts.append((self.dtype, out.dtype))
        return out

    times = time_updates(optimizer, groups, configs, WallClock(), rounds=1, warmup=0, variants=variants)
    assert set(times["a"]) == {UpdateVariant.FP32, UpdateVariant.MASTER_FP32_COPIES}
    assert set(times["b"]) == set(configs)  # not named: every variant
    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    hyper = {id(p): {k: v for k, v in optimizer.param_groups[0].items() if k != "params"} for p in groups["a"]}
    runs = {label: optimizer_timing._update(optimizer, "a", groups["a"], hyper, configs[label], None, 0)
            for label in (UpdateVariant.MASTER, UpdateVariant.MASTER_FP32_COPIES)}
    counts = {}
    for label, run in runs.items():
        casts.clear()
        run()
        counts[label] = (casts.count((torch.bfloat16, torch.float32)), casts.count((torch.float32, torch.bfloat16)))
    extra = (counts[UpdateVariant.MASTER_FP32_COPIES][0] - counts[UpdateVariant.MASTER][0],
             counts[UpdateVariant.MASTER_FP32_COPIES][1] - counts[UpdateVariant.MASTER][1])
    assert extra == (2 * len(groups["a"]), len(groups["a"]))
