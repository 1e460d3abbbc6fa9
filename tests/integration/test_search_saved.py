"""The search over the saved-for-backward dimension: decisions, group testing, NaN rejection, checkpoints.

Trials pin their candidates (``include_dimensions``, and a ``speed_margin`` no compute lowering can meet), so what they
show does not depend on how fast BF16 is on this CPU: the saved tensors of an FP32 plan are compressed by the same
elementwise codec on every CPU class.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

import lightning_comp.execution.saved_tensors as saved_tensors
from lightning_comp import CoMPPrecision, CoMPSearch
from lightning_comp.errors import SearchConfigError
from lightning_comp.numerics.codecs import CompressedTensor
from lightning_comp.numerics.precision import SavedPrecision
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.decisions.objectives import policy_for
from lightning_comp.search.measurement.clocks import single_intra_op_thread
from lightning_comp.search.measurement.estimates import RatioEstimate
from lightning_comp.search.record.text import format_record
from tests.helpers.search_models import Classifier, WideMLP, loaders, search_trainer


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_intra_op_thread():  # tiny models run faster on one thread of a shared machine; restored after
        yield


def pinned_saved_search(**kwargs: Any) -> CoMPSearch:
    """Saved lowering of l2, l3, l4 at fp8, trialled whatever is measured; compute is not searched (the same on every
    CPU class, emulated bf16 or native)."""
    kwargs.setdefault("include_dimensions", {"saved": ["l2", "l3", "l4"]})
    # only the saved dimension: tests/integration/test_search_parameters
    return CoMPSearch(objective="memory", low_precision="off", measurement={"speed_margin": 0.9, "profile_steps": 3},
                      precisions={"saved": "fp8", "state": "off", "master": "off"}, tolerance=0.01, verbose=False,
                      **kwargs)


def _estimate(ratio: float) -> RatioEstimate:
    return RatioEstimate(ratio, ratio * 0.97, ratio * 1.03, 6, 0.75)


def test_the_profiler_reports_which_operators_save_the_same_tensor() -> None:
    from lightning_comp.search.measurement.profiling import OperatorProfiler

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32)
    results = OperatorProfiler(model, "cpu", rounds=1, warmup=0).profile(
        {"fp32": lambda: None}, lambda: model(x).sum().backward())
    sharing = results["fp32"].sharing
    assert sharing["1"] == {"2"} and sharing["2"] == {"1"}  # ReLU saves its output, the Linear after it its input
    assert sharing["0"] == set()


def test_saved_search_options_are_validated_and_only_memory_and_balanced_use_them() -> None:
    def options(**settings: Any) -> tuple[SavedPrecision, ...]:
        return policy_for(SearchConfig(**settings)).saved_options

    assert options() == () and options(precisions={"saved": "fp8"}) == ()  # throughput chooses no saved precision
    assert options(objective="memory") == (SavedPrecision.FP8, SavedPrecision.BF16)
    assert options(objective="balanced", precisions={"saved": "bf16"}) == (SavedPrecision.BF16,)
    assert options(objective="memory", precisions={"saved": "off"}) == ()
    with pytest.raises(SearchConfigError,
                       match=r"precisions=\{'saved': 'fp4'\}.*'auto', 'off', 'fp8', 'bf16' or 'recompute'"):
        CoMPSearch(precisions={"saved": "fp4"})
    with pytest.raises(SearchConfigError, match="include_dimensions.*'saved'.*it needs 'auto', 'fp8' or 'bf16'"):
        CoMPSearch(precisions={"saved": "off"}, include_dimensions={"saved": ["l2"]})
    with pytest.raises(SearchConfigError, match="include_dimensions.*'saved'.*it needs 'auto', 'fp8' or 'bf16'"):
        CoMPSearch(precisions={"saved": "recompute"}, include_dimensions={"saved": ["l2"]})


# ------------------------------------------------------------------------------------------------ Trainer runs
@pytest.mark.slow
def test_group_testing_isolates_the_layer_whose_saved_tensors_break_convergence(tmp_path: Path) -> None:
    """``l3`` saves ``h + 4096``: stored at fp8 that loses ``h``, and its weight gradient becomes rounding noise
    (measured: val_loss 2.0516 against the reference's 2.0110, seed 0); l2 and l4 at fp8 end at 2.0110."""
    pl.seed_everything(0)
    search, plugin = pinned_saved_search(), CoMPPrecision()
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=plugin)
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    plan = plugin.plan
    assert {n: plan.of("saved", n).value for n in ("l2", "l3", "l4")} == {"l2": "fp8", "l3": "fp32", "l4": "fp8"}
    assert not plan.low_operators(trainer.lightning_module)  # compute stays fp32: only the saved dimension moved
    groups = [t.group for t in search.state.trials[1:]]
    l2, l3, l4 = (Candidate.saved(n) for n in ("l2", "l3", "l4"))
    assert groups[0] == (l2, l3, l4) and (l3,) in groups
    assert [t.verdict for t in search.state.trials if t.group == (l3,)] == ["fail"]
    record = search.record
    assert record is not None and record["saved_lowered"] == {"l2": "fp8", "l4": "fp8"}
    for name in ("l2", "l3", "l4"):
        entry = record["operators"][name]["saved"]
        # each saves its 256x256 input; l2 and l4 share theirs with the ReLU before them and are judged with it
        members = len(entry.get("group", [name]))
        assert members == (1 if name == "l3" else 2), entry
        assert entry["forced"] and entry["bytes"]["fp32"] == members * 256 * 256 * 4
        assert entry["bytes"]["fp8"] == members * 256 * 256  # a quarter (the 4-byte scale is not a saved tensor)
    # the plan travels in the checkpoint, and a resumed run restores it without searching again
    path = tmp_path / "done.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["lightning_comp"]["plan"]["saved"] == {"l2": "fp8", "l4": "fp8"}
    assert ckpt["callbacks"]["CoMPSearch"]["batch"]["saved"]["choices"] == {"l2": "fp8", "l3": "fp8", "l4": "fp8"}
    resumed_search, resumed_plugin = pinned_saved_search(), CoMPPrecision()
    resumed = search_trainer(tmp_path, [resumed_search], max_epochs=trainer.current_epoch + 1, plugin=resumed_plugin)
    resumed.fit(WideMLP(), *loaders(), ckpt_path=str(path))
    assert resumed_plugin.plan == plan and len(resumed_search.state.trials) == len(search.state.trials)
    assert resumed_plugin.executor.saved_tensors.compressed_bytes > 0  # the resumed epoch trained with it


