"""CoMPSearch on the real Trainer path: unsafe operators stay FP32, tiny operators are left alone, the plan and the
decision record reach the checkpoint and the log directory, resume does not search again, and a run killed in the
middle of the search finishes it after resuming."""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_comp import CoMPPrecision, CoMPSearch, PrecisionPlan
from lightning_comp.errors import SearchConfigError, UnsupportedSetupError
from lightning_comp.numerics import ComputePrecision
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.record.text import format_record
from tests.helpers.search_models import (
    TOLERANCE,
    FragileMLP,
    SearchProbe,
    TinyOps,
    WideMLP,
    fixed_search,
    loaders,
    search_trainer,
)


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
    # the reference learned past the tolerance over its trial: the trials could tell a plan that learns nothing
    reference = record["trials"][0]
    start = reference["metrics"][str(record["search_start_epoch"] - 1)]
    assert start > reference["metric"] * (1 + TOLERANCE) and record["blind_trials"] is None


@pytest.mark.slow
def test_decision_record_is_written_and_in_checkpoint(offset_run: dict[str, Any], tmp_path: Path) -> None:
    trainer: pl.Trainer = offset_run["trainer"]
    record = json.loads((Path(offset_run["dir"]) / "search_record.json").read_text())
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
    saved = PrecisionPlan.load(Path(offset_run["dir"]) / "plan.json")
    assert saved == offset_run["plugin"].plan
    path = tmp_path / "done.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["callbacks"]["CoMPSearch"]["phase"] == "done"
    assert ckpt["callbacks"]["CoMPSearch"]["chosen"]["entries"] == saved.to_dict()["entries"]
    assert ckpt["lightning_comp"]["plan"]["entries"] == saved.to_dict()["entries"]
    # resuming after the search restores the plan and does not search again
    search = fixed_search()
    plugin = CoMPPrecision()
    resumed = search_trainer(tmp_path, [search], max_epochs=trainer.current_epoch + 1, plugin=plugin)
    train, val = loaders()
    resumed.fit(WideMLP(), train, val, ckpt_path=str(path))
    assert plugin.plan == offset_run["plugin"].plan
    assert len(search.state.trials) == len(offset_run["search"].state.trials)
    # and a saved plan can be reused for a new run without any search
    reuse = CoMPPrecision(plan=Path(offset_run["dir"]) / "plan.json")
    fresh = search_trainer(tmp_path / "reuse", [], max_epochs=1, plugin=reuse)
    fresh.fit(WideMLP(), train, val)
    assert reuse.plan == offset_run["plugin"].plan


