"""The search over the optimizer-state and master-weight dimensions: decisions from measurements, group testing that
isolates a layer whose 8-bit state hurts convergence, the record, and the plan in the checkpoint.

Trials pin their candidates (``include_dimensions``, and a ``speed_margin`` no compute lowering can meet), so what they
show does not depend on how fast BF16 is on this CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

import lightning_comp.search.callback as callback_module
import lightning_comp.search.checks as checks_module
from lightning_comp import CoMPPrecision, CoMPSearch, Dimension
from lightning_comp.devices.device_classes import DeviceClass
from lightning_comp.errors import SearchConfigError
from lightning_comp.numerics.precision import ComputePrecision, MasterPrecision
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.config import LowPrecision
from lightning_comp.search.measurement.clocks import single_intra_op_thread
from lightning_comp.search.record.text import format_record
from tests.helpers.search_models import StateSensitiveMLP, WideMLP, loaders, search_trainer


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_intra_op_thread():
        yield


class ScheduledAdamW(WideMLP):
    """WideMLP trained by AdamW under a StepLR schedule (the schedule adds ``initial_lr`` to each group)."""

    def __init__(self) -> None:
        super().__init__(offset=False)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)}


def pinned_state_search(**kwargs: Any) -> CoMPSearch:
    """8-bit state of l2, l3, l4 trialled whatever is measured; no compute or saved lowering (compute is not
    searched, so what is tested is the same on every CPU class, emulated bf16 or native)."""
    kwargs.setdefault("include_dimensions", {"state": ["l2", "l3", "l4"]})
    kwargs.setdefault("precisions", {"saved": "off", "master": "off"})
    return CoMPSearch(objective="memory", low_precision="off", measurement={"speed_margin": 0.9, "profile_steps": 3},
                      tolerance=0.02, verbose=False, **kwargs)


def test_settings_are_validated() -> None:
    with pytest.raises(SearchConfigError, match=r"precisions=\{'state': '4bit'\}.*'auto', 'off', '8bit' or 'bf16'"):
        CoMPSearch(precisions={"state": "4bit"})
    with pytest.raises(SearchConfigError, match="include_dimensions.*'state'.*it needs 'auto', '8bit' or 'bf16'"):
        CoMPSearch(precisions={"state": "off"}, include_dimensions={"state": ["l2"]})
    with pytest.raises(SearchConfigError, match=r"precisions=\{'master': 'fp16'\}.*use 'auto', 'off' or 'bf16'"):
        CoMPSearch(precisions={"master": "fp16"})
    forced = CoMPSearch(precisions={"master": "bf16"}, include_dimensions={"master": ["l2"]}).config
    assert forced.tried(Dimension.MASTER) == (MasterPrecision.BF16,)
    assert forced.included(Dimension.MASTER).selectors == ("l2",)


@pytest.mark.slow
def test_group_testing_isolates_the_layer_whose_eight_bit_state_hurts(tmp_path: Path) -> None:
    pl.seed_everything(0)
    search, plugin = pinned_state_search(), CoMPPrecision()
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=plugin)
    trainer.fit(StateSensitiveMLP(), *loaders())
    plan = plugin.plan
    assert {n: plan.of("state", n).value for n in ("l2", "l3", "l4")} == {"l2": "8bit", "l3": "fp32", "l4": "8bit"}
    state = trainer.optimizers[0].state
    model = trainer.lightning_module
    assert state[model.l2.weight]["exp_avg"].dtype == torch.uint8  # the run trains on with the chosen plan
    assert state[model.l3.weight]["exp_avg"].dtype == torch.float32
    l2, l3, l4 = (Candidate.state(n) for n in ("l2", "l3", "l4"))
    groups = [t.group for t in search.state.trials[1:]]
    assert groups[0] == (l2, l3, l4) and (l3,) in groups
    assert [t.verdict for t in search.state.trials if t.group == (l3,)] == ["fail"]
    record = search.record
    assert record is not None
    for name in ("l2", "l3", "l4"):
        entry = record["operators"][name]["parameters"]
        steps = 2 * 4  # a step counter per parameter (weight and bias)
        assert entry["forced"] and entry["bytes"]["fp32"] == 2 * 4 * (256 * 256 + 256) + steps
        # the weight's two moments as codes and a scale per 256; the bias (256 elements) too small: fp32
        assert entry["bytes"]["8bit"] == 2 * (256 * 256 + 4 * 256) + 2 * 4 * 256 + steps
        assert set(entry["update_ms"]) >= {"fp32", "8bit", "bf16"}
    assert record["state_lowered"] == {"l2": "8bit", "l4": "8bit"}
    path = tmp_path / "done.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["lightning_comp"]["plan"]["state"] == {"l2": "8bit", "l4": "8bit"}
    batch = ckpt["callbacks"]["CoMPSearch"]["batch"]
    assert batch["parameters"]["state_choices"] == {"l2": "8bit", "l3": "8bit", "l4": "8bit"}


def test_the_batch_stage_judges_state_and_master_from_measurements(tmp_path: Path) -> None:
    """Unpinned, with any slowdown accepted: every operator owning 4096+ parameters gets a decision with bytes and
    update times, the smallest state format, and a bf16 master: with its compute lowered where that is a candidate,
    else computing in fp32 with fp32 copies (timed with their casts)."""
    pl.seed_everything(0)
    search = CoMPSearch(objective="memory", low_precision="bf16", precisions={"saved": "off"},
                        max_slowdown_vs_fastest=1e6,
                        verbose=False, measurement={"profile_steps": 3}, max_trials=2)
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=CoMPPrecision())
    trainer.fit(ScheduledAdamW(), *loaders())
    record = search.record
    assert record is not None
    decided = {n: op["parameters"] for n, op in record["operators"].items() if "parameters" in op}
    assert set(decided) == {"l1", "l2", "l3", "l4"}  # head: 2570 parameters, under the 4096 floor
    for name, entry in decided.items():
        assert entry["state"] == "8bit", entry["reason"]
        computes_low = record["operators"][name]["decision"] == "candidate"
        assert entry["master"] == "bf16", entry["reason"]
        timed = "master" if computes_low else "master+fp32 copies"
        assert timed in entry["time_ratio"] and entry["bytes"][timed] > 0, entry
        assert ("fp32 copies" in entry["reason"]) is not computes_low, entry["reason"]
    # the memory objective takes its levers cheapest bytes first, then times the plan whole once
    spending = record["memory_spending"]
    assert {f"state:{name}" for name in decided} <= set(spending["taken"])
    assert spending["stopped"].startswith("every lever that frees bytes is taken")
    frontier = spending["frontier"]
    assert all(b["step_mib"] < a["step_mib"] and b["step_ms"] >= a["step_ms"] for a, b in zip(frontier, frontier[1:]))
    assert spending["measured_ms"] is not None and spending["given_back"] == []


def test_low_precision_off_searches_memory_alone(tmp_path: Path) -> None:
    """``low_precision="off"``: no operator computes low in anything timed or trialled, only FP32 is timed as a whole
    step (no AMP's plan, no autocast region: FP32 is the pace), and the state levers are still taken."""
    pl.seed_everything(0)
    search = CoMPSearch(objective="memory", low_precision="off", precisions={"saved": "off", "master": "off"},
                        max_slowdown_vs_fastest=1e6, verbose=False, measurement={"profile_steps": 3}, max_trials=2)
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=plugin)
    trainer.fit(ScheduledAdamW(), *loaders())
    record = search.record
    assert record is not None and record["low_precision"] == "fp32"
    assert set(record["step_ms"]) == {"fp32"}
    assert all(op["decision"] == "fp32" and "low_precision='off'" in op["reason"]
               for op in record["operators"].values())
    assert not plugin.plan.low_operators(trainer.lightning_module)
    assert {plugin.plan.of("state", n).value for n in ("l1", "l2", "l3", "l4")} == {"8bit"}
    assert record["memory_spending"]["amp_step_mib"] is None
    for trial in search.state.trials:
        assert not PrecisionPlan.from_dict(trial.plan).low_operators(trainer.lightning_module)


