"""What the package decides per GPU generation: device class, ``low_precision="auto"``, each operator's lowering,
and re-hooking when the model moves between devices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_comp import CoMPPrecision
from lightning_comp.devices import device_class
from lightning_comp.devices.lowering import Lowering, lowering_for
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.search.config import SearchConfig
from tests.cuda_sim.cases import CASES, loss_of
from tests.cuda_sim.recorder import CudaRecorder
from tests.cuda_sim.simulated import SimulatedGpu, cuda_tensors, simulated_gpu


def _major(gpu: SimulatedGpu) -> int:
    return gpu.capability[0] if gpu.capability is not None else torch.cuda.get_device_capability()[0]


def test_device_class_and_auto_low_precision(gpu: SimulatedGpu) -> None:
    with simulated_gpu(gpu):
        cuda = device_class("cuda")
        assert cuda.type == "cuda"
        native_bf16 = _major(gpu) >= 8
        assert cuda.is_native(ComputePrecision.FP16)
        assert cuda.is_native(ComputePrecision.BF16) is native_bf16
        assert cuda.runs(ComputePrecision.BF16)  # emulated before sm80, still runs
        auto = SearchConfig().resolve_low_precision(cuda)
        assert auto is (ComputePrecision.BF16 if native_bf16 else ComputePrecision.FP16)
        if gpu.simulated:
            assert cuda.capability == gpu.label and cuda.name == gpu.name


@pytest.mark.parametrize("low", [ComputePrecision.BF16, ComputePrecision.FP16], ids=["bf16", "fp16"])
def test_lowering_of_each_operator_type(gpu: SimulatedGpu, low: ComputePrecision) -> None:
    expected = {nn.Linear(4, 4): Lowering.AUTOCAST, nn.Conv2d(3, 4, 3): Lowering.AUTOCAST,
                nn.MultiheadAttention(4, 2): Lowering.AUTOCAST,
                # CUDA's LayerNorm/GroupNorm/RMSNorm kernels refuse a 16-bit input with fp32 weights
                nn.LayerNorm(4): Lowering.PARAMS, nn.GroupNorm(2, 4): Lowering.PARAMS, nn.RMSNorm(4): Lowering.PARAMS,
                nn.BatchNorm1d(4): Lowering.INPUT, nn.Embedding(8, 4): Lowering.OUTPUT, nn.GELU(): Lowering.INPUT,
                nn.LSTM(4, 4): Lowering.AUTOCAST, nn.GRU(4, 4): Lowering.AUTOCAST}
    with simulated_gpu(gpu), cuda_tensors(gpu):
        found = {type(m).__name__: lowering_for(m, low, "cuda") for m in expected}
    assert found == {type(m).__name__: lowering for m, lowering in expected.items()}


def test_moving_the_model_between_devices_rehooks_it(gpu: SimulatedGpu) -> None:
    """Hooked on the CPU (as after ``connect`` on a CPU), then moved: the next step re-hooks it for CUDA, and the fp16
    loss scaler moves with its state."""
    case = next(c for c in CASES if c.name == "LayerNorm")
    torch.manual_seed(0)
    model = case.build().train()
    plugin = CoMPPrecision({"*": "fp16"}, allow_slow_fp16=True)
    with simulated_gpu(gpu):
        plugin.convert_module(model)
        plugin.connect(model, [], [])
        assert plugin.device is not None and plugin.device.type == "cpu"
        assert plugin.scaler is not None
        plugin.scaler.load_state_dict({**plugin.scaler.state_dict(), "scale": 1024.0, "_growth_tracker": 3})
        with cuda_tensors(gpu):
            model.to("cuda")
            modules = dict(model.named_modules())
            recorder = CudaRecorder(model, {n: modules[n] for n in plugin.executor.precisions()})
            with recorder, plugin.train_step_context():
                loss = loss_of(model(case.batch().to("cuda")))
            recorder.detach()
        assert plugin.device is not None and plugin.device.type == "cuda"
        assert {e.computes_in for e in recorder.work("body.1", "forward")} == {torch.float16}
        assert loss.dtype == torch.float32 and loss.device.type == "cuda"
        assert plugin.scaler._device == "cuda"  # noqa: SLF001
        assert plugin.scaler.state_dict()["scale"] == 1024.0 and plugin.scaler.state_dict()["_growth_tracker"] == 3
