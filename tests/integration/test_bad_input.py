"""Bad input gets a clear error: every case raises (or, where stated, warns) with a message that names the bad value
and what would have been valid. See ``docs/hardening.md`` for the table of cases, behaviours and tests."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision as LightningPrecision
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from torch import nn

from lightning_comp import CoMPPrecision, CoMPSearch, PrecisionPlan, SearchConfig
from lightning_comp.devices import device_class
from lightning_comp.errors import (
    PlanError,
    PlanFileError,
    PlanMismatchError,
    SearchConfigError,
    UnsupportedSetupError,
)
from lightning_comp.numerics.precision import ComputePrecision, parse_precision
from lightning_comp.search.checks import check_trainer
from tests.helpers.search_models import Classifier, WideMLP, loaders

FAST_FP16_CPU = device_class("cpu").is_native(ComputePrecision.FP16)
# Every lowerable operator of WideMLP: with these excluded a search has nothing to trial and finishes at once.
EVERYTHING = ["type:Linear", "type:ReLU"]


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """One intra-op thread: faster for these tiny models on a shared, oversubscribed machine (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer(tmp_path: Path, plugin: Any = None, callbacks: list[Callback] | None = None, **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("max_epochs", 1)
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[plugin] if plugin is not None else None,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        **kwargs,
    )


def _small_loaders() -> tuple[Any, Any]:
    return loaders(n_train=64, n_val=64, batch_size=32)


def _search(**kwargs: Any) -> CoMPSearch:
    kwargs.setdefault("verbose", False)
    kwargs.setdefault("low_precision", "bf16")  # pinned: the same on every CPU class
    kwargs.setdefault("measurement", {"profile_steps": 1, "profile_warmup": 0})
    return CoMPSearch(**kwargs)


class WideGelu(WideMLP):
    """Same parameters as ``WideMLP`` (a checkpoint of one loads into the other), but ``a3`` is a GELU."""

    def __init__(self, width: int = 32) -> None:
        super().__init__(width=width)
        self.a3 = nn.GELU()


class NoFloatOps(Classifier):
    """A model whose only module is shape-only: its weight is used functionally, so no operator can be lowered."""

    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Flatten()
        self.w = nn.Parameter(torch.randn(64, 10) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flat(x) @ self.w


# ------------------------------------------------------------------------------------------- plans vs the model
def test_plan_naming_a_missing_operator_lists_the_model_operators(tmp_path: Path) -> None:
    train, val = _small_loaders()
    trainer = _trainer(tmp_path, CoMPPrecision({"haed": "bf16", "l2": "bf16"}))
    with pytest.raises(PlanMismatchError) as info:
        trainer.fit(WideMLP(width=32), train, val)
    message = str(info.value)
    assert "1 plan entry matches no operator of WideMLP: 'haed'" in message
    assert "did you mean 'head'" in message
    assert "l1, a1, l2, a2, l3, a3, l4, a4, head" in message


def test_plan_file_made_for_a_different_model_names_the_differences(tmp_path: Path) -> None:
    other = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10))
    path = PrecisionPlan.for_model(other, {"0": "bf16"}).save(tmp_path / "plan.json")
    train, val = _small_loaders()
    trainer = _trainer(tmp_path, CoMPPrecision(path))
    with pytest.raises(PlanMismatchError) as info:
        trainer.fit(WideMLP(width=32), train, val)
    message = str(info.value)
    assert "made for a different model" in message
    assert "missing from the model: 0, 1, 2" in message and "new in the model: l1, a1" in message
    assert "Make a new plan for this model" in message


def _checkpoint(tmp_path: Path, callbacks: list[Callback] | None = None) -> Path:
    train, val = _small_loaders()
    trainer = _trainer(tmp_path, CoMPPrecision({"type:Linear": "bf16"}), callbacks=callbacks)
    trainer.fit(WideMLP(width=32), train, val)
    path = tmp_path / "wide.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_checkpoint_resumed_into_a_model_with_other_operators_names_them(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    train, val = _small_loaders()
    trainer = _trainer(tmp_path, CoMPPrecision(), max_epochs=2)
    with pytest.raises(PlanMismatchError, match=re.escape("retyped: a3 (ReLU -> GELU)")):
        trainer.fit(WideGelu(), train, val, ckpt_path=path)