def test_auto_where_no_16_bit_compute_pays_searches_memory_alone(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device where no 16-bit precision is native (an AVX2-only CPU here), ``low_precision="auto"`` with an
    objective that weighs memory searches as ``"off"`` does (it used to search nothing, so a memory search there
    freed no byte), and says why in the device's terms."""
    avx2 = DeviceClass("cpu", name="AMD EPYC", capability="AVX2",
                       emulated=frozenset({ComputePrecision.BF16, ComputePrecision.FP16}))
    monkeypatch.setattr(callback_module, "device_class", lambda device: avx2)
    told: list[str] = []
    monkeypatch.setattr(checks_module, "rank_zero_info", told.append)
    pl.seed_everything(0)
    search = CoMPSearch(objective="memory", precisions={"saved": "off", "master": "off"}, max_slowdown_vs_fastest=1e6,
                        verbose=False, measurement={"profile_steps": 3}, max_trials=2)
    assert search.config.low_precision is LowPrecision.AUTO
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=plugin)
    trainer.fit(ScheduledAdamW(), *loaders())
    record = search.record
    assert record is not None and record["low_precision"] == "fp32" and set(record["step_ms"]) == {"fp32"}
    assert not plugin.plan.low_operators(trainer.lightning_module)
    assert {plugin.plan.of("state", n).value for n in ("l1", "l2", "l3", "l4")} == {"8bit"}
    assert len(told) == 1, told
    assert told[0].startswith("CoMPSearch(objective='memory'): bf16 is emulated on this AVX2 CPU"), told
    assert told[0].endswith("so compute stays fp32 and only the memory dimensions are searched (saved for backward,"
                            " optimizer state)."), told
    first = format_record(record).splitlines()[0]
    assert "compute not searched (all " in first and "operators in fp32), " in first and "in 8bit" in first, first


