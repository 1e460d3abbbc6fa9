"""CoMPPrecision on the real Lightning Trainer path: dtypes per operator, FP32 masters, accuracy, checkpoints,
every step kind, re-application, FP16 loss scaling."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_comp import CoMPPrecision, PlanError, PlanMismatchError, PrecisionPlan, UnsupportedSetupError
from lightning_comp.execution import StepKind
from lightning_comp.numerics import ComputePrecision
from tests.helpers.models import MIXED_OPERATORS, WEIGHTS_ONLY, TinyMLP
from tests.helpers.recording import DtypeRecorder, count_forward_hooks

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# The aten op that does each MixedNet operator's arithmetic; (op names, how many leading floating inputs to check).
# Norms take a 16-bit activation with FP32 affine parameters/statistics (mixed CPU kernels), so only input 0 counts.
_KERNELS: dict[str, tuple[tuple[str, ...], int | None]] = {
    "lstm": (("mkldnn_rnn_layer", "mm", "addmm"), None),  # oneDNN under autocast; native kernels for param copies
    "conv": (("convolution",), None),
    "bn": (("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training"), 1),
    "act": (("relu",), None),
    "fc": (("addmm",), None),
    "ln": (("native_layer_norm",), 1),
    "head": (("addmm",), None),
}


class _Observer(pl.Callback):
    """Records aten-op dtypes per operator on one training batch, and what the optimizer sees on every step."""

    def __init__(self, batch: int = 1) -> None:
        self.batch = batch
        self.recorder = DtypeRecorder()
        self.param_dtypes: set[torch.dtype] = set()
        self.grad_dtypes: set[torch.dtype] = set()
        self.group_dtypes: set[torch.dtype] = set()
        self.missing_grads = 0
        self.hooks_at_train_start = -1
        self.hooks_per_batch: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.hooks_at_train_start = count_forward_hooks(pl_module)
        self.recorder.attach(pl_module, MIXED_OPERATORS if hasattr(pl_module, "emb") else None)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.hooks_per_batch.append(count_forward_hooks(pl_module) - len(self.recorder._handles))  # plugin's only
        if idx == self.batch:
            self.recorder.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if args[-1] == self.batch:
            self.recorder.__exit__(None, None, None)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.recorder.detach()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        for p in pl_module.parameters():
            self.param_dtypes.add(p.dtype)
            if p.grad is None:
                self.missing_grads += 1
            else:
                self.grad_dtypes.add(p.grad.dtype)
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.group_dtypes.add(p.dtype)
                if p.grad is not None:
                    self.group_dtypes.add(p.grad.dtype)


_PLAN_A = {"emb": "bf16", "lstm": "bf16", "conv": "bf16", "bn": "bf16", "act": "bf16", "fc": "bf16", "ln": "fp32",
           "head": "fp32"}
_PLAN_B = {"type:Linear": "bf16", "type:LayerNorm": "bf16"}  # the complement: LSTM/conv/BN/embedding stay fp32


@pytest.mark.parametrize("mapping", [_PLAN_A, _PLAN_B], ids=["recurrent-conv-low", "linear-norm-low"])
def test_each_operator_computes_in_its_assigned_dtype(
    mapping: dict[str, str], make_mixed: Any, make_token_loader: Any, fast_trainer_kwargs: dict[str, Any]
) -> None:
    model = make_mixed()
    plugin = CoMPPrecision(mapping)
    observer = _Observer(batch=1)  # batch 0 calibrates the cast boundaries; batch 1 is a steady-state step
    trainer = pl.Trainer(max_steps=3, plugins=[plugin], callbacks=[observer], **fast_trainer_kwargs)
    trainer.fit(model, make_token_loader())
    assert trainer.precision_plugin is plugin and trainer.precision == "32-true"

    expected = plugin.plan.resolve(model)
    rec = observer.recorder
    for name, (ops, n_inputs) in _KERNELS.items():
        kernels = rec.ops_of(name, *ops)
        assert kernels, f"no {ops} recorded inside {name}"
        dtype = expected[name].dtype
        for kernel in kernels:
            checked = kernel.inputs if n_inputs is None else kernel.inputs[:n_inputs]
            assert all(d == dtype for d in checked), (name, kernel)
            assert kernel.outputs[0] == dtype, (name, kernel)
    # An embedding look-up is exact in any precision: a low-precision embedding *emits* its assigned dtype.
    emb_out = [r for r in rec.ops_of("emb", "_to_copy") if r.inputs == [FP32]]
    assert (emb_out[0].outputs == [BF16]) if expected["emb"].is_low else not emb_out
    # Parameters and gradients handed to the optimizer are FP32 master copies, never a low-precision copy.
    assert observer.param_dtypes == observer.grad_dtypes == observer.group_dtypes == {FP32}
    assert observer.missing_grads == 0
    assert all(p.dtype == FP32 for p in model.parameters())
    # The loss sees FP32 logits.
    loss_ops = [r for r in rec.ops if r.module is None and r.op in ("_log_softmax", "nll_loss_forward")]
    assert loss_ops and all(d == FP32 for r in loss_ops for d in r.inputs)


def test_low_run_stays_low_on_the_trainer_path(make_mlp: Any, make_regression_loader: Any,
                                               fast_trainer_kwargs: dict[str, Any]) -> None:
    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
            self.seen: list[tuple[torch.dtype, torch.dtype]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            out = self.net(batch[0])
            loss = nn.functional.mse_loss(out, batch[1])
            self.seen.append((out.dtype, loss.dtype))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    model = Net()
    observer = _Observer(batch=2)
    trainer = pl.Trainer(max_steps=3, plugins=[CoMPPrecision({"type:Module": "bf16"})], callbacks=[observer],
                         **fast_trainer_kwargs)
    trainer.fit(model, make_regression_loader())
    calls = {c.module: c for c in observer.recorder.calls}
    assert calls["net.0"].outputs == [BF16]
    assert calls["net.1"].inputs == [BF16] and calls["net.1"].outputs == [BF16]
    assert calls["net.2"].inputs == [BF16] and calls["net.2"].outputs == [FP32]
    assert model.seen == [(FP32, FP32)] * 3
    assert trainer.precision_plugin.executor.chained_operators(StepKind.TRAIN) == frozenset({"net.0", "net.1"})


# ----------------------------------------------------------------------------------------------- accuracy
class _FirstGrads(pl.Callback):
    def __init__(self) -> None:
        self.grads: torch.Tensor | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.grads is None:
            self.grads = torch.cat([p.grad.flatten() for p in pl_module.parameters()])


def test_bf16_plan_matches_fp32_within_sqnr(make_mixed: Any, make_token_loader: Any, sqnr_db: Any,
                                            fast_trainer_kwargs: dict[str, Any]) -> None:
    """bf16 keeps 8 significant bits (unit roundoff 2^-9, about -54 dB per rounding). Through the ~8 roundings of
    this model the outputs measure ~44-50 dB over seeds 0-2 and first-step gradients 27-42 dB, so >= 25 dB
    (outputs) and >= 20 dB (gradients) leave a margin for platform variance while catching wrong casts or
    overflow; < 70 dB proves the plan really computed in bf16 (fp32 noise would be ~140 dB, here: exact)."""
    reference = make_mixed()
    low = copy.deepcopy(reference)
    ref_out = torch.cat(pl.Trainer(**fast_trainer_kwargs).predict(reference, make_token_loader()))
    outs = pl.Trainer(plugins=[CoMPPrecision({"type:Module": "bf16"})], **fast_trainer_kwargs).predict(
        low, make_token_loader()
    )
    low_out = torch.cat(outs)
    assert low_out.dtype == FP32 and all(o.dtype == FP32 for o in outs)
    assert 25 <= sqnr_db(ref_out, low_out) < 70

    grads = []
    for plugins in ([], [CoMPPrecision({"type:Module": "bf16"})]):
        cb = _FirstGrads()
        pl.Trainer(max_steps=1, plugins=plugins, callbacks=[cb], **fast_trainer_kwargs).fit(
            copy.deepcopy(reference), make_token_loader()
        )
        grads.append(cb.grads)
    assert 20 <= sqnr_db(grads[0], grads[1]) < 70


def test_all_fp32_plan_trains_bit_identically_to_no_plugin(make_mixed: Any, make_token_loader: Any,
                                                           fast_trainer_kwargs: dict[str, Any]) -> None:
    reference = make_mixed()
    other = copy.deepcopy(reference)
    pl.Trainer(max_steps=3, **fast_trainer_kwargs).fit(reference, make_token_loader())
    plugin = CoMPPrecision({"type:Module": "fp32"})
    pl.Trainer(max_steps=3, plugins=[plugin], **fast_trainer_kwargs).fit(other, make_token_loader())
    assert plugin.executor.num_hooks == 0
    for (name, a), b in zip(reference.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------ step kinds and re-application
class _HookCounter(pl.Callback):
    """The forward hooks on the model at every batch of every stage."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}

    def _count(self, stage: str, pl_module: pl.LightningModule) -> None:
        self.counts.setdefault(stage, []).append(count_forward_hooks(pl_module))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._count("train", pl_module)

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._count("validation", pl_module)

    def on_test_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._count("test", pl_module)

    def on_predict_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._count("predict", pl_module)