@pytest.mark.slow
@pytest.mark.parametrize("starting_plan", [None, {"head": "fp32"}])
def test_killed_mid_search_resumes_and_finishes_with_the_same_plan(offset_run: dict[str, Any], tmp_path: Path,
                                                                   starting_plan: dict[str, str] | None) -> None:
    """Resumed with or without an explicit starting plan: the search, not that plan, decides what trains (its
    trial's plan comes back from the checkpoint)."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    pl.seed_everything(0)
    trainer = search_trainer(tmp_path, [fixed_search(), _Crash(epoch=3), checkpoint], max_epochs=4,
                             plugin=CoMPPrecision(starting_plan))
    train, val = loaders()
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.fit(WideMLP(), train, val)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["callbacks"]["CoMPSearch"]["phase"] == "searching"
    search = fixed_search()
    plugin = CoMPPrecision(starting_plan)
    resumed = search_trainer(tmp_path, [search, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
                             max_epochs=4, plugin=plugin)
    train, val = loaders()
    resumed.fit(WideMLP(), train, val, ckpt_path=str(last))
    assert search.phase == "done"
    assert plugin.plan["compute"].entries == offset_run["plugin"].plan["compute"].entries
    # no epoch lost or counted twice: the same epochs as the uninterrupted run
    assert resumed.current_epoch == offset_run["trainer"].current_epoch


@pytest.mark.slow
def test_tiny_operators_keep_fp32_without_convergence_trials(tmp_path: Path) -> None:
    pl.seed_everything(0)
    # speed_margin=0.2: on a shared machine a 5% whole-step "win" of tiny ops can be faked by noise in both the
    # fastest and the median round; 20% cannot. The decision logic itself is unchanged.
    search = fixed_search(include=[], exclude=[], measurement={"speed_margin": 0.2})
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
    assert all(precisions[n] is ComputePrecision.BF16 for n in faster), record  # safe in bf16: the trial keeps them


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
    assert plugin.plan.of("compute", "bad", torch.nn.Linear).value == "fp32"
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


@pytest.mark.slow
def test_memory_objective_records_whole_step_saved_bytes_on_the_trainer_path(tmp_path: Path) -> None:
    pl.seed_everything(0)
    # any slowdown accepted: what is tested is the memory comparison, not whether bf16 is fast on this CPU; no memory
    # levers, so the leanest whole step is trialled (with levers the fastest is built on, which timing decides)
    search = fixed_search(objective="memory", include=["l2", "l4"], exclude=["l1", "l3", "head"],
                          max_slowdown_vs_fastest=1e3, precisions={"saved": "off", "state": "off", "master": "off"})
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


# ----------------------------------------------------------------------------------------------- resume state
@pytest.fixture(scope="module")
def finished_search(tmp_path_factory: pytest.TempPathFactory) -> CoMPSearch:
    """A search of ``WideMLP`` run to its end (its state holds trials, candidates, runs and the chosen plan)."""
    pl.seed_everything(0)
    search = fixed_search()
    trainer = search_trainer(tmp_path_factory.mktemp("finished"), [search], max_epochs=3, plugin=CoMPPrecision())
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    return search


@pytest.mark.slow
def test_the_search_state_round_trips_through_its_checkpoint_form(finished_search: CoMPSearch) -> None:
    saved = finished_search.state_dict()
    again = CoMPSearch(**asdict(finished_search.config))  # the record reports the settings beside the state
    again.load_state_dict(torch.load(_saved(saved), weights_only=True))
    assert again.state == finished_search.state  # every field, typed again (candidates, verdicts, enums)
    assert again.state_dict() == saved
    assert again.chosen_plan == finished_search.chosen_plan and again.record == finished_search.record
    assert all(isinstance(c, Candidate) for t in again.state.trials[1:] for c in t.group or ())
    assert again.state.low_precision is ComputePrecision.BF16  # the searched precision is read back, not decided again


def _saved(state: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.slow
@pytest.mark.parametrize("where", ["state", "trial"])
def test_unknown_keys_in_a_search_state_are_an_error_naming_them(finished_search: CoMPSearch, where: str) -> None:
    state = finished_search.state_dict()
    if where == "state":
        state["surprise"] = 1
    else:
        state["trials"] = [dict(t) for t in state["trials"]]
        state["trials"][1]["surprise"] = 1
    with pytest.raises(SearchConfigError, match=r"Unknown keys \['surprise'\]"):
        CoMPSearch(verbose=False).load_state_dict(state)
    missing = {k: v for k, v in finished_search.state_dict().items() if k != "batch"}
    with pytest.raises(SearchConfigError, match=r"Missing keys \['batch'\]"):
        CoMPSearch(verbose=False).load_state_dict(missing)


@pytest.mark.slow
def test_the_batch_stage_measures_operators_at_training_cast_boundaries_and_times_amps_plan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_comp.search.stages import batch_stage

    pl.seed_everything(0)
    model = WideMLP(offset=False)
    seen: dict[str, set[torch.dtype]] = {"a2": set(), "a3": set()}
    profiling = {"on": False}
    for name in seen:  # registered before the plugin's hooks: sees the dtype the producer hands on
        getattr(model, name).register_forward_pre_hook(
            lambda m, args, name=name: seen[name].add(args[0].dtype) if profiling["on"] else None)
    original = batch_stage.BatchStage._profile_operators

    def recorded(self: Any, *args: Any) -> Any:
        profiling["on"] = True
        try:
            return original(self, *args)
        finally:
            profiling["on"] = False

    monkeypatch.setattr(batch_stage.BatchStage, "_profile_operators", recorded)
    search = fixed_search(include=["l2", "l3", "l4"], exclude=["l1", "head"])
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=CoMPPrecision())
    train, val = loaders(n_train=512, n_val=256)
    trainer.fit(model, train, val)
    record = search.record
    assert record is not None
    # per operator, the all-low plan runs as training would run it: l2's output stays bf16 into the bf16 ReLU
    # (no cast back to fp32 charged to l2), next to the fp32 rounds
    assert seen["a2"] == {torch.float32, torch.bfloat16} and seen["a3"] == {torch.float32, torch.bfloat16}
    # AMP's plan (one global region lowers a1 after l1 too, and a4) is timed beside fp32 and the candidates
    assert {"fp32", "candidates", "amp"} <= set(record["step_ms"])
    # the candidate plan's own boundaries differ from the all-low plan's: its operators are measured there too
    assert all("in_plan" in record["operators"][name] for name in ("l2", "l3", "l4"))


class _Frozen(WideMLP):
    """Learns nothing (AdamW at learning rate 0): every trial ends where the search started."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.0)


@pytest.mark.slow
def test_trials_that_could_not_tell_a_plan_that_learns_nothing_say_so(tmp_path: Path) -> None:
    pl.seed_everything(0)
    search = fixed_search()
    trainer = search_trainer(tmp_path, [search], max_epochs=3, plugin=CoMPPrecision())
    train, val = loaders(n_train=512, n_val=256)
    with pytest.warns(UserWarning, match="a plan that learned nothing during its trial would pass"):
        trainer.fit(_Frozen(), train, val)
    record = search.record
    assert record is not None and record["blind_trials"] is not None
    assert "lengthen them (trial_batches, trial_epochs)" in record["blind_trials"]
    reference = record["trials"][0]
    assert reference["metrics"][str(record["search_start_epoch"] - 1)] == pytest.approx(reference["metric"])
    assert "The trials could not tell" in format_record(record)