def test_checkpoint_resumed_into_a_model_with_other_weights_fails_in_lightning_first(tmp_path: Path) -> None:
    """Lightning loads the weights before any plan: a different architecture fails there, naming the tensors."""
    path = _checkpoint(tmp_path)
    train, val = _small_loaders()
    trainer = _trainer(tmp_path, CoMPPrecision(), max_epochs=2)
    with pytest.raises(RuntimeError, match=r"size mismatch for l1\.weight"):
        trainer.fit(WideMLP(width=48), train, val, ckpt_path=path)


def test_search_state_resumed_into_a_different_model_is_refused(tmp_path: Path) -> None:
    search = _search(exclude=EVERYTHING)  # finishes at once: the checkpoint holds a chosen, fingerprinted plan
    with pytest.warns(UserWarning, match="excluded"):
        path = _checkpoint(tmp_path, callbacks=[search])
    assert torch.load(path, weights_only=True)["callbacks"]["CoMPSearch"]["phase"] == "done"
    train, val = _small_loaders()
    trainer = _trainer(tmp_path, CoMPPrecision(), callbacks=[_search(exclude=EVERYTHING)], max_epochs=2)
    with pytest.raises(PlanMismatchError, match=re.escape("retyped: a3 (ReLU -> GELU)")):
        trainer.fit(WideGelu(), train, val, ckpt_path=path)


def test_search_state_of_another_version_is_refused() -> None:
    with pytest.raises(SearchConfigError, match="version 99.*reads 5"):
        CoMPSearch().load_state_dict({"version": 99})
    with pytest.raises(SearchConfigError, match="version 1.*reads 5"):  # before groups, flips and the trialled plan
        CoMPSearch().load_state_dict({"version": 1})
    with pytest.raises(SearchConfigError, match="version 2.*reads 5"):  # before the pace and the memory spending
        CoMPSearch().load_state_dict({"version": 2})
    with pytest.raises(SearchConfigError, match="version 3.*reads 5"):  # before the process peaks
        CoMPSearch().load_state_dict({"version": 3})
    with pytest.raises(SearchConfigError, match="version 4.*reads 5"):  # before fp8 candidates
        CoMPSearch().load_state_dict({"version": 4})


def test_malformed_plugin_state_is_refused() -> None:
    with pytest.raises(PlanError, match="Malformed CoMPPrecision state.*'plan' key"):
        CoMPPrecision().load_state_dict({"schedule": {}})


# ------------------------------------------------------------------------------------------ precisions and files
@pytest.mark.parametrize("value", ["fp4", "float64", "int8", "bf-16", ""])
def test_unknown_precision_string_names_it_and_the_valid_ones(value: str) -> None:
    valid = ("valid precisions are 'fp32', 'bf16', 'fp16', 'fp8' (nn.Linear only, per-tensor scales) and"
             " 'fp8-rowwise' (nn.Linear only, per-row scales)")
    with pytest.raises(PlanError, match=re.escape(f"Plan entry 'l1': Unknown precision {value!r}: {valid}")):
        CoMPPrecision({"l1": value})
    with pytest.raises(PlanError, match=re.escape(f"Unknown precision {value!r}: {valid}")):
        PrecisionPlan.from_dict({}, default=value)


def test_unsupported_dtype_and_search_precision() -> None:
    with pytest.raises(PlanError, match=r"torch\.int8.*torch\.float32, torch\.bfloat16, torch\.float16"):
        parse_precision(torch.int8)
    with pytest.raises(PlanError, match=r"valid dtypes are torch\.float32, torch\.bfloat16, torch\.float16\.$"):
        parse_precision(torch.float8_e4m3fn)  # (the fp8 precisions are spelled, their activations being bf16)
    with pytest.raises(SearchConfigError, match=r"low_precision='fp8'.*'auto'.*'bf16', 'fp16' or 'off'"):
        CoMPSearch(low_precision="fp8")


def test_plan_argument_of_a_wrong_type() -> None:
    with pytest.raises(PlanError, match="Cannot make a plan from int 42: pass a PrecisionPlan, a mapping"):
        CoMPPrecision(42)  # type: ignore[arg-type]