def test_validate_test_predict_and_hooks_stay_constant(make_mlp: Any, make_regression_loader: Any,
                                                       fast_trainer_kwargs: dict[str, Any]) -> None:
    model = make_mlp()
    plan = {"type:Linear": "bf16", "type:ReLU": "bf16"}
    plugin = CoMPPrecision(plan)
    loader = make_regression_loader()
    expected_hooks = 2 * 5  # one pre/post pair on each of the 5 operators
    counting = _HookCounter()
    trainer = pl.Trainer(max_epochs=1, plugins=[plugin], num_sanity_val_steps=0, callbacks=[counting],
                         **fast_trainer_kwargs)
    after = []  # after each stage the hooks are off: the model returned to the user computes in fp32
    for _ in range(2):
        trainer.fit(model, loader, loader)
        after.append(count_forward_hooks(model))
        assert trainer.validate(model, loader, verbose=False)[0]["val_loss"] > 0
        after.append(count_forward_hooks(model))
        assert trainer.test(model, loader, verbose=False)[0]["test_loss"] > 0
        after.append(count_forward_hooks(model))
        preds = trainer.predict(model, loader)
        assert preds is not None and all(p.dtype == FP32 and p.shape == (16, 1) for p in preds)
        after.append(count_forward_hooks(model))
        trainer.fit_loop.max_epochs += 1
    assert after == [0] * 8
    assert set(counting.counts) == {"train", "validation", "test", "predict"}
    assert all(c == expected_hooks for counts in counting.counts.values() for c in counts), counting.counts
    counts = []
    for _ in range(3):
        plugin.set_plan(plan)
        counts.append(count_forward_hooks(model))
    plugin.set_plan(PrecisionPlan.from_dict({"net.0": "bf16"}))
    counts.append(count_forward_hooks(model))
    assert counts == [expected_hooks] * len(counts)
    assert plugin.executor.num_hooks == expected_hooks
    for kind in StepKind:
        assert plugin.executor.chained_operators(kind) == frozenset()  # a new plan: calibrations start afresh
    plugin.set_plan(None)  # all fp32: no hook at all
    assert count_forward_hooks(model) == 0