@pytest.mark.slow
def test_a_nan_from_compression_is_caught_by_the_trials_nan_rejection(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A codec fault (NaN in what it stores) must reject every trial that uses it; training goes on without it."""
    real = saved_tensors.compress

    def faulty(tensor: torch.Tensor, saved: SavedPrecision) -> CompressedTensor:
        packed = real(tensor, saved)
        return CompressedTensor(packed.data.float().fill_(math.nan).to(packed.data.dtype), packed.dtype,
                                packed.inverse_scale)

    monkeypatch.setattr(saved_tensors, "compress", faulty)
    pl.seed_everything(0)
    search, plugin = pinned_saved_search(include_dimensions={"saved": ["l2", "l4"]}), CoMPPrecision()
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=plugin)
    trainer.fit(WideMLP(), *loaders())
    failed = [t for t in search.state.trials[1:] if t.verdict == "fail"]
    assert failed and all(t.reason == "NaN/Inf loss or metric" for t in failed)
    assert not [t for t in search.state.trials[1:] if t.verdict == "pass"]
    assert not plugin.plan.compresses_saved and search.state.chosen_label == "fp32 reference"
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


@pytest.mark.slow
def test_batch_stage_decides_saved_precision_from_measured_bytes(tmp_path: Path) -> None:
    pl.seed_everything(0)
    search = CoMPSearch(objective="memory", low_precision="bf16", max_slowdown_vs_fastest=100.0, verbose=False,
                        measurement={"profile_steps": 3}, tolerance=0.05, precisions={"state": "off", "master": "off"})
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=CoMPPrecision())
    trainer.fit(WideMLP(offset=False), *loaders())
    record = search.record
    assert record is not None
    for name in ("l2", "l3", "l4", "head"):
        entry = record["operators"][name]["saved"]
        computed = record["operators"][name].get("decision")
        # an operator lowered to bf16 already saves bf16: fp8 halves it, bf16 saves nothing
        full = entry["bytes"]["fp32"]
        assert full > 0 and entry["bytes"]["fp8"] <= full // 2 + 64, (name, computed, entry)
        # its saved input is the ReLU's output, which the ReLU saves too and may recompute: recomputed, the recipe
        # replaces every form of it; not, the ReLU keeps it as computed. The fp8 copy frees nothing either way, and
        # says so where its time did not refuse it first (a load spike can: "x2.20 [1.71, 1967.91] ... undecided in
        # time" in one suite run; the sharing rule itself is unit-tested in test_decisions.py)
        assert entry["decision"] == "fp32", (name, entry)
        assert "may recompute it" in entry["reason"] or "in time" in entry["reason"], (name, entry)
        # and its codec is not offered to the levers either (on cnn one was taken: 4 MiB more, not less)
        assert entry["held_by"], (name, entry)
        # its fp8 casts were timed directly (what the codec model is fitted on)
        assert entry["direct_ms"]["fp8"] > 0, (name, entry)
    for name in ("a1", "a2", "a3", "a4"):  # the cheap ones recompute (precisions saved "auto"), judged together
        entry = record["operators"][name]["saved"]
        assert entry["decision"] == "recompute" and entry["bytes"]["recompute"] < entry["bytes"]["fp32"], entry
    # the plan is timed whole once, by the spending (the saved stage has no whole-step check of its own)
    assert "saved_step" not in record
    spending = record["memory_spending"]
    assert spending["measured_ms"] is not None and spending["measured_ms"] <= spending["max_ms"]
    assert spending["given_back"] == []
    assert set(record["saved_lowered"]) <= {n for n in record["operators"]}
    held = ("l2", "l3", "l4", "head")  # each saves the output of the ReLU before it, which the ReLU saves too
    assert not any(option["value"] == "fp8" and label.split(":")[-1].split(" ")[-1] in held
                   for label, option in spending["taken"].items()), spending["taken"]
    # every codec's casts were timed directly: each is priced by its own, no model is fitted over them
    assert "fp8" not in spending["codec_costs"], spending["codec_costs"]
    assert "priced by their cost model" not in format_record(record)
    # what the bound is a multiple of is said (the pace's step, or the base's where the rounds cannot tell them apart)
    assert spending["bound_of"].startswith("the pace") or "could not tell from the pace" in spending["bound_of"]
    assert f"the bound of {spending['bound_of']}" in format_record(record)


def test_cheap_operators_recompute_unit_by_unit_when_the_step_pays(tmp_path: Path) -> None:
    """``precisions={"saved": "recompute"}``: each ReLU's output (the next Linear's saved input) is recomputed in
    backward instead of stored; each ReLU is a unit of its own (a Linear between two of them), judged on its own and
    its consumer's saved bytes and time, trialled, kept."""
    pl.seed_everything(0)
    search = CoMPSearch(objective="memory", low_precision="bf16", measurement={"speed_margin": 0.9, "profile_steps": 3},
                        precisions={"saved": "recompute", "state": "off", "master": "off"}, max_slowdown_vs_fastest=1e6,
                        verbose=False)
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=plugin)
    trainer.fit(WideMLP(offset=False), *loaders())
    record = search.record
    assert record is not None
    relus = ("a1", "a2", "a3", "a4")
    consumers = {"a1": "l2", "a2": "l3", "a3": "l4", "a4": "head"}
    for name in relus:
        entry = record["operators"][name]["saved"]
        assert entry["decision"] == "recompute", entry["reason"]
        assert "group" not in entry and f"judged in recompute unit {name}: " in entry["reason"], entry["reason"]
        assert f"its own and its consumers' ({consumers[name]})" in entry["reason"]
        # the ReLU saves its output, the Linear after it saves it too: one storage, freed whole
        assert entry["bytes"]["recompute"] == 0 < entry["bytes"]["fp32"], entry
    assert {n: plugin.plan.of("saved", n).value for n in relus} == dict.fromkeys(relus, "recompute")
    assert record["saved_lowered"] == dict.fromkeys(relus, "recompute")