def _write(path: Path, content: object) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "does not exist"),
        ("directory", r"cannot be read: \[Errno 21\] Is a directory"),
        (b"\xff\xfe\x00garbage", "cannot be read: 'utf-8' codec can't decode"),
        ("{not json", "is not valid JSON: Expecting property name"),
        ([["l1", "bf16"]], "holds a JSON list; expected an object"),
        ({"l1": {"precision": "bf16"}}, r"Plan entry 'l1': \{'precision': 'bf16'\} is not a precision.*'saved'"),
        ({"format": "lightning-comp/plan", "version": 1, "entries": ["l1"]}, "entries must be a mapping"),
        ({"format": "lightning-comp/plan", "entries": {}}, "Unsupported plan version None: this lightning-comp reads"),
    ],
    ids=["missing", "unreadable-dir", "unreadable-bytes", "not-json", "json-list", "bad-entry", "bad-entries",
         "no-version"],
)
def test_plan_file_problems_name_the_file_and_the_problem(tmp_path: Path, content: object, match: str) -> None:
    path = tmp_path / "plan.json"
    if content == "directory":
        path.mkdir()
    elif content is not None:
        _write(path, content)
    with pytest.raises(PlanFileError, match=match) as info:
        CoMPPrecision(path)  # fails when the plugin is built, before any Trainer exists
    assert f"Plan file {str(path)!r}" in str(info.value)


# ------------------------------------------------------------------------------------------------------ fp16
@pytest.mark.skipif(FAST_FP16_CPU, reason="this CPU has AMX-FP16: fp16 is not declined")
def test_fp16_on_this_cpu_is_declined_with_a_warning_that_explains(tmp_path: Path) -> None:
    plugin = CoMPPrecision({"type:Linear": "fp16"})
    train, val = _small_loaders()
    with pytest.warns(UserWarning) as record:
        _trainer(tmp_path, plugin).fit(WideMLP(width=32), train, val)
    message = next(str(w.message) for w in record if "fp16" in str(w.message))
    assert "no fast fp16" in message and "~100x slower" in message
    assert "Use 'bf16', or pass CoMPPrecision(allow_slow_fp16=True) to insist" in message
    assert not plugin.plan.uses("fp16") and plugin.plan.provenance.get("declined_fp16") is True
    assert plugin.scaler is None


def test_fp16_runs_when_the_user_insists(tmp_path: Path) -> None:
    plugin = CoMPPrecision({"type:Linear": "fp16"}, allow_slow_fp16=True)
    train, val = _small_loaders()
    _trainer(tmp_path, plugin).fit(WideMLP(width=32), train, val)
    assert plugin.plan.uses("fp16") and isinstance(plugin.scaler, torch.amp.GradScaler)


@pytest.mark.skipif(FAST_FP16_CPU, reason="this CPU has AMX-FP16: fp16 searches are allowed")
def test_fp16_search_on_this_cpu_is_refused_unless_the_user_insists(tmp_path: Path) -> None:
    train, val = _small_loaders()
    trainer = _trainer(tmp_path, CoMPPrecision(), callbacks=[_search(low_precision="fp16")])
    with pytest.raises(SearchConfigError) as info:
        trainer.fit(WideMLP(width=32), train, val)
    message = str(info.value)
    assert re.search(r"CoMPSearch\(low_precision='fp16'\) on cpu \w+ \(.*\), which has no fast fp16", message)
    assert "~100x slower" in message and "CoMPPrecision(allow_slow_fp16=True)" in message
    # insisting is accepted: the search runs and trials fp16
    search = _search(low_precision="fp16", include=["l2"], exclude=["l1", "l3", "l4", "head", "a?"], warmup_epochs=0)
    insisting = _trainer(tmp_path, CoMPPrecision(allow_slow_fp16=True), callbacks=[search], max_epochs=2)
    insisting.fit(WideMLP(width=32), train, val)
    assert search.record is not None and search.record["low_precision"] == "fp16"


# ------------------------------------------------------------------------------------------------ Trainer setup
def test_search_without_the_plugin_names_what_the_trainer_uses(tmp_path: Path) -> None:
    train, val = _small_loaders()
    trainer = _trainer(tmp_path, callbacks=[_search()], precision="bf16-mixed")
    with pytest.raises(UnsupportedSetupError) as info:
        trainer.fit(WideMLP(width=32), train, val)
    message = str(info.value)
    assert "needs the CoMPPrecision plugin, but the Trainer uses MixedPrecision (precision='bf16-mixed')" in message
    assert "Trainer(plugins=[CoMPPrecision()], callbacks=[CoMPSearch()])" in message


