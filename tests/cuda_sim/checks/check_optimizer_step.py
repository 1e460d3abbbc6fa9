"""The managed optimizer step reads nothing back from the device: 8-bit moments, bf16 moments and a bf16 master
rounded stochastically, on the eager path and through the functions the compiled path traces.

A read back (``.item()``, ``bool(tensor)``) is an ``aten._local_scalar_dense`` call; on CUDA it waits for the device.
The checks record every such call during the step, on real CPU tensors (the simulation's fake tensors raise at any
read, the step counter's included), and allow reads of the step counters only: ``torch.optim.Adam`` keeps them on
the CPU (non-capturable) on every device, so reading them costs no synchronisation, as in Adam's own step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_comp.execution import fused_adam
from lightning_comp.execution import update_path as update_path_module
from lightning_comp.execution.optimizer_states import OptimizerStates, ParameterTreatment
from lightning_comp.numerics.precision import MasterPrecision, StatePrecision


class _HostReads(TorchDispatchMode):
    """Records the tensors whose values are read back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self.read.append(args[0])
        return func(*args, **(kwargs or {}))


def _eager(state: StatePrecision) -> Any:
    return {StatePrecision.FP32: fused_adam.step_fp32_moments, StatePrecision.BF16: fused_adam.step_bf16_moments,
            StatePrecision.INT8: fused_adam.step_8bit_moments}[state]


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_the_managed_step_reads_back_only_the_cpu_step_counters(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "compiled":  # the functions the compiled path traces, run as they are
        monkeypatch.setattr(update_path_module, "_kernel", _eager)
    torch.manual_seed(0)
    big, small = nn.Parameter(torch.randn(64 * 128)), nn.Parameter(torch.randn(64 * 128))
    big.data = big.data.bfloat16()  # a bf16 master
    optimizer = torch.optim.AdamW([big, small], lr=1e-3)
    states = OptimizerStates(path)
    states._treatments = {id(big): ParameterTreatment(StatePrecision.INT8, MasterPrecision.BF16),
                          id(small): ParameterTreatment(StatePrecision.BF16, MasterPrecision.FP32)}
    states._names = {id(big): "big", id(small): "small"}
    for step in range(3):
        big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
        recorder = _HostReads()
        with recorder:
            states.step(optimizer, optimizer.step)
        counters = [optimizer.state[p]["step"] for p in (big, small)]
        assert all(c.device.type == "cpu" and c.dim() == 0 for c in counters)
        others = [t for t in recorder.read if not any(t.data_ptr() == c.data_ptr() for c in counters)]
        assert not others, f"step {step}: read back {[(tuple(t.shape), t.dtype) for t in others]}"
    assert optimizer.state[big]["exp_avg"].dtype == torch.uint8 and big.dtype == torch.bfloat16
    assert optimizer.state[small]["exp_avg_sq"].dtype == torch.bfloat16  # rounded stochastically: no read either
    assert states.updates.compiled_steps == (4 if path == "compiled" else 0)
