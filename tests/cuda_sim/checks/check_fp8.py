"""fp8 plan entries on simulated fp8 GPUs (sm89, sm90): what CI can check of fp8 without one.

Each run is two training steps through the plugin's own entry points (:func:`tests.cuda_sim.harness.run_steps`), with
every ``torch._scaled_mm`` call recorded (torchao's float8 tensors make it inside their own dispatch, below any
dispatch mode, so it is recorded by attribute, as torchao looks it up). What must hold:

- an fp8 entry's forward, input-gradient and weight-gradient matmuls dispatch ``_scaled_mm`` with float8 operands and
  the recipe's scales (one per tensor; one per row of each operand for rowwise's forward), all on the device: no
  scale is read back to the host (the fake tensors raise at any read, and the recorder's rules too), with a number of
  tokens (18) that is not a multiple of 16 (padded: ``_scaled_mm``'s CUDA kernels refuse it otherwise);
- master weights and gradients stay fp32 on cuda; an fp32 entry's work computes in fp32 (it never sees a float8
  tensor, which would report its original dtype, bf16, there);
- on a GPU without fp8 matmul kernels (sm80) an fp8 plan is refused before any step, naming the operators and why.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_comp import PlanError
from lightning_comp.numerics.precision import ComputePrecision
from tests.cuda_sim.cases import BATCH, CASES, CLASSES, SEQ, Case, installed
from tests.cuda_sim.checks.conftest import MODE
from tests.cuda_sim.harness import run_steps
from tests.cuda_sim.simulated import REAL, SimulatedGpu, simulated_gpu
from tests.helpers.recording import ScaledMatmulRecorder

FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}
FP8_GPUS = (SimulatedGpu((8, 9), "NVIDIA L4 (simulated)"), SimulatedGpu((9, 0), "NVIDIA H100 80GB HBM3 (simulated)"))
TARGETS = (REAL,) if MODE == "real" else FP8_GPUS
PLAN = {"0": "fp8", "1": "bf16", "2": "fp8-rowwise", "4": "fp32"}


class _Fp8Model(nn.Module):
    """Linears fp8 kernels take (sizes multiples of 16) around a GELU and a LayerNorm; logits sliced outside."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)[:, -1, :CLASSES]


def _case() -> Case:
    return Case("fp8 Linear", _Fp8Model, lambda: torch.randn(BATCH, SEQ, 32), ("Linear",))


def _plan() -> dict[str, str]:
    return {f"net.{name}": value for name, value in PLAN.items()}


@pytest.mark.parametrize("fp8_gpu", TARGETS, ids=[g.label for g in TARGETS])
def test_fp8_entries_dispatch_scaled_matmuls_with_float8_operands_and_device_scales(fp8_gpu: SimulatedGpu) -> None:
    with ScaledMatmulRecorder() as scaled:
        run = run_steps(fp8_gpu, _case(), _plan())
    assert run.precisions["net.0"] is ComputePrecision.FP8
    assert run.precisions["net.2"] is ComputePrecision.FP8_ROWWISE
    # two steps x two fp8 Linears x (forward, input gradient, weight gradient)
    assert len(scaled.calls) == 12, [c.operands for c in scaled.calls]
    assert all(set(c.operands) <= FLOAT8 for c in scaled.calls)
    assert all(set(c.devices) == {"cuda:0"} for c in scaled.calls), "a scale or an operand left the device"
    assert all(c.scale_dtypes == (torch.float32, torch.float32) for c in scaled.calls)
    assert all(c.out_dtype is torch.bfloat16 for c in scaled.calls)
    rows = BATCH * SEQ
    shapes = [c.scales for c in scaled.calls]
    # net.2's forward: one scale per row of the input, one per column of W^T, in the kernel (once per step)
    assert shapes.count(((rows, 1), (1, 64))) == 2
    # every other call takes one scale per operand: net.0's (tensorwise), and net.2's backward, where torchao runs
    # the tensorwise kernel with unit scales and applies the rows' scales to its output (the rowwise kernel is slow
    # without fast accumulation, which its rowwise recipe leaves off for gradients)
    assert sum(all(x in ((), (1,), (1, 1)) for x in s) for s in shapes) == 10
    for phase in ("forward", "backward"):  # the fp32 Linear's work: fp32 only
        work = run.recorder.work("net.4", phase)
        assert work and all(e.computes_in == torch.float32 for e in work), (phase, [e.describe() for e in work])
    gelu = run.recorder.of("net.1", "forward", "gelu")  # the bf16 GELU between them: bf16 in and out
    assert gelu and all(set(e.operands.values()) | set(e.outputs) <= {torch.bfloat16} for e in gelu)
    assert all(v == (torch.float32, "cuda") for v in run.params.values()), run.params
    assert all(v == (torch.float32, "cuda") for v in run.grads.values()), run.grads
    assert set(run.grads) == set(run.params)


@pytest.mark.skipif(MODE == "real", reason="the refusal is checked on a simulated sm80")
def test_an_fp8_plan_is_refused_where_the_gpu_has_no_fp8_matmul() -> None:
    a100 = SimulatedGpu((8, 0), "NVIDIA A100-SXM4-40GB (simulated)")
    with pytest.raises(PlanError, match=r"net\.0 \(Linear, fp8: cuda device cuda sm80 .* has no fp8 matmul"), \
            simulated_gpu(a100):
        run_steps(a100, _case(), _plan())


def _library_cases() -> list[object]:
    cases = {"litgpt": ("litgpt", "Linear"), "GPT-2": ("transformers", "Conv1D")}
    out = []
    for prefix, (needs, kind) in cases.items():
        case = next(c for c in CASES if c.name.startswith(prefix))
        out.append(pytest.param(case, kind, id=prefix, marks=pytest.mark.skipif(
            not installed(needs), reason=f"needs {needs} (an extra)")))
    return out


@pytest.mark.parametrize(("case", "kind"), _library_cases())
@pytest.mark.parametrize("fp8_gpu", TARGETS, ids=[g.label for g in TARGETS])
def test_the_projections_of_litgpt_and_gpt2_dispatch_scaled_matmuls(fp8_gpu: SimulatedGpu, case: Case,
                                                                     kind: str) -> None:
    """litgpt's Linears (GQA attention computed between its projections, RMSNorm, SwiGLU) and GPT-2's Conv1D
    projections (``torch.addmm`` with the weight transposed), every one fp8 kernels take in fp8 (the vocabulary head,
    24 wide, in bf16): no host read, fp32 masters and gradients."""
    with ScaledMatmulRecorder() as scaled:
        run = run_steps(fp8_gpu, case, {f"type:{kind}": "fp8", "*lm_head": "bf16"})
    fp8 = [n for n, p in run.precisions.items() if p is ComputePrecision.FP8]
    assert fp8 and len(scaled.calls) == 2 * 3 * len(fp8), (fp8, len(scaled.calls))
    assert all(set(c.operands) <= FLOAT8 and set(c.devices) == {"cuda:0"} for c in scaled.calls)
    assert all(v == (torch.float32, "cuda") for v in run.params.values())
    assert all(v == (torch.float32, "cuda") for v in run.grads.values()) and set(run.grads) == set(run.params)