@pytest.mark.parametrize(("precision", "shown"), [("32-true", "32-true"), ("bf16-mixed", "bf16-mixed"),
                                                 ("16-mixed", "16-mixed"), (32, "32-true")])
def test_plugin_with_a_trainer_precision_is_refused_by_lightning(precision: Any, shown: str) -> None:
    """Lightning's own ValueError: it names the precision value and the plugin and says to choose one."""
    with pytest.raises(ValueError, match=rf"Received both `precision={shown}` and `plugins=.*CoMPPrecision.*"
                                         r"Choose one\."):
        pl.Trainer(accelerator="cpu", precision=precision, plugins=[CoMPPrecision()], logger=False)


def test_fsdp_refuses_the_plugin_with_a_type_error() -> None:
    """FSDP needs an FSDPPrecision subclass; Lightning says so when the plugin is set (no GPU needed to check)."""
    strategy = FSDPStrategy()
    with pytest.raises(TypeError, match="FSDP strategy can only work with the `FSDPPrecision` plugin, found.*CoMP"):
        strategy.precision_plugin = CoMPPrecision()


def test_fsdp_on_cpu_is_refused_before_anything_else() -> None:
    with pytest.raises(ValueError, match="strategy `fsdp` requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", strategy=FSDPStrategy(), plugins=[CoMPPrecision()], logger=False)


def _fake_trainer(strategy: Any, plugin: CoMPPrecision | None = None) -> SimpleNamespace:
    return SimpleNamespace(precision_plugin=plugin or CoMPPrecision(), precision="32-true", strategy=strategy,
                           limit_val_batches=1.0, check_val_every_n_epoch=1)


@pytest.mark.parametrize("name", ["DeepSpeedStrategy", "XLAStrategy"])
def test_search_refuses_strategies_whose_state_it_cannot_rewind_by_name(name: str) -> None:
    strategy = type(name, (DDPStrategy,), {})()
    with pytest.raises(UnsupportedSetupError) as info:
        _search().setup(_fake_trainer(strategy), WideMLP(width=32), "fit")  # type: ignore[arg-type]
    message = str(info.value)
    assert f"CoMPSearch cannot run under {name}" in message
    assert "Use strategy='auto', 'ddp', FSDPStrategy (FSDP1) or ModelParallelStrategy (FSDP2)" in message


@pytest.mark.parametrize("name", ["FSDPStrategy", "ModelParallelStrategy"])
def test_search_accepts_sharded_strategies(name: str) -> None:
    """FSDP1 and FSDP2 are searched (2-process runs: ``tests/integration/test_search_sharded.py``)."""
    from lightning_comp import CoMPFSDPPrecision

    strategy = FSDPStrategy() if name == "FSDPStrategy" else type(name, (DDPStrategy,), {})()
    plugin = CoMPFSDPPrecision() if name == "FSDPStrategy" else CoMPPrecision()
    assert check_trainer(_fake_trainer(strategy, plugin), _search().config) is plugin  # type: ignore[arg-type]


def test_search_accepts_ddp(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, CoMPPrecision(), strategy=DDPStrategy())
    assert check_trainer(trainer, _search().config) is trainer.precision_plugin  # no process group needed


def test_deepspeed_engine_is_refused_by_the_plugin() -> None:
    engine = type("DeepSpeedEngine", (nn.Module,), {})()
    with pytest.raises(UnsupportedSetupError, match="cannot drive a DeepSpeed engine.*strategy='ddp' or 'auto'"):
        CoMPPrecision().connect(engine, [], [])


def test_a_plain_lightning_precision_is_not_mistaken_for_the_plugin(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, LightningPrecision(), callbacks=[_search()])
    train, val = _small_loaders()
    with pytest.raises(UnsupportedSetupError, match="the Trainer uses Precision"):
        trainer.fit(WideMLP(width=32), train, val)


