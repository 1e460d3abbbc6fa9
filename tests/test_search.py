"""CoMPSearch on the real Trainer path: unsafe operators stay FP32, tiny operators are left alone, the plan and the
decision record reach the checkpoint and the log directory, resume does not search again, and a run killed in the
middle of the search finishes it after resuming."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from search_models import TOLERANCE, FragileMLP, SearchProbe, TinyOps, WideMLP, fixed_search, loaders, search_trainer
from torch import nn

from lightning_comp import CoMPPrecision, CoMPSearch, Precision, PrecisionPlan
from lightning_comp.errors import SearchConfigError, UnsupportedSetupError
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.search import SearchConfig
from lightning_comp.search.decisions.comparison import StepComparison, whole_step_winner
from lightning_comp.search.decisions.group_search import GroupSearch
from lightning_comp.search.record.text import format_record
from lightning_comp.search.stages.batch_stage import BatchStage


class _Crash(Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            raise RuntimeError("simulated crash")


@pytest.fixture(scope="module")
def offset_run(tmp_path_factory: pytest.TempPathFactory, plain_wide_mlp: pl.Trainer) -> dict[str, Any]:
    """One uninterrupted search on the model whose ``l3`` is unsafe in bf16, plus a plain FP32 run."""
    tmp = tmp_path_factory.mktemp("offset")
    pl.seed_everything(0)
    search = fixed_search()
    probe = SearchProbe(search)
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp, [search, probe], max_epochs=4, plugin=plugin)
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    comp = {
        "search": search,
        "probe": probe,
        "plugin": plugin,
        "trainer": trainer,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "dir": tmp,
        "kept_steps": trainer.global_step,
    }
    comp["fp32_val_loss"] = float(plain_wide_mlp.callback_metrics["val_loss"])
    comp["fp32_steps"] = plain_wide_mlp.global_step
    return comp


@pytest.mark.slow
def test_unsafe_operator_stays_fp32_and_safe_large_ones_are_lowered(offset_run: dict[str, Any]) -> None:
    search: CoMPSearch = offset_run["search"]
    record = search.record
    assert record is not None
    plan = offset_run["plugin"].plan
    model = offset_run["trainer"].lightning_module
    precisions = {name: p.value for name, p in plan.resolve(model).items()}
    assert precisions["l3"] == "fp32", record
    assert precisions["l2"] == "bf16" and precisions["l4"] == "bf16", record
    # the kept progress equals a plain run's optimizer steps, and the final metric is within tolerance of it
    steps_per_epoch = offset_run["fp32_steps"] // 4
    assert offset_run["kept_steps"] - steps_per_epoch * record["extension_epochs"] == offset_run["fp32_steps"]
    assert offset_run["val_loss"] <= offset_run["fp32_val_loss"] * (1 + TOLERANCE)
    # every rejected trial was rewound bit for bit before the next one started
    assert offset_run["probe"].rewinds_exact and all(offset_run["probe"].rewinds_exact)
    # trials grow with the unsafe operators: reference + all + 2 u log2(n) splits + one confirmation (u=1, n=3)
    candidates = [n for n, op in record["operators"].items() if op["decision"] == "candidate"]
    assert len(record["trials"]) <= 2 + 2 * 1 * math.ceil(math.log2(len(candidates))) + 1


@pytest.mark.slow
def test_decision_record_is_written_and_in_checkpoint(offset_run: dict[str, Any], tmp_path: Path) -> None:
    trainer: pl.Trainer = offset_run["trainer"]
    record = json.loads((Path(offset_run["dir"]) / "comp_search.json").read_text())
    assert record["chosen_plan"] == offset_run["plugin"].plan.to_dict()
    assert {t["verdict"] for t in record["trials"]} == {"pass", "fail"}
    assert record["operators"]["l2"]["fp32"]["total_ms"] > 0
    cost = record["cost"]
    assert cost["search_seconds"] > 0 and 0 < cost["share_of_fit"] < 1
    # the FP32 warm-up epoch (8 batches) is charged at the measured gap between the reference and the chosen plan
    assert cost["warmup_batches"] == 8
    chosen = [t for t in record["trials"] if t["label"] == record["chosen_trial"]][-1]
    gap_ms = max(0.0, record["trials"][0]["median_step_ms"] - chosen["median_step_ms"])
    assert cost["warmup_overhead_seconds"] == pytest.approx(8 * gap_ms / 1e3)
    assert cost["total_seconds"] == pytest.approx(cost["search_seconds"] + cost["warmup_overhead_seconds"])
    saved = PrecisionPlan.load(Path(offset_run["dir"]) / "comp_plan.json")
    assert saved == offset_run["plugin"].plan
    path = tmp_path / "done.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["callbacks"]["CoMPSearch"]["phase"] == "done"
    assert ckpt["callbacks"]["CoMPSearch"]["chosen"]["entries"] == saved.to_dict()["entries"]
    assert ckpt["CoMPPrecision"]["plan"]["entries"] == saved.to_dict()["entries"]
    # resuming after the search restores the plan and does not search again
    search = fixed_search()
    plugin = CoMPPrecision()
    resumed = search_trainer(tmp_path, [search], max_epochs=trainer.current_epoch + 1, plugin=plugin)
    train, val = loaders()
    resumed.fit(WideMLP(), train, val, ckpt_path=str(path))
    assert plugin.plan == offset_run["plugin"].plan
    assert len(search.state.trials) == len(offset_run["search"].state.trials)
    # and a saved plan can be reused for a new run without any search
    reuse = CoMPPrecision(plan=Path(offset_run["dir"]) / "comp_plan.json")
    fresh = search_trainer(tmp_path / "reuse", [], max_epochs=1, plugin=reuse)
    fresh.fit(WideMLP(), train, val)
    assert reuse.plan == offset_run["plugin"].plan


@pytest.mark.slow
def test_killed_mid_search_resumes_and_finishes_with_the_same_plan(offset_run: dict[str, Any], tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    pl.seed_everything(0)
    trainer = search_trainer(tmp_path, [fixed_search(), _Crash(epoch=3), checkpoint], max_epochs=4,
                             plugin=CoMPPrecision())
    train, val = loaders()
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.fit(WideMLP(), train, val)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["callbacks"]["CoMPSearch"]["phase"] == "searching"
    search = fixed_search()
    plugin = CoMPPrecision()
    resumed = search_trainer(tmp_path, [search, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
                             max_epochs=4, plugin=plugin)
    train, val = loaders()
    resumed.fit(WideMLP(), train, val, ckpt_path=str(last))
    assert search.phase == "done"
    assert plugin.plan.entries == offset_run["plugin"].plan.entries
    # no epoch lost or counted twice: the same epochs as the uninterrupted run
    assert resumed.current_epoch == offset_run["trainer"].current_epoch


@pytest.mark.slow
def test_tiny_operators_keep_fp32_without_convergence_trials(tmp_path: Path) -> None:
    pl.seed_everything(0)
    # speed_margin=0.2: on a shared machine a 5% whole-step "win" of tiny ops can be faked by noise in both the
    # fastest and the median round; 20% cannot. The decision logic itself is unchanged.
    search = fixed_search(include=[], exclude=[], speed_margin=0.2)
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=plugin)
    train, val = loaders(n_train=512, batch_size=32)
    trainer.fit(TinyOps(), train, val)
    record = search.record
    assert record is not None
    assert plugin.plan.is_all_fp32
    assert record["lowered_operators"] == []
    assert len(record["trials"]) == 1 and record["trials"][0]["kept"]
    assert record["extension_epochs"] == 0 and trainer.current_epoch == 3
    assert plugin.executor.num_hooks == 0  # an all-FP32 plan costs nothing per step


@pytest.mark.slow
@pytest.mark.needs_native_bf16
def test_the_batch_stage_lowers_large_matmuls_where_bf16_is_native(tmp_path: Path) -> None:
    """Nothing pinned: the default search measures that 1024-wide Linears are faster in bf16 and trials them."""
    pl.seed_everything(0)
    search = CoMPSearch(verbose=False, tolerance=TOLERANCE)
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=plugin)
    train, val = loaders()
    trainer.fit(WideMLP(width=1024, offset=False), train, val)
    record = search.record
    assert record is not None and record["low_precision"] == "bf16"
    operators = record["operators"]
    faster = [n for n in ("l2", "l3", "l4") if operators[n]["decision"] == "candidate"]
    assert faster, {n: (operators[n]["decision"], operators[n]["reason"]) for n in ("l2", "l3", "l4")}
    assert any(operators[n]["gain_ms"] > 0 for n in faster)
    precisions = plugin.plan.resolve(trainer.lightning_module)
    assert all(precisions[n] is Precision.BF16 for n in faster), record  # safe in bf16: the trial keeps them


@pytest.mark.slow
def test_nan_trial_is_rejected_rewound_and_training_goes_on(tmp_path: Path) -> None:
    pl.seed_everything(0)
    search = fixed_search(include=["l2", "bad"], exclude=["l1", "head", "a?"])
    probe = SearchProbe(search)
    plugin = CoMPPrecision()
    trainer = search_trainer(tmp_path, [search, probe], max_epochs=3, plugin=plugin)
    train, val = loaders()
    trainer.fit(FragileMLP(), train, val)
    record = search.record
    assert record is not None
    assert any(t["verdict"] == "fail" and "NaN" in t["reason"] for t in record["trials"])
    assert plugin.plan.precision_of("bad", torch.nn.Linear).value == "fp32"
    assert math.isfinite(float(trainer.callback_metrics["val_loss"]))
    assert all(probe.rewinds_exact)
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


def test_search_without_plugin_is_a_clear_error(tmp_path: Path) -> None:
    trainer = search_trainer(tmp_path, [fixed_search()], max_epochs=1)
    train, val = loaders(n_train=64, n_val=64, batch_size=32)
    with pytest.raises(UnsupportedSetupError, match="needs the CoMPPrecision plugin"):
        trainer.fit(TinyOps(), train, val)


def test_unlogged_monitor_names_the_logged_metrics(tmp_path: Path) -> None:
    trainer = search_trainer(tmp_path, [fixed_search(monitor="val_f1", warmup_epochs=0)], max_epochs=2,
                             plugin=CoMPPrecision(), num_sanity_val_steps=0)
    train, val = loaders(n_train=64, n_val=64, batch_size=32)
    with pytest.raises(SearchConfigError, match=r"val_f1.*val_acc.*val_loss"):
        trainer.fit(WideMLP(width=64), train, val)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "maximum"}, "mode"),
        ({"tolerance": -0.1}, "tolerance"),
        ({"tolerance": float("nan")}, "tolerance"),
        ({"trial_epochs": 0}, "trial_epochs"),
        ({"low_precision": "int8"}, "low_precision"),
        ({"objective": "speed"}, "objective"),
        ({"tolerance_mode": "percent"}, "tolerance_mode"),
    ],
)
def test_bad_search_arguments_name_the_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SearchConfigError, match=message):
        CoMPSearch(**kwargs)


def _oracle(unsafe: set[str]) -> Any:
    return lambda group: not (set(group) & unsafe)


@pytest.mark.parametrize("unsafe", [set(), {"op3"}, {"op0", "op7"}, {"op1", "op2", "op5"}])
def test_group_search_finds_exactly_the_unsafe_operators(unsafe: set[str]) -> None:
    candidates = tuple(f"op{i}" for i in range(8))
    search = GroupSearch(candidates, max_trials=64)
    passes = _oracle(unsafe)
    trials = 0
    while not search.done:
        group = search.next_group()
        assert group is not None
        search.report(group, passes(group))
        search = GroupSearch.from_state(search.state_dict())  # survives a checkpoint at every step
        trials += 1
    assert set(search.result or ()) == set(candidates) - unsafe
    u = max(1, len(unsafe))
    assert trials <= 1 + 2 * u * math.ceil(math.log2(len(candidates))) + 1


def test_group_search_falls_back_when_safe_groups_fail_together() -> None:
    search = GroupSearch(("a", "b", "c", "d"), gains={"a": 5.0, "b": 1.0, "c": 1.0, "d": 1.0}, max_trials=16)
    verdicts = {("a", "b", "c", "d"): False, ("a", "b"): True, ("c",): True}
    while search.confirming is None:
        group = search.next_group()
        assert group is not None
        search.report(group, verdicts[group])
    # ("c", "d") and then ("d",) were inferred to fail; the untried safe set must be confirmed by a trial
    assert search.unsafe == ["d"] and search.confirming == ("a", "b", "c")
    search.report(("a", "b", "c"), False)  # the safe groups interact: the union fails
    assert search.result == ("a", "b")  # the passing group with the largest estimated gain


def test_group_search_keeps_a_confirmed_safe_set() -> None:
    search = GroupSearch(("a", "b", "c", "d"), max_trials=16)
    verdicts = {("a", "b", "c", "d"): False, ("a", "b"): True, ("c",): True, ("a", "b", "c"): True}
    while not search.done:
        group = search.next_group()
        assert group is not None
        search.report(group, verdicts[group])
    assert search.result == ("a", "b", "c") and search.trials == 4


def test_group_search_infers_the_failing_half_without_a_trial() -> None:
    search = GroupSearch(("a", "b", "c"), max_trials=16)
    tried = []
    while not search.done:
        group = search.next_group()
        assert group is not None
        tried.append(group)
        search.report(group, "b" not in group)
    assert search.result == ("a", "c")
    assert ("b", "c") not in tried  # inferred to fail once ("a",) passed
    assert search.inferred == ["b", "c"]


def test_group_search_respects_the_trial_budget() -> None:
    search = GroupSearch(tuple(f"op{i}" for i in range(16)), max_trials=3)
    while not search.done:
        group = search.next_group()
        assert group is not None
        search.report(group, len(group) == 1)
    assert search.trials <= 3


# ------------------------------------------------------------------------------------- whole-step alternatives
def _stage(**kwargs: Any) -> BatchStage:
    return BatchStage(SearchConfig(verbose=False, **kwargs), Precision.BF16, CoMPPrecision())


def test_whole_step_alternatives_are_distinct_plans_without_excluded_operators() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    modules = dict(iter_operators(model))
    order, lowerable = list(modules), list(modules)
    decisions = {"0": {"decision": "candidate"}, "1": {"decision": "fill"}, "2": {"decision": "candidate"},
                 "3": {"decision": "fp32"}, "4": {"decision": "fp32", "excluded": True}}
    runs = [{"before": "0", "after": "2", "operators": ["1"]}]
    alternatives = _stage().alternatives(modules, lowerable, order, decisions, ("0", "2"), runs)
    lowered = {label: {s for s, p in plan.entries if p is Precision.BF16} for label, plan in alternatives.items()}
    # all_low leaves the excluded head out; compute = the Linears allowed (without the LayerNorm fill)
    assert lowered == {"all_low": {"0", "1", "2", "3"}, "compute": {"0", "2"}}


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        ({"fp32": 100, "candidates": 90, "compute": 80, "all_low": 84}, "compute"),  # fastest that beats both
        ({"fp32": 100, "candidates": 82, "compute": 80, "all_low": 84}, None),  # 2.5 % is within the margin
        ({"fp32": 100, "candidates": 70, "compute": 80, "all_low": 99}, None),  # the candidates win
        ({"fp32": 100, "compute": 97, "all_low": 60}, "all_low"),  # no candidates: must beat fp32 only
        ({"fp32": 100, "compute": 97, "all_low": 98}, None),
    ],
)
def test_whole_step_winner_needs_the_margin_over_fp32_and_the_candidates(step: dict[str, float],
                                                                       expected: str | None) -> None:
    labels = [k for k in step if k not in ("fp32", "candidates")]
    config = SearchConfig()
    steady = StepComparison(_rounds(step))
    assert whole_step_winner(config, steady, {}, labels, "candidates" in step) == expected
    if expected is not None:  # a win in some rounds is not enough: the interval of the per-round ratios must clear
        noisy = _rounds(step)
        noisy[expected][1:3] = [noisy["fp32"][1], noisy["fp32"][2] * 1.2]
        assert whole_step_winner(config, StepComparison(noisy), {}, labels, "candidates" in step) != expected


def _rounds(step: dict[str, float], count: int = 6) -> dict[str, list[float]]:
    """Per-round times around ``step`` (a steady machine: within 0.2 % of each other)."""
    return {k: [v * (1 + 0.002 * ((i * 7) % 3 - 1)) for i in range(count)] for k, v in step.items()}


@pytest.mark.parametrize(
    ("saved", "step", "expected"),
    [
        ({"fp32": 100, "candidates": 60, "compute": 70, "all_low": 40}, {}, "all_low"),  # the leanest
        ({"fp32": 100, "candidates": 60, "compute": 59, "all_low": 58}, {}, None),  # within the 5 % margin
        ({"fp32": 100, "candidates": 60, "all_low": 40}, {"all_low": 160}, None),  # 1.6x slower than fp32
        ({"fp32": 100, "compute": 97, "all_low": 50}, {}, "all_low"),  # no candidates: must beat fp32
    ],
)
def test_memory_objective_adopts_the_leanest_whole_step_within_the_slowdown(
        saved: dict[str, float], step: dict[str, float], expected: str | None) -> None:
    config = SearchConfig(objective="memory")
    times = _rounds({k: step.get(k, 100.0) for k in saved})
    labels = [k for k in saved if k not in ("fp32", "candidates")]
    assert whole_step_winner(config, StepComparison(times), saved, labels, "candidates" in saved) == expected


@pytest.mark.slow
def test_memory_objective_records_whole_step_saved_bytes_on_the_trainer_path(tmp_path: Path) -> None:
    pl.seed_everything(0)
    # any slowdown accepted: what is tested is the memory comparison, not whether bf16 is fast on this CPU
    search = fixed_search(objective="memory", include=["l2", "l4"], exclude=["l1", "l3", "head"],
                          max_memory_slowdown=1e3)
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=CoMPPrecision())
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    record = search.record
    assert record is not None
    saved = record["step_saved_bytes"]
    assert {"fp32", "candidates", "all_low"} <= set(saved) and all(v > 0 for v in saved.values())
    # Lowering l2 and l4 alone saves *more* than fp32: each boundary keeps an fp32 and a bf16 copy of an activation.
    # Only the whole-step comparison sees that; the all-bf16 plan is the lean one, and it is what gets trialled.
    assert saved["all_low"] < saved["fp32"] < saved["candidates"]
    adopted = [op["reason"] for op in record["operators"].values() if "leaner as a whole" in op.get("reason", "")]
    assert adopted and all("all-bf16 plan" in reason for reason in adopted)
    assert "MiB saved for backward" in format_record(record)


@pytest.mark.parametrize(
    ("saved", "step", "expected"),
    [
        # all_low: time x0.6, bytes x0.5 -> 0.55; candidates: x0.5, x0.9 -> 0.67; compute: x0.55, x1.0 -> 0.74
        ({"fp32": 100, "candidates": 90, "compute": 100, "all_low": 50},
         {"fp32": 100, "candidates": 50, "compute": 55, "all_low": 60}, "all_low"),
        # all_low 0.66 is within 5 % of the candidates' 0.67
        ({"fp32": 100, "candidates": 90, "all_low": 72}, {"fp32": 100, "candidates": 50, "all_low": 60}, None),
    ],
)
def test_balanced_objective_weighs_time_and_memory_of_whole_steps(
        saved: dict[str, float], step: dict[str, float], expected: str | None) -> None:
    config = SearchConfig(objective="balanced")
    labels = [k for k in saved if k not in ("fp32", "candidates")]
    assert whole_step_winner(config, StepComparison(_rounds(step)), saved, labels, True) == expected


# ----------------------------------------------------------------------------------------------- resume state
STATE_V1 = Path(__file__).parent / "data" / "search_state_v1.json"  # written by the search before it was a package


def test_a_search_state_written_before_the_typed_state_still_resumes() -> None:
    old = json.loads(STATE_V1.read_text())
    search = CoMPSearch(verbose=False)
    search.load_state_dict(old)
    state = search.state
    assert state.phase == "done" and state.chosen is not None
    assert [(t.label, t.verdict) for t in state.trials] == [(t["label"], t["verdict"]) for t in old["trials"]]
    assert all(isinstance(t.group, tuple) for t in state.trials[1:]) and state.trials[0].group is None
    assert search.chosen_plan == PrecisionPlan.from_dict(old["chosen"])
    again = search.state_dict()  # the checkpoint form keeps every key and value it read (trials gain defaults)
    assert {k: v for k, v in again.items() if k != "trials"} == {k: v for k, v in old.items() if k != "trials"}
    for new, before in zip(again["trials"], old["trials"], strict=True):
        assert {k: new[k] for k in before} == before
    record = search.record
    assert record is not None and record["chosen_trial"] == old["chosen_label"]


@pytest.mark.parametrize("where", ["state", "trial"])
def test_unknown_keys_in_a_search_state_are_an_error_naming_them(where: str) -> None:
    old = json.loads(STATE_V1.read_text())
    if where == "state":
        old["surprise"] = 1
    else:
        old["trials"][1]["surprise"] = 1
    with pytest.raises(SearchConfigError, match=r"Unknown keys \['surprise'\]"):
        CoMPSearch(verbose=False).load_state_dict(old)
