"""What CUDA does differently from a CPU, where the package once decided from CPU behaviour: one check per defect
the simulation found or the CUDA notes named (each fails on the code before its fix)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_comp.devices.kernel_probes import probe_recurrent
from lightning_comp.numerics.precision import ComputePrecision
from tests.cuda_sim.cases import BATCH, CLASSES, SEQ, WIDTH, Case, Head
from tests.cuda_sim.harness import check_run, run_steps
from tests.cuda_sim.simulated import SimulatedGpu, cuda_tensors, simulated_gpu


class AttentionThenNorm(nn.MultiheadAttention):
    """Attention (autocast-lowered, as every ``nn.MultiheadAttention``) whose output is normalised inside it:
    LayerNorm is on CUDA autocast's fp32 list (on CPU autocast's 16-bit one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(x, x, x, need_weights=False)[0]
        return F.layer_norm(out, (self.embed_dim,))


class AttentionProbabilities(nn.MultiheadAttention):
    """Attention that returns its averaged attention probabilities (a softmax: fp32 under CUDA autocast)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out, weights = super().forward(x, x, x, need_weights=True)
        return torch.softmax(weights, dim=-1).flatten(1) + out.mean() * 0


class ProbabilityHead(nn.Linear):
    """A Linear (autocast-lowered) ending in ``binary_cross_entropy``, which CUDA autocast refuses outright."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        p = torch.sigmoid(super().forward(x))
        return F.binary_cross_entropy(p, torch.ones_like(p), reduction="none").expand(-1, CLASSES)


@pytest.mark.parametrize("low", [ComputePrecision.BF16, ComputePrecision.FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block", [AttentionThenNorm, AttentionProbabilities], ids=lambda b: b.__name__)
def test_an_autocast_block_ending_on_cudas_fp32_list_is_in_effect(gpu: SimulatedGpu, block: type[nn.Module],
                                                                  low: ComputePrecision) -> None:
    """Its matmuls run in 16 bits and its last op in fp32 (CUDA's rule), so it returns fp32: that is no 'plan entry
    had no effect' (the post-hook once judged by the output's dtype alone)."""
    features = SEQ * WIDTH if block is AttentionThenNorm else SEQ * SEQ
    case = Case(block.__name__, lambda: Head(block(WIDTH, 2, batch_first=True), features),
                lambda: torch.randn(BATCH, SEQ, WIDTH), (block.__name__,))
    run = run_steps(gpu, case, {"*": low.value})
    check_run(run, case, low)  # includes: no "had no effect" warning
    last = run.recorder.of("body", "forward", "native_layer_norm|_softmax")
    assert last and all(e.outputs[0] == torch.float32 for e in last), "CUDA autocast computes it in fp32"
    assert run.recorder.calls and run.plugin.executor.precisions()["body"] is low


def test_binary_cross_entropy_refused_by_cuda_autocast_is_named_with_advice(gpu: SimulatedGpu) -> None:
    """CUDA autocast raises on binary_cross_entropy (CPU autocast does not); the note must say that precision is the
    cause and advise fp32 for the operator, not 'the error may not come from precision'."""
    case = Case("bce", lambda: _BceModel(), lambda: torch.randn(BATCH, WIDTH), ("ProbabilityHead",))
    run_steps(gpu, case, {}, steps=1)  # in fp32 it runs
    with pytest.raises(RuntimeError, match="unsafe to autocast") as raised:
        run_steps(gpu, case, {"*": "bf16"}, steps=1)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "'block' (ProbabilityHead) computing in bf16 (autocast lowering)" in notes
    assert "Assign it 'fp32'" in notes and "may not come from precision" not in notes


class _BceModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = ProbabilityHead(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


@pytest.mark.parametrize("low", [ComputePrecision.BF16, ComputePrecision.FP16], ids=["bf16", "fp16"])
def test_recurrent_probes_run_under_the_fake_cuda_mode_every_time(gpu: SimulatedGpu, low: ComputePrecision) -> None:
    """The probe once moved a meta module to the device, which swaps parameters: refused now and then for GRU."""
    with simulated_gpu(gpu), cuda_tensors(gpu):
        for module in (nn.GRU(4, 4), nn.LSTM(4, 4, num_layers=2, bidirectional=True), nn.RNN(4, 4)):
            for _ in range(3):
                probe_recurrent.cache_clear()  # type: ignore[attr-defined]
                probe = probe_recurrent(module, low, "cuda")
                assert probe.route == "autocast", probe.describe_failures()
