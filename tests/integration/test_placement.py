"""Everything device-dependent is decided where the model trains, after Lightning placed it, never at
``convert_module`` (which Lightning calls before the move). On a CPU machine the move is real: a model built on the
meta device (deferred initialisation) is materialised on the CPU by the strategy, as a CPU-built model is moved to a
GPU on a CUDA run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from lightning_comp import CoMPPrecision, CoMPSearch
from tests.helpers.models import TinyMLP, regression_loader


class _Materialize(SingleDeviceStrategy):
    """Places a model built on the meta device (deferred initialisation) by materialising it on the CPU: the model
    is somewhere else at ``convert_module`` than at its first step, as a CPU-built model is on a GPU run."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(device=torch.device("cpu"))
        self.state = state
        self.events: list[str] = []

    def model_to_device(self) -> None:
        assert self.model is not None
        self.events.append("placed")
        self.model.to_empty(device=self.root_device)
        self.model.load_state_dict(self.state)


class _StepDevices(Callback):
    def __init__(self) -> None:
        self.devices: list[str | None] = []
        self.autocast: list[bool] = []
        self.grad_dtypes: set[torch.dtype | None] = set()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grad_dtypes |= {None if p.grad is None else p.grad.dtype for p in pl_module.parameters()}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        plugin = trainer.precision_plugin
        assert isinstance(plugin, CoMPPrecision)
        self.devices.append(None if plugin.executor.device is None else plugin.executor.device.type)


def _meta_model() -> tuple[TinyMLP, dict[str, torch.Tensor]]:
    state = TinyMLP().state_dict()
    with torch.device("meta"):
        model = TinyMLP()
    return model, state


def _trainer(strategy: SingleDeviceStrategy, plugin: CoMPPrecision, callbacks: list[Callback], **kwargs: Any
             ) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, plugins=[plugin], callbacks=callbacks, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kwargs)