def test_a_new_plugin_for_the_same_model_replaces_the_old_plan(make_mlp: Any, make_regression_loader: Any,
                                                              fast_trainer_kwargs: dict[str, Any]) -> None:
    model = make_mlp()
    first = CoMPPrecision({"type:Linear": "bf16"})
    pl.Trainer(max_steps=2, plugins=[first], **fast_trainer_kwargs).fit(model, make_regression_loader())
    second = CoMPPrecision({"type:Linear": "fp32", "net.1": "bf16"})
    observer = _Observer(batch=1)
    pl.Trainer(max_steps=2, plugins=[second], callbacks=[observer], **fast_trainer_kwargs).fit(
        model, make_regression_loader()
    )
    assert observer.hooks_at_train_start == 10  # not 20: the old hooks are gone
    assert count_forward_hooks(model) == 0  # and the second plugin took its own off at the end of the fit
    addmms = [r for r in observer.recorder.ops if r.op == "addmm"]
    assert len(addmms) == 3 and all(r.inputs == [FP32, FP32, FP32] for r in addmms)  # the new plan, not the old
    assert observer.recorder.ops_of("net.1", "relu")[0].inputs == [BF16]
    assert first.executor.num_hooks == 0


def test_sanity_check_validation_runs_first_then_training(make_mlp: Any, make_regression_loader: Any,
                                                          fast_trainer_kwargs: dict[str, Any]) -> None:
    class Net(TinyMLP):
        grad_in_val: list[bool] = []
        val_dtypes: list[torch.dtype] = []

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.grad_in_val.append(torch.is_grad_enabled())
            h = self.net[1](self.net[0](batch[0]))
            self.val_dtypes.append(h.dtype)
            super().validation_step(batch, batch_idx)

    model = Net()
    plugin = CoMPPrecision({"type:Module": "bf16"})
    loader = make_regression_loader()
    trainer = pl.Trainer(max_epochs=1, plugins=[plugin], num_sanity_val_steps=2, **fast_trainer_kwargs)
    trainer.fit(model, loader, loader)
    assert not any(model.grad_in_val)  # validation under no_grad
    assert model.val_dtypes[0] == FP32  # the sanity check's first batch calibrates: outputs return to fp32
    assert model.val_dtypes[1:] and set(model.val_dtypes[1:]) == {FP32}  # net.1 returns to the step: fp32
    ex = plugin.executor
    assert ex.chained_operators(StepKind.TRAIN) == frozenset({"net.0", "net.1", "net.2", "net.3"})
    # In validation one call of net.1 hands its output out of the operators (to `h`): net.1 must return fp32 there.
    assert ex.chained_operators(StepKind.VALIDATION) == frozenset({"net.0", "net.2", "net.3"})
    assert trainer.callback_metrics["val_loss"].dtype == FP32


