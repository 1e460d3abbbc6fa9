"""Every operator type, lowered to bf16 and to fp16 (saving for backward as computed, or in fp8), on each GPU.

Each run is two training steps (the first calibrates cast boundaries, the second runs with them) through the
plugin's own entry points, every aten op recorded. What must hold on CUDA, and is checked for each:

- each operator's work (matmul, convolution, normalisation, recurrent cell, attention) runs in its planned dtype,
  forward and backward; an embedding computes in fp32 and emits the low dtype;
- no op has operands a CUDA kernel would reject (the recorder's rule table) and nothing is read back to the host;
- parameters and gradients are fp32 on cuda, the loss fp32, and no plan entry is reported as having no effect;
- an fp8 saved precision stores the saved activations in fp8 (and backward reads them back).
"""

from __future__ import annotations

import pytest
import torch

from lightning_comp.numerics.precision import ComputePrecision
from tests.cuda_sim.cases import CASES, Case, installed
from tests.cuda_sim.harness import check_run, run_steps
from tests.cuda_sim.simulated import SimulatedGpu

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _cases() -> list[object]:
    return [pytest.param(c, id=c.name, marks=pytest.mark.skipif(not installed(c.needs),
                                                                reason=f"needs {c.needs} (an extra)"))
            for c in CASES]


@pytest.mark.parametrize("saved", ["fp32", "fp8"])
@pytest.mark.parametrize("low", [ComputePrecision.BF16, ComputePrecision.FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", _cases())
def test_operator_computes_in_its_planned_dtype(
    gpu: SimulatedGpu, case: Case, low: ComputePrecision, saved: str
) -> None:
    run = run_steps(gpu, case, {"*": {"compute": low.value, "saved": saved}})
    check_run(run, case, low)
    if saved == "fp8":
        stored = [e for e in run.recorder.of(phase="forward", ops="_to_copy") if set(e.outputs) & set(_FP8)]
        read = [e for e in run.recorder.of(phase="backward", ops="_to_copy") if set(e.operands.values()) & set(_FP8)]
        assert stored and read, f"{case.name}: nothing saved for backward was stored in fp8 and read back"
    if low is ComputePrecision.FP16:
        assert run.plugin.scaler is not None and run.plugin.scaler.is_enabled(), "fp16 plans need a loss scaler"
        assert run.plugin.scaler._device == "cuda"  # noqa: SLF001 - the scaler is CUDA's
    else:
        assert run.plugin.scaler is None, "bf16 plans need no loss scaler"