def test_a_model_moved_after_convert_module_is_hooked_for_where_it_trains(dtype_recorder: Any) -> None:
    """Lightning calls ``convert_module`` before it places the model: the hooks, the autocast device and each
    operator's lowering must follow the device the model trains on (here: built on meta, trained on the CPU)."""
    model, state = _meta_model()
    strategy = _Materialize(state)
    plugin = CoMPPrecision({"type:Linear": "bf16"})
    probe = _StepDevices()

    class Record(Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            dtype_recorder.attach(pl_module, ("net.0", "net.2", "net.4"))
            dtype_recorder.__enter__()

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            dtype_recorder.__exit__(None, None, None)

    _trainer(strategy, plugin, [probe, Record()], max_steps=3).fit(model, regression_loader())
    assert strategy.events == ["placed"]
    assert probe.devices == ["cpu"] * 3
    assert plugin.device is not None and plugin.device.type == "cpu"  # the class of the device it trains on
    for name in ("net.0", "net.2", "net.4"):  # each Linear computed in bf16 on the CPU
        matmuls = dtype_recorder.ops_of(name, "addmm", "mm")
        assert matmuls and all(torch.bfloat16 in r.inputs for r in matmuls), name
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert probe.grad_dtypes == {torch.float32}  # every parameter's gradient, as the optimizer steps it


def test_an_fp16_plan_builds_its_loss_scaler_for_the_placed_device() -> None:
    model, state = _meta_model()
    plugin = CoMPPrecision({"type:Linear": "fp16"}, allow_slow_fp16=True)
    _trainer(_Materialize(state), plugin, [], max_steps=2).fit(model, regression_loader())
    assert isinstance(plugin.scaler, torch.amp.GradScaler)
    assert plugin.scaler._device == "cpu"  # noqa: SLF001 - the only record of the scaler's device
    assert plugin.optimizer_steps == 2


def test_the_search_resolves_auto_from_the_placed_device(tmp_path: Path) -> None:
    """``CoMPSearch(low_precision="auto")`` asks the device the model trains on: on the meta device nothing is
    native, so deciding before placement would always skip the search."""
    from tests.helpers.search_models import WideMLP, loaders

    torch.manual_seed(0)
    state = WideMLP(width=32).state_dict()
    with torch.device("meta"):
        model = WideMLP(width=32)
    search = CoMPSearch(warmup_epochs=0, include=["l2"], exclude=["l1", "l3", "l4", "head", "a?"], verbose=False,
                        measurement={"profile_steps": 1, "profile_warmup": 0}, record_dir=str(tmp_path))
    train, val = loaders(n_train=64, n_val=64, batch_size=32)
    _trainer(_Materialize(state), CoMPPrecision(), [search], max_epochs=2).fit(model, train, val)
    record = search.record
    assert record is not None
    from lightning_comp.devices.device_classes import device_class

    cpu = device_class("cpu")
    expected = "bf16" if cpu.is_native("bf16") else "fp16" if cpu.is_native("fp16") else None
    assert record["low_precision"] == expected, cpu
    if expected is not None:  # a native 16-bit precision here: the search really ran its trials
        assert len(record["trials"]) >= 2


def test_the_device_is_probed_only_after_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spy on the one device probe: nothing asks what the device can do between ``convert_module`` and the
    placement, and every question is about the device the model trains on."""
    from lightning_comp.devices import device_classes as devices

    devices.device_class.cache_clear()  # type: ignore[attr-defined]
    events: list[str] = []
    real = devices._device_class

    def spy(device: torch.device) -> Any:
        events.append(f"probe {device.type}")
        return real(device)

    monkeypatch.setattr(devices, "_device_class", spy)

    class Spied(CoMPPrecision):
        def convert_module(self, module: nn.Module) -> nn.Module:
            events.append("convert_module")
            return super().convert_module(module)

    model, state = _meta_model()
    strategy = _Materialize(state)
    strategy.events = events
    _trainer(strategy, Spied({"type:Linear": "bf16"}), [], max_steps=1).fit(model, regression_loader())
    assert events.index("convert_module") + 1 == events.index("placed"), events
    assert "probe cpu" in events and "probe meta" not in events, events


def test_moving_the_model_between_steps_re_hooks_it(dtype_recorder: Any) -> None:
    """Outside Lightning too: nothing is decided at ``convert_module``; the first step hooks the model for its
    device, and a step after a move rebuilds the hooks for the new one (meta has no autocast: parameter copies)."""
    model = TinyMLP()
    plugin = CoMPPrecision({"type:Linear": "bf16"})
    plugin.convert_module(model)
    assert plugin.executor.num_hooks == 0 and plugin.device is None  # nothing decided before placement
    with plugin.train_step_context():
        out = model(torch.randn(4, 8))
    # the 3 Linears hooked; the 2 fp32 ReLUs only for that first (calibrating) step: they change nothing
    assert plugin.executor.device == torch.device("cpu") and plugin.executor.num_hooks == 6
    assert plugin.executor.hooked_operators() == {"net.0", "net.2", "net.4"}
    assert out.dtype == torch.float32
    model.to("meta")
    dtype_recorder.attach(model, ("net.0",))
    with plugin.train_step_context(), dtype_recorder:
        out = model(torch.randn(4, 8, device="meta"))
    assert plugin.executor.device == torch.device("meta") and next(model.parameters()).device.type == "meta"
    assert out.device.type == "meta" and out.dtype == torch.float32
    matmuls = dtype_recorder.ops_of("net.0", "addmm", "mm", "linear")
    assert matmuls and all(torch.bfloat16 in r.inputs for r in matmuls)


def test_a_scaler_loaded_before_placement_follows_the_model_to_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's fp16 scaler loaded before the model is known is built for a guessed device; once the model is
    placed elsewhere, the scaler is rebuilt there."""
    from lightning_comp.execution.loss_scaling import ScalerSlot

    slot = ScalerSlot()
    state = {**torch.amp.GradScaler("cpu").state_dict(), "scale": 1024.0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the guess: cuda
    slot.load(state, uses_fp16=True, model_known=False)
    monkeypatch.undo()
    assert slot.scaler is not None and slot.scaler._device == "cuda"  # noqa: SLF001
    slot.sync(uses_fp16=True, device_type="cpu")  # the model trains on the CPU
    assert slot.scaler is not None and slot.scaler._device == "cpu"  # noqa: SLF001
    assert slot.scaler.get_scale() == 1024.0  # the checkpoint's scale came along