# ----------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_and_resume(tmp_path: Path, make_mlp: Any, make_regression_loader: Any,
                                          fast_trainer_kwargs: dict[str, Any]) -> None:
    loader = make_regression_loader()
    plan = {"type:Linear": "bf16", "type:ReLU": "bf16", "net.4": "fp32"}
    model = make_mlp()
    plugin = CoMPPrecision(plan)
    trainer = pl.Trainer(max_epochs=1, plugins=[plugin], **fast_trainer_kwargs)
    trainer.fit(model, loader)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)  # plain types only
    state = ckpt["lightning_comp"]
    assert state["plan"] == plugin.plan.to_dict() and state["scaler"] is None
    assert state["optimizer_steps"] == 4 and state["skipped_steps"] == 0
    assert PrecisionPlan.from_dict(state["plan"]) == plugin.plan

    resumed_model = make_mlp()
    resumed = CoMPPrecision()  # no plan given: it must come from the checkpoint
    observer = _Observer(batch=-1)
    trainer2 = pl.Trainer(max_epochs=2, plugins=[resumed], callbacks=[observer], **fast_trainer_kwargs)
    trainer2.fit(resumed_model, loader, ckpt_path=path, **WEIGHTS_ONLY)
    assert resumed.plan == plugin.plan
    assert resumed.optimizer_steps == 8 and trainer2.global_step == 8
    assert observer.hooks_at_train_start == 10  # re-applied before the first resumed step, not twice
    # the first step calibrates with every operator hooked; then the fp32 head, which changes nothing, carries none
    assert observer.hooks_per_batch == [10, 8, 8, 8]
    assert count_forward_hooks(resumed_model) == resumed.executor.num_hooks == 0  # taken off at teardown
    assert resumed.executor.precisions()["net.0"].is_low and not resumed.executor.precisions()["net.4"].is_low
    assert observer.param_dtypes == observer.grad_dtypes == {FP32}
    # validate/test from the checkpoint restore the plan too
    fresh = CoMPPrecision()
    pl.Trainer(plugins=[fresh], **fast_trainer_kwargs).validate(make_mlp(), loader, ckpt_path=path, verbose=False,
                                                                 **WEIGHTS_ONLY)
    assert fresh.plan == plugin.plan


