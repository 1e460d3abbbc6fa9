"""What a recompute operator's forward depended on besides its inputs, captured at its call and put back to re-run it.

- The RNG states it started from (:class:`RngState`): the CPU's, and that of every accelerator an input lives on,
  as ``torch.utils.checkpoint`` preserves them, so dropout draws the same mask again; the re-run restores the RNG
  state it found.
- The autocast state around it (:func:`autocast_state`): enabled, dtype and cache of the CPU's and the step's
  device's autocast.
- Its buffers as the forward found them (:func:`buffer_copies`): the re-run computes with copies of them and
  mutates only those, so BatchNorm's running statistics and ``num_batches_tracked`` are updated once per step. All
  buffers are copied, at every recorded call: kernels such as batch norm's update their statistics without bumping
  the tensor's version, so which ones a forward mutates cannot be told cheaply (the search offers ``recompute`` to
  no operator holding more than :data:`~lightning_comp.execution.recompute.suitability.MAX_BUFFER_BYTES` of them).

:func:`reproduced` puts all of it in force, under ``torch.no_grad()``, around a re-run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from lightning_comp.adapters.torch_internals import reparametrized

__all__ = ["AutocastState", "RngState", "autocast_state", "buffer_copies", "reproduced"]

#: Per device type: autocast enabled, its dtype, and whether its cast cache is enabled.
AutocastState = list[tuple[str, bool, torch.dtype, bool]]


def autocast_state(device: torch.device | None) -> AutocastState:
    """The autocast state in force now for the CPU and for ``device`` (the step's device; ``None``: the CPU's)."""
    types = ["cpu"] if device is None or device.type == "cpu" else ["cpu", device.type]
    cache = torch.is_autocast_cache_enabled()
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t), cache) for t in types]


def buffer_copies(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``module``'s buffers (dotted names reach into children) as they are now."""
    return {n: b.clone() for n, b in module.named_buffers()}


@dataclass(frozen=True)
class RngState:
    """The RNG states a forward started from: the CPU's, and those of the accelerators its inputs live on."""

    cpu: torch.Tensor
    device_type: str
    devices: list[int]
    states: list[torch.Tensor]

    @staticmethod
    def capture(inputs: list[torch.Tensor]) -> RngState:
        """The RNG states now, of the CPU and of the accelerators ``inputs`` live on."""
        device_type = next((t.device.type for t in inputs if t.device.type not in ("cpu", "meta")), "cuda")
        devices, states = get_device_states(*inputs)  # (none for CPU tensors: no accelerator is touched)
        return RngState(torch.get_rng_state(), device_type, devices, states)

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Inside: the RNG states as captured; after: as they were before."""
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu)
            if self.devices:
                set_device_states(self.devices, self.states, device_type=self.device_type)
            yield


@contextmanager
def reproduced(module: nn.Module, rng: RngState | None, autocast: AutocastState,
               buffers: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside: ``module``'s forward computes as it did when ``rng``, ``autocast`` and ``buffers`` were captured,
    under ``torch.no_grad()``, mutating copies of ``buffers`` only (the step's own update happened once, in the step).
    """
    with ExitStack() as stack:
        if rng is not None:
            stack.enter_context(rng.restored())
        for device_type, enabled, dtype, cache in autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
        stack.enter_context(torch.no_grad())
        if buffers:
            stack.enter_context(reparametrized(module, {n: b.clone() for n, b in buffers.items()}))
        yield