# ------------------------------------------------------------------------------------------- search arguments
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tolerance": -0.1}, "CoMPSearch(tolerance=-0.1) is invalid: it must be a finite number >= 0."),
        ({"tolerance": float("inf")}, "CoMPSearch(tolerance=inf) is invalid: it must be a finite number >= 0."),
        ({"trial_epochs": 0}, "CoMPSearch(trial_epochs=0) is invalid: it must be an integer >= 1."),
        ({"trial_epochs": 1.5}, "CoMPSearch(trial_epochs=1.5) is invalid: it must be an integer >= 1."),
        ({"measurement": {"profile_steps": 0}},
         "CoMPSearch(measurement.profile_steps=0) is invalid: it must be an integer >= 1."),
        ({"warmup_epochs": -1}, "CoMPSearch(warmup_epochs=-1) is invalid: it must be an integer >= 0."),
        ({"max_trials": 0}, "CoMPSearch(max_trials=0) is invalid: it must be an integer >= 1."),
        ({"mode": "maximum"}, "CoMPSearch(mode='maximum') is invalid: use 'min'"),
        ({"monitor": ""}, "CoMPSearch(monitor='') is invalid: it must be the name of a metric"),
        ({"measurement": {"max_skipped_fraction": -0.5}},
         "CoMPSearch(measurement.max_skipped_fraction=-0.5) is invalid: it must be a number >= 0"),
        ({"measurement": "fast"}, "CoMPSearch(measurement='fast') is invalid: use a preset, 'quick', 'default' or"),
        ({"precisions": {"saved": "fp4"}},
         "CoMPSearch(precisions={'saved': 'fp4'}) is invalid: use 'auto', 'off', 'fp8', 'bf16' or 'recompute'."),
        ({"precisions": {"compute": "bf16"}}, "CoMPSearch(precisions={'compute': ...}) is invalid: its keys are"),
        ({"include_dimensions": {"master": "l2"}}, "CoMPSearch(include_dimensions['master']='l2') is invalid"),
        ({"include": "l2"}, "CoMPSearch(include='l2') is invalid: it must be a list of plan selectors"),
        ({"exclude": ["type:Linear."]}, "CoMPSearch(exclude=...): Type selector 'type:Linear.' must name a class"),
    ],
)
def test_bad_search_arguments_name_the_value_and_the_valid_range(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SearchConfigError, match=re.escape(message)):
        CoMPSearch(**kwargs)


def test_a_measurement_setting_given_as_a_setting_of_its_own_says_where_it_goes() -> None:
    with pytest.raises(SearchConfigError, match=re.escape(
            "CoMPSearch has no setting 'profile_steps'; its settings are monitor, mode,")) as info:
        SearchConfig.of({"profile_steps": 2})
    assert "tune the measurement: measurement={'profile_steps': ...}" in str(info.value)
    with pytest.raises(TypeError, match="profile_steps"):
        CoMPSearch(profile_steps=2)  # type: ignore[call-arg]  # Python's own error for an unknown keyword


@pytest.mark.parametrize("name", ["include", "exclude"])
def test_selector_that_matches_no_operator_is_an_error(tmp_path: Path, name: str) -> None:
    """A typo in ``exclude`` would otherwise lower the layer the user meant to protect."""
    train, val = _small_loaders()
    trainer = _trainer(tmp_path, CoMPPrecision(), callbacks=[_search(**{name: ["l2", "haed"]})])
    with pytest.raises(SearchConfigError) as info:
        trainer.fit(WideMLP(width=32), train, val)
    message = str(info.value)
    assert f"CoMPSearch({name}=['l2', 'haed'])" in message
    assert "'haed' (did you mean 'head'?)" in message and "l1, a1, l2" in message


def test_monitor_never_logged_names_the_logged_metrics(tmp_path: Path) -> None:
    train, val = _small_loaders()
    trainer = _trainer(tmp_path, CoMPPrecision(), callbacks=[_search(monitor="val_f1")])
    with pytest.raises(SearchConfigError) as info:
        trainer.fit(WideMLP(width=32), train, val)  # fails in the sanity check, before any epoch is spent
    message = str(info.value)
    assert "CoMPSearch(monitor='val_f1') was not logged during validation" in message
    assert "logged metrics are ['val_acc', 'val_loss']" in message


def test_no_validation_at_a_trial_end_is_an_error_not_an_endless_search(tmp_path: Path) -> None:
    train, _ = _small_loaders()
    search = _search(warmup_epochs=0, include=["l2"], exclude=["l1", "l3", "l4", "head", "a?"])
    trainer = _trainer(tmp_path, CoMPPrecision(), callbacks=[search], max_epochs=3)
    with pytest.raises(SearchConfigError) as info:
        trainer.fit(WideMLP(width=32), train)  # no val_dataloaders: the reference trial can never be judged
    message = str(info.value)
    assert "validation metric 'val_loss'" in message and "no validation ran at the end of epoch 0" in message
    assert "Pass val_dataloaders" in message and "Metrics logged so far: ['train_loss']" in message
    assert trainer.current_epoch == 0