@pytest.mark.parametrize("how", ["constructor", "set_plan"])
def test_an_explicit_plan_wins_over_the_checkpoints_with_a_warning_naming_both(
        tmp_path: Path, how: str, make_mlp: Any, make_regression_loader: Any,
        fast_trainer_kwargs: dict[str, Any]) -> None:
    """Resuming a checkpoint (a searched one, say, that lowered the head) with a plan of the user's own: the user's
    plan is the one that trains (it used to be replaced silently, and the head computed in bf16)."""
    loader = make_regression_loader()
    searched = CoMPPrecision({"type:Linear": "bf16"})  # stands for the plan a search chose: the head lowered
    trainer = pl.Trainer(max_epochs=1, plugins=[searched], **fast_trainer_kwargs)
    trainer.fit(make_mlp(), loader)
    path = tmp_path / "searched.ckpt"
    trainer.save_checkpoint(path)
    mine = {"net.0": "bf16", "net.4": "fp32"}
    plugin = CoMPPrecision(mine) if how == "constructor" else CoMPPrecision()
    if how == "set_plan":
        plugin.set_plan(mine)
    model = make_mlp()
    resumed = pl.Trainer(max_epochs=2, plugins=[plugin], **fast_trainer_kwargs)
    with pytest.warns(UserWarning) as caught:
        resumed.fit(model, loader, ckpt_path=path, **WEIGHTS_ONLY)
    message = next(str(w.message) for w in caught if "the checkpoint holds the plan" in str(w.message))
    assert "{'type:Linear': 'bf16', '<default>': 'fp32'}" in message  # what the checkpoint held
    assert "{'net.0': 'bf16', 'net.4': 'fp32', '<default>': 'fp32'}" in message and "is kept" in message
    assert {s: p.value for s, p in plugin.plan["compute"].entries} == mine
    precisions = plugin.executor.precisions()
    assert precisions["net.4"] is ComputePrecision.FP32 and precisions["net.0"].is_low
    assert resumed.global_step == 8  # the rest of the checkpoint (weights, optimizer, progress) resumed
    assert torch.load(path, weights_only=True)["lightning_comp"]["plan"]["entries"] == {"type:Linear": "bf16"}
    resumed.save_checkpoint(tmp_path / "mine.ckpt")  # and from now on the user's plan is the checkpoint's
    assert torch.load(tmp_path / "mine.ckpt", weights_only=True)["lightning_comp"]["plan"]["entries"] == mine


def test_the_same_explicit_plan_as_the_checkpoints_resumes_without_a_warning(
        tmp_path: Path, make_mlp: Any, make_regression_loader: Any, fast_trainer_kwargs: dict[str, Any]) -> None:
    loader = make_regression_loader()
    plan = {"type:Linear": "bf16"}
    trainer = pl.Trainer(max_epochs=1, plugins=[CoMPPrecision(plan)], **fast_trainer_kwargs)
    trainer.fit(make_mlp(), loader)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    plugin = CoMPPrecision(plan)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*checkpoint holds the plan.*")
        pl.Trainer(max_epochs=2, plugins=[plugin], **fast_trainer_kwargs).fit(make_mlp(), loader, ckpt_path=path,
                                                                              **WEIGHTS_ONLY)
    assert {s: p.value for s, p in plugin.plan["compute"].entries} == plan


