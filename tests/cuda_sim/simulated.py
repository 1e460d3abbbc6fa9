"""A simulated CUDA GPU of a given compute capability, for a process that loaded the shim (see ``shim.py``).

:func:`simulated_gpu` patches what torch and lightning-comp ask about the GPU (availability, count, current device,
capability, name, BF16 support as a real GPU of that generation answers it, and AMP's "definitely not available"
check that would switch ``torch.autocast("cuda")`` and ``GradScaler("cuda")`` off), and clears the package's cached
device answers on entry and exit. :func:`cuda_tensors` is where modules and tensors live on "cuda": a
``FakeTensorMode`` (tensors with metadata only, whose dispatch keys carry ``AutocastCUDA``, so CUDA's autocast lists
apply). On a real GPU both are no-ops, so the same checks run against the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_comp.devices.device_classes import device_class
from lightning_comp.devices.kernel_probes import probe_recurrent

__all__ = ["GPUS", "REAL", "SimulatedGpu", "cuda_tensors", "simulated_gpu"]


@dataclass(frozen=True)
class SimulatedGpu:
    """A GPU generation to simulate: its compute capability and a name (``None`` capability: the real device)."""

    capability: tuple[int, int] | None
    name: str

    @property
    def label(self) -> str:
        """``"sm80"`` (``"real"`` for the real device)."""
        return "real" if self.capability is None else f"sm{self.capability[0]}{self.capability[1]}"

    @property
    def simulated(self) -> bool:
        return self.capability is not None


GPUS = (
    SimulatedGpu((7, 0), "Tesla V100-SXM2-16GB (simulated)"),
    SimulatedGpu((7, 5), "Tesla T4 (simulated)"),
    SimulatedGpu((8, 0), "NVIDIA A100-SXM4-40GB (simulated)"),
    SimulatedGpu((9, 0), "NVIDIA H100 80GB HBM3 (simulated)"),
)
REAL = SimulatedGpu(None, "the real device")


def _forget_device_answers() -> None:
    device_class.cache_clear()  # type: ignore[attr-defined]
    probe_recurrent.cache_clear()  # type: ignore[attr-defined]


@contextlib.contextmanager
def simulated_gpu(gpu: SimulatedGpu) -> Iterator[SimulatedGpu]:
    """Make torch and lightning-comp see ``gpu`` as ``cuda:0`` (the real device, unpatched, for :data:`REAL`)."""
    if not gpu.simulated:
        _forget_device_answers()
        yield gpu
        return
    assert gpu.capability is not None
    major = gpu.capability[0]

    def bf16_supported(including_emulation: bool = True) -> bool:
        # every CUDA GPU runs bf16 with emulation; natively from sm80 (torch.cuda.is_bf16_supported's own rule)
        return major >= 8 or bool(including_emulation)

    patches = [
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.device_count", return_value=1),
        mock.patch("torch.cuda.current_device", return_value=0),
        mock.patch("torch.cuda.get_device_capability", return_value=gpu.capability),
        mock.patch("torch.cuda.get_device_name", return_value=gpu.name),
        mock.patch("torch.cuda.is_bf16_supported", side_effect=bf16_supported),
        mock.patch("torch.cuda.amp.common.amp_definitely_not_available", return_value=False),
    ]
    # Attention falls back to the math kernel here, which would up-cast 16-bit inputs to fp32; the fused kernels a
    # GPU runs (flash, memory-efficient, cuDNN) compute in the 16-bit dtype, and so does the math kernel with this.
    reduction = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
        stack.callback(torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp, reduction)
        _forget_device_answers()
        stack.callback(_forget_device_answers)
        yield gpu


class _FakeCudaMode(FakeTensorMode):
    """Fake tensors that never touch a device, even while ``torch.cuda.is_available()`` is patched to say yes
    (fake mode would otherwise constant-propagate a CPU tensor's move to "cuda" by running it for real)."""

    @property
    def avoid_device_init(self) -> bool:
        return True


def cuda_tensors(gpu: SimulatedGpu) -> contextlib.AbstractContextManager[Any]:
    """Where tensors on "cuda" exist: a fake-tensor mode when simulated, nothing on the real device.

    Build modules outside it and move them in (``.to("cuda")`` inside): building RNNs inside it fails now and then
    on their flat-weight weak references.
    """
    if not gpu.simulated:
        return contextlib.nullcontext()
    return _FakeCudaMode(allow_non_fake_inputs=True)


def _register_missing_meta_kernels() -> None:
    """Meta kernels torch 2.13 lacks for CUDA's fused GRU cell (the cell LSTM/GRU run without cuDNN)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key  # noqa: SLF001
    if not has("aten::_thnn_fused_gru_cell", "Meta"):
        @torch.library.impl("aten::_thnn_fused_gru_cell", "Meta")
        def _gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
                      input_bias: torch.Tensor | None = None,
                      hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            return hx.new_empty(hx.shape), hx.new_empty((hx.size(0), hx.size(1) * 5))
    if not has("aten::_thnn_fused_gru_cell_backward", "Meta"):
        @torch.library.impl("aten::_thnn_fused_gru_cell_backward", "Meta")
        def _gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor,
                               has_bias: bool) -> tuple[torch.Tensor, ...]:
            n, h = grad_hy.shape
            gates = grad_hy.new_empty((n, 3 * h))
            bias = grad_hy.new_empty((3 * h,)) if has_bias else grad_hy.new_empty((0,))
            return gates, grad_hy.new_empty((n, 3 * h)), grad_hy.new_empty((n, h)), bias, bias.clone()


_register_missing_meta_kernels()
