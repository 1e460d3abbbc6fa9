"""A sentinel on CUDA's autocast op lists: what the package's lowerings and these checks assume of them.

If a torch upgrade moves an op between lists, the test names it; then revisit the lowerings (``devices/lowering.py``)
and ``CUDA_AUTOCAST_FP32_WORK`` in the harness. CPU autocast's answer is recorded beside it: where the two differ is
why CUDA needs its own checks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tests.cuda_sim.simulated import SimulatedGpu, cuda_tensors, simulated_gpu

BF16, FP32 = torch.bfloat16, torch.float32
RAISES = "raises"

# op -> (what it returns under autocast("cuda", bf16), under autocast("cpu", bf16)). Matmul-like ops are given fp32
# inputs (does autocast lower them?), the others bf16 inputs, as they get them after a lowered op (does autocast cast
# them up, or let them run in bf16?).
EXPECTED: dict[str, tuple[object, object]] = {
    "mm": (BF16, BF16),
    "linear": (BF16, BF16),
    "conv2d": (BF16, BF16),
    "bmm": (BF16, BF16),
    "scaled_dot_product_attention": (BF16, BF16),
    "gru_cell": (BF16, FP32),  # CUDA's fused GRU cell is on its low list; on CPU it is on none (runs as given)
    "lstm_cell": (BF16, FP32),
    "softmax": (FP32, BF16),
    "log_softmax": (FP32, BF16),
    "layer_norm": (FP32, BF16),
    "group_norm": (FP32, BF16),
    "exp": (FP32, BF16),
    "cross_entropy": (FP32, FP32),
    "mse_loss": (FP32, FP32),
    "binary_cross_entropy": (RAISES, FP32),  # refused by CUDA autocast only; on CPU its fp32 list
    "cat": (BF16, BF16),  # cat has an AutocastCPU kernel and no AutocastCUDA one; both promote (all bf16 here)
}
FROM_FP32 = frozenset({"mm", "linear", "conv2d", "bmm", "scaled_dot_product_attention", "gru_cell", "lstm_cell"})


def _ops(device: str, dtype: torch.dtype) -> dict[str, Callable[[], torch.Tensor]]:
    def t(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, device=device).to(dtype)

    w = t(6, 4)
    return {
        "mm": lambda: t(3, 4) @ t(4, 5),
        "linear": lambda: F.linear(t(3, 4), t(5, 4)),
        "conv2d": lambda: F.conv2d(t(1, 2, 5, 5), t(3, 2, 3, 3)),
        "bmm": lambda: torch.bmm(t(2, 3, 4), t(2, 4, 5)),
        "scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(t(1, 2, 3, 4), t(1, 2, 3, 4),
                                                                                t(1, 2, 3, 4)),
        "gru_cell": lambda: torch.gru_cell(t(3, 4), t(3, 2), w, t(6, 2), t(6), t(6)),
        "lstm_cell": lambda: torch.lstm_cell(t(3, 4), (t(3, 2), t(3, 2)), t(8, 4), t(8, 2), t(8), t(8))[0],
        "softmax": lambda: torch.softmax(t(3, 4), -1),
        "log_softmax": lambda: torch.log_softmax(t(3, 4), -1),
        "layer_norm": lambda: F.layer_norm(t(3, 4), (4,)),
        "group_norm": lambda: F.group_norm(t(2, 4, 3), 2),
        "exp": lambda: torch.exp(t(3)),
        "cross_entropy": lambda: F.cross_entropy(t(3, 4), torch.zeros(3, dtype=torch.long, device=device)),
        "mse_loss": lambda: F.mse_loss(t(3), t(3)),
        "binary_cross_entropy": lambda: F.binary_cross_entropy(t(3), t(3)),
        "cat": lambda: torch.cat([t(3), t(3)]),
    }


def _answer(device: str, op: str) -> object:
    try:
        with torch.autocast(device, dtype=BF16):
            return _ops(device, FP32 if op in FROM_FP32 else BF16)[op]().dtype
    except RuntimeError as err:
        if "autocast" not in str(err):
            raise
        return RAISES


@pytest.mark.parametrize("op", sorted(EXPECTED))
def test_cuda_autocast_list_sentinel(gpu: SimulatedGpu, op: str) -> None:
    with simulated_gpu(gpu), cuda_tensors(gpu):
        cuda = _answer("cuda", op)
    cpu = _answer("cpu", op)
    assert (cuda, cpu) == EXPECTED[op], (f"torch {torch.__version__} changed {op!r} under autocast: cuda {cuda},"
                                         f" cpu {cpu} (expected cuda {EXPECTED[op][0]}, cpu {EXPECTED[op][1]})")
