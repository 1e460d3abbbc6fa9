"""Recompute judged unit by unit (lightning_comp/search/decisions/recompute_units.py, and its use in the saved stage).

The profiles here are synthetic (ProfileResult built by hand, rounds with a fixed spread), so the partition, the
attribution of consumers and the judgement are tested without this noisy CPU's timing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_comp import PrecisionPlan
from lightning_comp.errors import UsageError
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.numerics.precision import SavedPrecision
from lightning_comp.operators.kinds import classify
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.decisions.batch_result import SavedStageResult
from lightning_comp.search.decisions.objectives import policy_for
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.recompute_units import (
    RecomputeUnit,
    block_of,
    judge_units,
    measure_units,
    pool_units,
    recompute_units,
    undecided_units,
    unit_label,
)
from lightning_comp.search.measurement.profiling import OperatorMeasurement, OperatorProfiler, ProfileResult
from lightning_comp.search.stages.saved_stage import SavedStage

ROUNDS = 6
SPREAD = (1.0, 1.01, 0.99, 1.02, 0.98, 1.0)  # per-round factor: the paired ratio's interval is a few percent wide


def profile(ops: dict[str, tuple[int, int, float]], order: list[str] | None = None,
            sharing: dict[str, set[str]] | None = None) -> ProfileResult:
    """A profile of ``ops``: name -> (own saved bytes, first-saver saved bytes, forward+backward ms)."""
    rounds = [{name: OperatorMeasurement(forward_ms=ms * SPREAD[i], saved_bytes=first, own_saved_bytes=own, calls=1)
               for name, (own, first, ms) in ops.items()} for i in range(ROUNDS)]
    operators = {name: OperatorMeasurement(forward_ms=ms * min(SPREAD), saved_bytes=first, own_saved_bytes=own,
                                           calls=1) for name, (own, first, ms) in ops.items()}
    return ProfileResult(operators=operators, order=list(order or ops), rounds=rounds, sharing=dict(sharing or {}))


# ------------------------------------------------------------------------------------------------ partition
@pytest.mark.parametrize(("name", "block"), [
    ("blocks.3.mlp.act", "blocks.3"), ("features.0.1.1", "features.0.1"), ("features.0.2", "features.0"),
    ("layers.0.blocks.1.norm", "layers.0.blocks.1"), ("net.1", None), ("ln_f", None), ("head", None),
])
def test_block_of_is_the_innermost_repeated_block(name: str, block: str | None) -> None:
    assert block_of(name) == block


def test_unit_labels_name_the_members_by_their_common_path() -> None:
    assert unit_label(["blocks.3.ln1"]) == "blocks.3.ln1"
    assert unit_label(["features.0.1.1", "features.0.1.2", "features.0.2"]) == "features.0.{1.1, 1.2, 2}"
    assert unit_label(["tok_emb", "pos_emb"]) == "{tok_emb, pos_emb}"
    assert unit_label(["a.x", "a"]) == "{a.x, a}"  # every member keeps a part of its own


def test_units_are_runs_between_other_operators_and_split_between_repeats_of_a_block() -> None:
    # a pre-norm transformer with dropout: the MLP's dropout ends block 0, block 1's LayerNorm starts the next one
    order = ["tok_emb", "pos_emb", "drop", "blocks.0.ln1", "blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.attn.proj",
             "blocks.0.ln2", "blocks.0.mlp.fc", "blocks.0.mlp.act", "blocks.0.mlp.proj", "blocks.0.mlp.drop",
             "blocks.1.ln1", "blocks.1.attn", "blocks.1.attn.qkv", "blocks.1.attn.proj", "blocks.1.ln2",
             "blocks.1.mlp.fc", "blocks.1.mlp.act", "blocks.1.mlp.proj", "blocks.1.mlp.drop", "ln_f", "head"]
    cheap = {"tok_emb", "pos_emb", "drop", "ln_f"} | {f"blocks.{i}.{p}" for i in (0, 1)
                                                     for p in ("ln1", "ln2", "mlp.act", "mlp.drop")}
    units = [u.members for u in recompute_units(order, cheap, {})]
    assert units == [
        ("tok_emb", "pos_emb", "drop", "blocks.0.ln1"),  # entering a block does not split (drop's output is its input)
        ("blocks.0.ln2",), ("blocks.0.mlp.act",), ("blocks.0.mlp.drop",),  # the next repeat starts a new unit
        ("blocks.1.ln1",), ("blocks.1.ln2",), ("blocks.1.mlp.act",), ("blocks.1.mlp.drop", "ln_f")]


def test_a_chain_across_blocks_stays_one_unit() -> None:
    # the zoo cnn: ConvBN blocks (conv, bn, relu) in stages, a MaxPool after each stage, then pool, flatten, head
    order = ["f.0.0.0", "f.0.0.1", "f.0.0.2", "f.0.1.0", "f.0.1.1", "f.0.1.2", "f.0.2",
             "f.1.0.0", "f.1.0.1", "f.1.0.2", "pool", "flatten", "head"]
    cheap = {"f.0.0.1", "f.0.0.2", "f.0.1.1", "f.0.1.2", "f.0.2", "f.1.0.1", "f.1.0.2", "pool"}
    units = [u.members for u in recompute_units(order, cheap, {"f.0.2": {"f.0.1.2"}})]
    # the MaxPool (in block f.0) computes on the ReLU of block f.0.1; the pool leaves block f.1.0; flatten ends a run
    assert units == [("f.0.0.1", "f.0.0.2"), ("f.0.1.1", "f.0.1.2", "f.0.2"), ("f.1.0.1", "f.1.0.2", "pool")]
    # between two repeats of a block only a shared saved tensor (a chain) keeps the run going
    order = ["s.0.relu", "s.1.relu", "s.2.relu"]
    split = recompute_units(order, set(order), {"s.1.relu": {"s.0.relu"}, "s.0.relu": {"s.1.relu"}})
    assert [u.members for u in split] == [("s.0.relu", "s.1.relu"), ("s.2.relu",)]


# ------------------------------------------------------------------------------------------------ measurement
def test_consumers_are_attributed_and_the_units_changes_add_up_to_the_step() -> None:
    """act's output is fc2's saved input (fc2 is its consumer); relu saves its output, shared with conv (its
    consumer, found by the sharing); the container's own work saves its child block.norm's output (attributed to the
    unit inside it, though it runs first)."""
    order = ["block", "fc1", "act", "fc2", "conv0", "relu", "conv", "block.norm", "mix"]
    sharing = {"relu": {"conv"}, "conv": {"relu"}}
    before = profile({"block": (300, 300, 1.0), "fc1": (100, 100, 1.0), "act": (400, 400, 0.2),
                      "fc2": (400, 400, 2.0), "conv0": (50, 50, 1.0), "relu": (200, 200, 0.1), "conv": (200, 0, 3.0),
                      "block.norm": (300, 0, 0.3), "mix": (10, 10, 0.5)}, order, sharing)
    after = profile({"block": (0, 0, 1.2), "fc1": (100, 100, 1.0), "act": (400, 400, 0.3), "fc2": (0, 0, 2.1),
                     "conv0": (50, 50, 1.0), "relu": (0, 0, 0.2), "conv": (0, 0, 3.2), "block.norm": (300, 300, 0.4),
                     "mix": (10, 10, 0.5)}, order)
    units = [RecomputeUnit(("act",)), RecomputeUnit(("relu",)), RecomputeUnit(("block.norm",))]
    measured, unattributed = measure_units(units, before, after)
    assert [m.consumers for m in measured] == [("fc2",), ("conv",), ("block",)]
    assert unattributed == ()
    act, relu, norm = measured
    assert (act.bytes_before, act.bytes_after) == (800, 400)  # fc2 no longer holds act's output
    assert (relu.bytes_before, relu.bytes_after) == (200, 0)  # one storage, first saved by relu, held by both
    assert (norm.bytes_before, norm.bytes_after) == (300, 300)  # the container no longer saves it, norm does
    assert act.timed == ("act", "fc2") and act.time.ratio == pytest.approx(2.4 / 2.2)
    assert sum(m.bytes_before - m.bytes_after for m in measured) == before.saved_bytes - after.saved_bytes
    # a changed operator no unit ran before (or inside) is attributed to none
    early = profile({"emb": (8, 8, 1.0), "act": (4, 4, 1.0)}, ["emb", "act"])
    late = profile({"emb": (0, 0, 1.0), "act": (4, 4, 1.0)}, ["emb", "act"])
    assert measure_units([RecomputeUnit(("act",))], early, late)[1] == ("emb",)


def test_measuring_needs_members_that_ran_and_paired_rounds() -> None:
    before = profile({"a": (8, 8, 1.0), "b": (8, 8, 1.0)})
    with pytest.raises(UsageError, match=r"unit members \['c'\] did not run in both profiles"):
        measure_units([RecomputeUnit(("c",))], before, before)
    short = profile({"a": (8, 8, 1.0), "b": (8, 8, 1.0)})
    short.rounds = short.rounds[:2]
    with pytest.raises(UsageError, match="paired rounds: 6 and 2"):
        measure_units([RecomputeUnit(("a",))], before, short)


# ------------------------------------------------------------------------------------------------ pooling
class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()


def _three_blocks() -> tuple[dict[str, nn.Module], list[str]]:
    """blocks.0 and blocks.1 alike (width 8), blocks.2 wider (16: its LayerNorm plays another part)."""
    model = nn.Module()
    model.blocks = nn.ModuleList([_Block(8), _Block(8), _Block(16)])
    modules = {n: m for n, m in model.named_modules() if n.count(".") == 2}
    order = [f"blocks.{i}.{p}" for i in range(3) for p in ("ln", "fc", "act")]
    return modules, order


def test_units_playing_the_same_part_in_repeated_blocks_are_pooled() -> None:
    modules, order = _three_blocks()
    cheap = {n for n in order if not n.endswith(".fc")}
    ops = {n: (100, 100, 1.0) for n in order}
    before, after = profile(ops, order), profile({n: (0, 0, 1.5) for n in order}, order)
    measured, _ = measure_units(recompute_units(order, cheap, {}), before, after)
    pooled = pool_units(measured, modules)
    assert [p.label for p in pooled] == ["blocks.*.ln (x2)", "blocks.*.act (x3)", "blocks.2.ln"]
    lns = pooled[0]
    assert lns.members == ("blocks.0.ln", "blocks.1.ln") and lns.consumers == ("blocks.0.fc", "blocks.1.fc")
    assert (lns.bytes_before, lns.bytes_after) == (400, 0)
    assert lns.time.ratio == pytest.approx(1.5) and lns.extra_ms == pytest.approx(2.0)


# ------------------------------------------------------------------------------------------------ judgement
def _two_units(act_after_ms: float, ln_after_ms: float) -> tuple[ProfileResult, ProfileResult, list[str]]:
    """Two blocks of (ln, fc, act, proj); everything costs 1 ms as computed. Recomputing, fc and proj stop saving
    their input; fc's and the LayerNorm's time together become ``ln_after_ms``, proj's and the GELU's
    ``act_after_ms``."""
    order = [f"blocks.{i}.{p}" for i in (0, 1) for p in ("ln", "fc", "act", "proj")]
    before = profile({n: (1000, 1000, 1.0) for n in order}, order)
    after_ops: dict[str, tuple[int, int, float]] = {}
    for i in (0, 1):
        after_ops.update({f"blocks.{i}.ln": (1000, 1000, 1.0), f"blocks.{i}.fc": (0, 0, ln_after_ms - 1.0),
                          f"blocks.{i}.act": (1000, 1000, 1.0), f"blocks.{i}.proj": (0, 0, act_after_ms - 1.0)})
    return before, profile(after_ops, order), order


def _modules(order: list[str]) -> dict[str, nn.Module]:
    kinds = {"ln": lambda: nn.LayerNorm(4), "fc": lambda: nn.Linear(4, 4), "act": nn.GELU,
             "proj": lambda: nn.Linear(4, 4)}
    return {n: kinds[n.rsplit(".", 1)[1]]() for n in order}


def test_a_unit_within_the_slowdown_is_recomputed_and_one_past_it_is_not() -> None:
    """memory objective, slowdown bound x1.15: the GELUs' unit at x1.05 recomputes, the LayerNorms' at x1.6 not."""
    before, after, order = _two_units(act_after_ms=2.1, ln_after_ms=3.2)
    policy = policy_for(SearchConfig(objective="memory"))
    cheap = {n for n in order if n.endswith((".ln", ".act"))}
    measured, _ = measure_units(recompute_units(order, cheap, {}), before, after)
    decisions = judge_units(policy, pool_units(measured, _modules(order)))
    assert set(decisions) == cheap
    for i in (0, 1):
        act, ln = decisions[f"blocks.{i}.act"], decisions[f"blocks.{i}.ln"]
        assert act.decision is SavedPrecision.RECOMPUTE and ln.decision is SavedPrecision.FP32
        assert act.unit == "blocks.*.act (x2)" and ln.unit == "blocks.*.ln (x2)"
        assert act.group == ("blocks.0.act", "blocks.1.act")
        assert act.timed == ("blocks.0.act", "blocks.0.proj", "blocks.1.act", "blocks.1.proj")
        assert act.time_ratios["recompute"][0] == pytest.approx(1.05)
        assert ln.time_ratios["recompute"][0] == pytest.approx(1.6)
        assert act.bytes == {"fp32": 4000, "recompute": 2000} and act.gain_bytes == 1000  # an equal share of 2000
        # the reason names the unit, its bytes and time, and the operator's own unit within the pooled one
        assert "judged in recompute unit blocks.*.act (x2)" in act.reason and "0.0 -> 0.0 KiB" not in act.reason
        assert "x1.05" in act.reason and "3.9 -> 2.0 KiB" in act.reason
        assert f"this operator's unit blocks.{i}.act" in act.reason and f"blocks.{i}.proj" in act.reason
        assert ln.reason.startswith("saves as computed") and "costs too much time" in ln.reason
        assert "x1.60" in ln.reason
    # the balanced objective weighs time against bytes: half the bytes for x1.6 the time is x0.8 there, and pays
    balanced = judge_units(policy_for(SearchConfig(objective="balanced")), pool_units(measured, _modules(order)))
    assert balanced["blocks.0.act"].decision is SavedPrecision.RECOMPUTE
    assert balanced["blocks.0.ln"].decision is SavedPrecision.RECOMPUTE


def test_a_unit_that_frees_too_little_is_not_recomputed_however_fast() -> None:
    order = ["emb", "drop", "fc"]
    before = profile({"emb": (1000, 1000, 1.0), "drop": (0, 0, 0.1), "fc": (1000, 1000, 1.0)}, order)
    after = profile({"emb": (1000, 1000, 1.0), "drop": (0, 0, 0.1), "fc": (980, 980, 1.0)}, order)
    measured, _ = measure_units(recompute_units(order, {"emb"}, {}), before, after)
    decision = judge_units(policy_for(SearchConfig(objective="memory")),
                           pool_units(measured, {"emb": nn.Embedding(4, 4)}))["emb"]
    assert decision.decision is SavedPrecision.FP32 and "saves too little" in decision.reason
    assert "judged in recompute unit emb" in decision.reason and decision.group is None


def test_units_whose_rounds_straddle_the_bound_are_the_ones_worth_more_rounds() -> None:
    """x1.05 is decided (below x1.15), x1.6 too (above); a unit whose rounds spread from x1.05 to x1.25 is not, and
    one that frees too little is not worth more rounds however close."""
    before, after, order = _two_units(act_after_ms=2.1, ln_after_ms=3.2)
    policy = policy_for(SearchConfig(objective="memory"))
    cheap = {n for n in order if n.endswith((".ln", ".act"))}
    pooled = pool_units(measure_units(recompute_units(order, cheap, {}), before, after)[0], _modules(order))
    assert undecided_units(policy, pooled) == []
    for i, factor in enumerate((1.05, 1.25, 1.1, 1.2, 1.08, 1.22)):  # proj's time: the GELUs' unit straddles x1.15
        for block in (0, 1):
            after.rounds[i][f"blocks.{block}.proj"].forward_ms = 2 * factor - 1.0
    pooled = pool_units(measure_units(recompute_units(order, cheap, {}), before, after)[0], _modules(order))
    assert [u.label for u in undecided_units(policy, pooled)] == ["blocks.*.act (x2)"]
    for block in (0, 1):  # the same rounds, but proj keeps its input: nothing freed
        for state in (after.operators, *after.rounds):
            state[f"blocks.{block}.proj"].saved_bytes = state[f"blocks.{block}.proj"].own_saved_bytes = 1000
    pooled = pool_units(measure_units(recompute_units(order, cheap, {}), before, after)[0], _modules(order))
    assert undecided_units(policy, pooled) == []


def test_the_saved_stage_offers_every_unit_that_frees_enough_to_the_memory_levers() -> None:
    """As one group these units cost x1.33 of their operators' time (past x1.15), and judged apart the LayerNorms'
    costs x1.6: the saved stage still offers both units to the memory levers (a ratio of a few operators' time is not
    the step's; the levers weigh each unit's milliseconds against the step's allowance), the LayerNorms' reason
    keeping its own judgement; operators in no unit go on to the stored precisions."""
    before, after, order = _two_units(act_after_ms=2.1, ln_after_ms=3.2)
    whole = sum(sum(after.series(n)) for n in order) / sum(sum(before.series(n)) for n in order)
    assert whole > 1.15
    modules = _modules(order)
    config = SearchConfig(objective="memory")
    stage = SavedStage(SimpleNamespace(policy=policy_for(config), modules=modules, config=config))
    decisions = {n: OperatorDecision(type(m).__name__, classify(m), 0) for n, m in modules.items()}
    result = SavedStageResult()
    cheap = [n for n in order if n.endswith((".ln", ".act"))]
    stage._decide_recompute({SavedPrecision.FP32: before, SavedPrecision.RECOMPUTE: after}, cheap, decisions, result)
    assert result.choices == dict.fromkeys(cheap, SavedPrecision.RECOMPUTE)
    ln, act = decisions["blocks.0.ln"].saved, decisions["blocks.0.act"].saved
    assert ln is not None and ln.unit == "blocks.*.ln (x2)" and ln.gain_bytes > 0
    assert ln.reason.startswith("offered to the memory levers") and "costs too much time" in ln.reason
    assert act is not None and act.unit == "blocks.*.act (x2)" and not act.reason.startswith("offered")
    # the rest judged for fp8 (a profile where everything stores fp8 at a quarter, as fast)
    fp8 = profile({n: (250, 250, 1.0) for n in order}, order)
    codec = [n for n in order if n not in result.choices]
    assert codec == ["blocks.0.fc", "blocks.0.proj", "blocks.1.fc", "blocks.1.proj"]
    stage._decide({SavedPrecision.FP32: before, SavedPrecision.FP8: fp8}, codec, (SavedPrecision.FP8,), decisions,
                  result)
    fc = decisions["blocks.0.fc"].saved
    assert fc is not None and fc.decision is SavedPrecision.FP8
    assert decisions["blocks.0.ln"].saved is ln  # the unit's offer stands


def test_profiles_of_real_steps_attribute_every_freed_byte() -> None:
    """Profiled for real, with the recompute hooks in force: the LayerNorm and GELU recompute as one unit (the GELU
    saves the LayerNorm's output, a recipe now), freeing the next Linear's saved input; the ReLU is a unit of its
    own, freeing its output (which the last Linear saves too); the units' changes are the whole step's."""
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    cheap = ("1", "2", "4")
    executor = PlanExecutor()
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))

    def step() -> None:
        with executor.step(StepKind.TRAIN):
            loss = nn.functional.cross_entropy(model(x), y)
        with executor.recomputing():
            loss.backward()

    plans = {"fp32": PrecisionPlan(), "recompute": PrecisionPlan.from_dict({n: {"saved": "recompute"} for n in cheap})}
    results = OperatorProfiler(model, "cpu", rounds=2, warmup=1).profile(
        {label: (lambda plan=plan: executor.apply(model, plan)) for label, plan in plans.items()}, step)
    base, recomputed = results["fp32"], results["recompute"]
    units = recompute_units(base.order, set(cheap), base.sharing)
    assert [u.members for u in units] == [("1", "2"), ("4",)]
    measured, unattributed = measure_units(units, base, recomputed)
    assert [m.consumers for m in measured] == [("3",), ("5",)] and unattributed == ()
    activation = 32 * 64 * 4
    assert [m.bytes_before - m.bytes_after for m in measured] == [2 * activation, activation]
    assert sum(m.bytes_before - m.bytes_after for m in measured) == base.saved_bytes - recomputed.saved_bytes