def test_resume_into_a_different_model_fails_loudly(tmp_path: Path, make_mlp: Any, make_regression_loader: Any,
                                                    fast_trainer_kwargs: dict[str, Any]) -> None:
    model = make_mlp()
    trainer = pl.Trainer(max_steps=1, plugins=[CoMPPrecision({"type:Linear": "bf16"})], **fast_trainer_kwargs)
    trainer.fit(model, make_regression_loader())
    path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(path)
    plugin = CoMPPrecision()
    plugin.convert_module(make_mlp())  # a fresh instance of the same architecture: fine
    plugin.load_state_dict(torch.load(path, weights_only=True)["lightning_comp"])
    other = CoMPPrecision()
    other.convert_module(nn.Sequential(nn.Linear(8, 1)))
    with pytest.raises(PlanMismatchError, match="different model"):
        other.load_state_dict(torch.load(path, weights_only=True)["lightning_comp"])
    with pytest.raises(PlanError, match="Malformed CoMPPrecision state"):
        other.load_state_dict({"nope": 1})


def test_failed_set_plan_keeps_the_previous_plan(make_mlp: Any, make_regression_loader: Any,
                                                 fast_trainer_kwargs: dict[str, Any]) -> None:
    model = make_mlp()
    plugin = CoMPPrecision({"type:Linear": "bf16"})
    trainer = pl.Trainer(max_steps=1, plugins=[plugin], **fast_trainer_kwargs)
    trainer.fit(model, make_regression_loader())
    before = plugin.plan
    with pytest.raises(PlanMismatchError, match="'net.9'"):
        plugin.set_plan({"net.9": "bf16"})
    assert plugin.plan == before and count_forward_hooks(model) == 0  # nothing applied: still as the fit left it
    trainer.fit_loop.epoch_loop.max_steps = 2
    trainer.fit(model, make_regression_loader())  # the next fit re-applies the previous, valid plan
    assert plugin.plan == before


# ------------------------------------------------------------------------------------------------------ fp16
def test_fp16_is_declined_on_this_cpu_without_opt_in(make_mlp: Any, make_regression_loader: Any,
                                                     fast_trainer_kwargs: dict[str, Any]) -> None:
    from lightning_comp.devices import device_class
    from lightning_comp.numerics.precision import ComputePrecision

    if device_class("cpu").is_native(ComputePrecision.FP16):
        pytest.skip("this CPU has AMX-FP16: fp16 is not declined")
    model = make_mlp()
    plugin = CoMPPrecision({"type:Linear": "fp16", "net.1": "bf16"})
    with pytest.warns(UserWarning, match="fp16.*allow_slow_fp16=True"):
        pl.Trainer(max_steps=1, plugins=[plugin], **fast_trainer_kwargs).fit(model, make_regression_loader())
    assert not plugin.plan.uses("fp16") and plugin.plan.uses("bf16")
    assert plugin.executor.precisions()["net.0"] is ComputePrecision.FP32
    assert plugin.scaler is None and plugin.state_dict()["scaler"] is None