@pytest.mark.parametrize(("settings", "match"), [
    ({}, r"low_precision='off'.*objective='memory' or 'balanced', not 'throughput'"),
    ({"objective": "memory", "precisions": {"saved": "off", "state": "off"}},
     r"low_precision='off'.*precisions\['saved'\] or precisions\['state'\] other than 'off'"),
    ({"objective": "memory", "include": ["l2"]}, r"include=\['l2'\].*never lowers"),
])
def test_low_precision_off_needs_a_memory_dimension_to_search(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(SearchConfigError, match=match):
        CoMPSearch(low_precision="off", **settings)


def test_balanced_takes_each_lever_that_makes_the_step_better_in_time_x_memory(tmp_path: Path) -> None:
    """The balanced objective spends cheapest bytes first too (it used to keep or drop the saved and the parameter
    lowerings all together, each by one whole step): along its frontier every lever taken lowers the step's bytes
    times its time, and a lever left out is left out for that reason (no time bound here)."""
    pl.seed_everything(0)
    search = CoMPSearch(objective="balanced", low_precision="off", max_slowdown_vs_fastest=1e6, verbose=False,
                        measurement={"profile_steps": 3}, max_trials=2)
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=CoMPPrecision())
    trainer.fit(ScheduledAdamW(), *loaders())
    record = search.record
    assert record is not None
    spending = record["memory_spending"]
    assert spending is not None and spending["target_mib"] is None
    frontier = spending["frontier"]
    for before, after in zip(frontier, frontier[1:]):
        assert after["step_mib"] < before["step_mib"]
        # (the record rounds MiB to 3 decimals and ms to 4: an increment freeing 0.9 % of the bytes for 0.9 % more
        # time read 36.4922 against 36.4922 MiB x ms, past by rounding alone)
        slack = 0.0005 * (before["step_ms"] + after["step_ms"]) + 0.00005 * (before["step_mib"] + after["step_mib"])
        assert after["step_mib"] * after["step_ms"] <= before["step_mib"] * before["step_ms"] + slack
    assert all("time x memory" in why for why in spending["skipped"].values())
    assert "saved_step" not in record and "check" not in record["parameter_step"]