class RepeatedBlocks(Classifier):
    """``blocks.{0,1,2}``, each ``ln -> fc -> act -> proj`` (LayerNorm, Linear, GELU, Linear) with a residual, then
    ``head``: the LayerNorms and the GELUs are cheap operators that play the same part in every block."""

    def __init__(self, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(64, width)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict(
            {"ln": torch.nn.LayerNorm(width), "fc": torch.nn.Linear(width, 2 * width), "act": torch.nn.GELU(),
             "proj": torch.nn.Linear(2 * width, width)}) for _ in range(depth))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block["proj"](block["act"](block["fc"](block["ln"](h))))
        return self.head(h)


def test_recompute_units_of_repeated_blocks_are_pooled_and_the_record_names_them(tmp_path: Path) -> None:
    """Trainer path: the LayerNorms of the three blocks are one unit pooled (``blocks.*.ln``), the GELUs another;
    each unit's bytes are its own and its consumers' (the Linear after it), and every decision's reason names the
    unit, those bytes and that time."""
    pl.seed_everything(0)
    # a unit must keep at most 60 % of its bytes (each keeps about half, with its consumers computing in fp32: compute
    # is not searched); x3 of the step is allowed, which recomputing these cheap operators meets
    search = CoMPSearch(objective="memory", low_precision="off", measurement={"speed_margin": 0.4, "profile_steps": 3},
                        precisions={"saved": "recompute", "state": "off", "master": "off"}, max_slowdown_vs_fastest=3.0,
                        verbose=False)
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=plugin)
    trainer.fit(RepeatedBlocks(), *loaders())
    record = search.record
    assert record is not None
    batch, width = 256, 128
    for part, consumer, freed in (("ln", "fc", batch * width * 4), ("act", "proj", batch * 2 * width * 4)):
        members = [f"blocks.{i}.{part}" for i in range(3)]
        for name in members:
            entry = record["operators"][name]["saved"]
            assert entry["decision"] == "recompute", entry["reason"]
            assert entry["group"] == members, entry
            reason = entry["reason"]
            assert f"judged in recompute unit blocks.*.{part} (x3): " in reason, reason
            assert "pooled over 3 units playing the same part in repeated blocks" in reason
            assert f"this operator's unit {name}: saved bytes, its own and its consumers'" in reason
            assert f"{name.rsplit('.', 1)[0]}.{consumer}" in reason and "their forward and backward x" in reason
            # what the unit frees is its consumer's saved input, one per block
            assert entry["bytes"]["fp32"] - entry["bytes"]["recompute"] == 3 * freed, entry
    assert {n for n, v in record["saved_lowered"].items() if v == "recompute"} == {
        f"blocks.{i}.{p}" for i in range(3) for p in ("ln", "act")}
    # each unit's lever is priced by its re-runs, timed directly in backward, one figure for the pooled unit
    taken = record["memory_spending"]["taken"]
    for part in ("ln", "act"):
        direct = {record["operators"][f"blocks.{i}.{part}"]["saved"]["direct_ms"]["recompute"] for i in range(3)}
        assert len(direct) == 1 and next(iter(direct)) > 0, direct
        reason = record["operators"][f"blocks.0.{part}"]["saved"]["reason"]
        assert "its re-runs timed directly: +" in reason and "on the whole steps' scale" in reason, reason
        label = next(label for label in taken if label.startswith(f"saved:blocks.0.{part} "))
        assert taken[label]["extra_ms"] == pytest.approx(next(iter(direct)), abs=1e-3), (label, taken[label])