class _Explode(pl.Callback):
    """Records, per batch, whether the parameters changed and how many steps the scaler skipped."""

    def __init__(self, plugin: CoMPPrecision) -> None:
        self.plugin = plugin
        self.rows: list[tuple[int, int, bool]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.params = [p.detach().clone() for p in pl_module.parameters()]
        self.skipped = self.plugin.skipped_steps

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        unchanged = all(torch.equal(a, p) for a, p in zip(self.params, pl_module.parameters()))
        self.rows.append((args[-1], self.plugin.skipped_steps - self.skipped, unchanged))


def test_fp16_loss_scaling_skips_overflowing_steps_and_checkpoints_the_scaler(
    tmp_path: Path, make_regression_loader: Any, fast_trainer_kwargs: dict[str, Any], dtype_recorder: DtypeRecorder
) -> None:
    class Net(pl.LightningModule):
        def __init__(self, explode_at: int = -1) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
            self.explode_at = explode_at

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
            return loss * float("inf") if batch_idx == self.explode_at else loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    model = Net(explode_at=2)
    plugin = CoMPPrecision({"type:Linear": "fp16"}, allow_slow_fp16=True)
    watch = _Explode(plugin)
    trainer = pl.Trainer(max_steps=4, plugins=[plugin], callbacks=[watch], **fast_trainer_kwargs)
    trainer.fit(model, make_regression_loader())
    assert isinstance(plugin.scaler, torch.amp.GradScaler)
    assert plugin.plan.uses("fp16")
    idx, skipped, unchanged = watch.rows[2]
    assert (idx, skipped, unchanged) == (2, 1, True)  # the forced overflow: counted, and the step left params alone
    for _idx, skipped, unchanged in watch.rows:
        assert unchanged == (skipped == 1)  # every skipped step (and only those) leaves the parameters unchanged
    assert plugin.skipped_steps == sum(r[1] for r in watch.rows) >= 1 and plugin.optimizer_steps == 4
    assert all(p.dtype == FP32 for p in model.parameters())
    # fp16 really computes: the Linear matmuls see fp16 operands
    dtype_recorder.attach(model)
    with plugin.train_step_context(), dtype_recorder:  # the plugin hooks the model again for a step
        model.net(torch.randn(2, 8))
    assert dtype_recorder.ops_of("net.0", "addmm")[0].inputs == [FP16, FP16, FP16]
    dtype_recorder.detach()

    path = tmp_path / "fp16.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["lightning_comp"]
    assert state["scaler"]["scale"] == plugin.scaler.get_scale() < 2.0**16
    assert state["skipped_steps"] == plugin.skipped_steps
    resumed = CoMPPrecision(allow_slow_fp16=True)
    trainer2 = pl.Trainer(max_steps=5, plugins=[resumed], **fast_trainer_kwargs)
    trainer2.fit(Net(), make_regression_loader(), ckpt_path=path, **WEIGHTS_ONLY)
    assert resumed.scaler is not None and resumed.skipped_steps >= plugin.skipped_steps
    assert resumed.scaler.get_scale() <= state["scaler"]["scale"] * 2  # restored (not the 2**16 default)


def test_bf16_only_plans_have_no_scaler(make_mlp: Any, make_regression_loader: Any,
                                        fast_trainer_kwargs: dict[str, Any]) -> None:
    plugin = CoMPPrecision({"type:Linear": "bf16"}, allow_slow_fp16=True)
    pl.Trainer(max_steps=1, plugins=[plugin], **fast_trainer_kwargs).fit(make_mlp(), make_regression_loader())
    assert plugin.scaler is None and plugin.state_dict()["scaler"] is None
    plugin.set_plan({"type:Linear": "fp16"})
    assert isinstance(plugin.scaler, torch.amp.GradScaler)
    plugin.set_plan({"type:Linear": "bf16"})
    assert plugin.scaler is None


def test_resuming_an_fp16_checkpoint_without_opt_in_drops_the_scaler(
    tmp_path: Path, make_mlp: Any, make_regression_loader: Any, fast_trainer_kwargs: dict[str, Any]
) -> None:
    plugin = CoMPPrecision({"type:Linear": "fp16"}, allow_slow_fp16=True)
    trainer = pl.Trainer(max_steps=1, plugins=[plugin], **fast_trainer_kwargs)
    trainer.fit(make_mlp(), make_regression_loader())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    from lightning_comp.devices import device_class
    from lightning_comp.numerics.precision import ComputePrecision

    fast_fp16 = device_class("cpu").is_native(ComputePrecision.FP16)  # AMX-FP16: nothing to decline
    declining = CoMPPrecision()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(max_steps=2, plugins=[declining], **fast_trainer_kwargs).fit(
            make_mlp(), make_regression_loader(), ckpt_path=tmp_path / "a.ckpt", **WEIGHTS_ONLY
        )
    declined = [str(w.message) for w in caught if "no fast fp16" in str(w.message)]
    if fast_fp16:  # the checkpoint's fp16 plan runs as it is, with its scaler
        assert not declined and declining.plan.uses("fp16") and declining.scaler is not None
    else:
        assert declined and not declining.plan.uses("fp16") and declining.scaler is None


# ------------------------------------------------------------------------------------------------- setup
def test_plugin_cannot_be_combined_with_precision_flag() -> None:
    with pytest.raises(ValueError, match="precision"):
        pl.Trainer(accelerator="cpu", precision="bf16-mixed", plugins=[CoMPPrecision()], logger=False)


def test_plan_from_file_and_gradient_clipping(tmp_path: Path, make_mlp: Any, make_regression_loader: Any,
                                              fast_trainer_kwargs: dict[str, Any]) -> None:
    path = PrecisionPlan.from_dict({"type:Linear": "bf16"}).save(tmp_path / "plan.json")
    plugin = CoMPPrecision(path)
    model = make_mlp()
    trainer = pl.Trainer(max_steps=2, plugins=[plugin], gradient_clip_val=1e-3, **fast_trainer_kwargs)
    trainer.fit(model, make_regression_loader())
    assert plugin.plan.fingerprint is not None and plugin.executor.precisions()["net.0"].dtype == BF16


def test_deepspeed_engine_is_refused() -> None:
    DeepSpeedEngine = type("DeepSpeedEngine", (nn.Module,), {})
    with pytest.raises(UnsupportedSetupError, match="DeepSpeed"):
        CoMPPrecision().connect(DeepSpeedEngine(), [], [])


def test_the_plan_is_filed_under_one_key_whatever_the_plugin_class(tmp_path: Path, make_mlp: Any,
                                                                  make_regression_loader: Any,
                                                                  fast_trainer_kwargs: dict[str, Any]) -> None:
    """A plan saved by CoMPPrecision resumes under a subclass (the FSDP form, a user's)."""
    from lightning_comp import CoMPFSDPPrecision

    class MyPlugin(CoMPPrecision):
        pass

    trainer = pl.Trainer(max_epochs=1, plugins=[CoMPPrecision({"type:Linear": "bf16"})], **fast_trainer_kwargs)
    trainer.fit(make_mlp(), make_regression_loader())
    path = tmp_path / "saved.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert "lightning_comp" in ckpt and "CoMPPrecision" not in ckpt
    for plugin in (MyPlugin(), CoMPFSDPPrecision()):
        plugin.on_load_checkpoint(ckpt)
        assert plugin.plan["compute"].entries == (("type:Linear", ComputePrecision.BF16),), type(plugin).__name__
    resumed = MyPlugin()
    pl.Trainer(max_epochs=2, plugins=[resumed], **fast_trainer_kwargs).fit(make_mlp(), make_regression_loader(),
                                                                          ckpt_path=path)
    assert resumed.plan["compute"].entries == (("type:Linear", ComputePrecision.BF16),)  # through Lightning's restore


def test_a_searchs_chosen_plan_is_checked_for_unplanned_work_and_its_trials_are_not(
        monkeypatch: pytest.MonkeyPatch, make_regression_loader: Any, fast_trainer_kwargs: dict[str, Any]) -> None:
    """A trial is tried on purpose (no report); the plan a caller chose trains on, so what it leaves unplanned is
    reported, as for a checkpoint's plan (not as the user's own)."""
    from lightning_comp.execution.unplanned_work import UnplannedWorkWarnings

    checked: list[tuple[str | None, bool]] = []
    real = UnplannedWorkWarnings.check

    def spy(self: UnplannedWorkWarnings, executor: Any, users_own: bool, owner: str) -> Any:
        checked.append((executor.plan.provenance.get("trial"), users_own))
        return real(self, executor, users_own, owner)

    monkeypatch.setattr(UnplannedWorkWarnings, "check", spy)

    class Tries(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            plugin = trainer.precision_plugin
            plan = PrecisionPlan.from_dict({"net.0": "bf16"})
            if batch_idx == 0:
                plugin.try_plan(plan.with_provenance(trial="a trial"))
            elif batch_idx == 2:
                plugin.try_plan(plan.with_provenance(trial="the choice"), chosen=True)

    pl.Trainer(max_steps=4, plugins=[CoMPPrecision()], callbacks=[Tries()], **fast_trainer_kwargs).fit(
        TinyMLP(), make_regression_loader())
    trials = {trial for trial, _ in checked}  # None: the all-FP32 default the plugin starts with
    assert "a trial" not in trials and "the choice" in trials and not any(own for _, own in checked)