def test_validation_disabled_is_refused_at_setup(tmp_path: Path) -> None:
    train, val = _small_loaders()
    trainer = _trainer(tmp_path, CoMPPrecision(), callbacks=[_search()], limit_val_batches=0)
    with pytest.raises(SearchConfigError, match=r"Trainer\(limit_val_batches=0\) disables validation"):
        trainer.fit(WideMLP(width=32), train, val)


def test_trial_epochs_not_a_multiple_of_the_validation_interval(tmp_path: Path) -> None:
    train, val = _small_loaders()
    trainer = _trainer(tmp_path, CoMPPrecision(), callbacks=[_search(trial_epochs=1)], check_val_every_n_epoch=2)
    with pytest.raises(SearchConfigError, match=r"trial_epochs=1\) must be a multiple of.*check_val_every_n_epoch=2"):
        trainer.fit(WideMLP(width=32), train, val)


# ------------------------------------------------------------------------------- models with nothing to lower
def test_search_on_a_model_without_floating_point_operators_finishes_at_once(tmp_path: Path) -> None:
    search = _search()
    plugin = CoMPPrecision()
    trainer = _trainer(tmp_path, plugin, callbacks=[search], max_epochs=2)
    train, val = _small_loaders()
    with pytest.warns(UserWarning, match=r"NoFloatOps has no operator that bf16 can apply to on cpu \(its operators:"
                                         r" flat \(Flatten\)\)\. Training continues in fp32 without a search"):
        trainer.fit(NoFloatOps(), train, val)
    record = search.record
    assert record is not None and search.phase == "done"
    assert record["trials"] == [] and record["extension_epochs"] == 0 and record["lowered_operators"] == []
    assert "has no operator that bf16 can apply to" in record["finish_reason"]
    assert plugin.plan.is_all_fp32 and plugin.executor.num_hooks == 0 and trainer.current_epoch == 2


def test_search_with_every_operator_excluded_finishes_at_once(tmp_path: Path) -> None:
    search = _search(exclude=EVERYTHING)
    trainer = _trainer(tmp_path, CoMPPrecision(), callbacks=[search], max_epochs=2)
    train, val = _small_loaders()
    with pytest.warns(UserWarning, match=r"every operator that bf16 can apply to is excluded by CoMPSearch\(exclude="):
        trainer.fit(WideMLP(width=32), train, val)
    assert search.phase == "done" and search.record is not None and search.record["trials"] == []
    assert trainer.current_epoch == 2


def test_plugin_plan_on_a_model_without_floating_point_operators(tmp_path: Path) -> None:
    train, val = _small_loaders()
    with pytest.raises(PlanMismatchError, match=r"'type:Linear'\. The model's operators are: flat\."):
        _trainer(tmp_path, CoMPPrecision({"type:Linear": "bf16"})).fit(NoFloatOps(), train, val)
    # an entry that matches only the shape-only module is accepted, says once that it lowers nothing, costs nothing
    # (no hooks), and the trace of the first step says where the work is: the root computes it between its children
    plugin = CoMPPrecision({"flat": "bf16"})
    with pytest.warns(UserWarning) as caught:
        _trainer(tmp_path, plugin).fit(NoFloatOps(), train, val)
    said = [str(w.message) for w in caught]
    nothing = [m for m in said if "assigns bf16 but no operator of NoFloatOps computes in it" in m]
    unplanned = [m for m in said if "stays in fp32" in m]
    assert len(nothing) == 1 and len(unplanned) == 1, said
    assert "<root> (NoFloatOps, 100%)" in unplanned[0] and "'type:NoFloatOps': 'bf16'" in unplanned[0]
    assert plugin.executor.num_hooks == 0
    assert plugin.executor.precisions() == {"": ComputePrecision.FP32, "flat": ComputePrecision.FP32}
    # a default of bf16 reaches that work: the root is a FUNCTIONAL operator, its matmul lowered
    plugin = CoMPPrecision(PrecisionPlan.from_dict({}, default="bf16"))
    _trainer(tmp_path, plugin).fit(NoFloatOps(), train, val)
    assert plugin.executor.precisions() == {"": ComputePrecision.BF16, "flat": ComputePrecision.FP32}
