"""The user's training step on one batch, run again and again; whole steps of several plans timed side by side
(no per-operator hooks), and the bytes a step saves for backward."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_comp.adapters import lightning_internals as lightning
from lightning_comp.adapters.torch_internals import storage_key
from lightning_comp.errors import SearchConfigError
from lightning_comp.search.measurement.clocks import Clock, ClockKind, make_clock
from lightning_comp.search.measurement.process_memory import StepPeak, measure_step_peak

__all__ = ["StepTimer", "StepTimes", "TrainingStepRunner", "clock_for", "entered", "new_storage_bytes"]

L = TypeVar("L", bound=Hashable)  # what names a configuration (the search's compared plans)


class TrainingStepRunner:
    """Runs the user's ``training_step`` plus backward on one batch, without logging or stepping.

    Unsharded (one device, DDP) the LightningModule's own ``training_step`` is called (no gradient sync). Under FSDP1
    it runs through the strategy's wrapped model, as in training (the flat parameters are shards outside it), so a
    measured step includes its all-gathers and reduce-scatters; under FSDP2 the model's own units do that around
    ``training_step`` anyway.

    Args:
        pl_module: the model.
        batch: the batch.
        batch_idx: its index, as ``training_step`` receives it.
        wrapper: the FSDP1 wrapper the step must enter, with its Trainer (``None``: call ``training_step`` itself).
    """

    def __init__(self, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                 wrapper: tuple[pl.Trainer, nn.Module] | None = None) -> None:
        self.pl_module = pl_module
        self.batch = batch
        self.batch_idx = batch_idx
        self.wrapper = wrapper

    def __call__(self) -> None:
        """One forward and backward (gradients are dropped at the end).

        Raises:
            SearchConfigError: if ``training_step`` returns no loss tensor under automatic optimization.
        """
        module = self.pl_module
        module.log = _ignore  # type: ignore[method-assign]
        module.log_dict = _ignore  # type: ignore[method-assign]
        try:
            if self.wrapper is None:
                output = module.training_step(self.batch, self.batch_idx)
            else:
                output = lightning.training_step_through_wrapper(self.wrapper[0], module, self.batch, self.batch_idx)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if module.automatic_optimization:
                if not isinstance(loss, torch.Tensor):
                    raise SearchConfigError(
                        "CoMPSearch profiles the training step, but training_step returned"
                        f" {type(output).__name__} instead of a loss tensor (or a dict with 'loss')."
                    )
                loss.backward()
        finally:
            del module.log
            del module.log_dict
            for param in module.parameters():
                param.grad = None
            if self.wrapper is not None:  # FSDP1's flat parameters hold the reduced gradient shards (with
                # use_orig_params the wrapper lists the original parameters, not them): left there, the next real
                # step would add them to its own
                flat = lightning.fsdp1_flat_parameters(self.wrapper[1]).values()
                for param in (*self.wrapper[1].parameters(), *flat):
                    param.grad = None




def clock_for(clock: Clock | str) -> Clock:
    """``clock`` itself, or for a device type the clock that times it by default (``"cuda"``: CUDA events when
    CUDA is available, else wall time)."""
    if not isinstance(clock, str):
        return clock
    cuda = clock == "cuda" and torch.cuda.is_available()
    return make_clock(ClockKind.CUDA if cuda else ClockKind.WALL)


@dataclass
class StepTimes(Generic[L]):
    """Whole-step times of several configurations, per measured round (paired across configurations).

    Attributes:
        ms: label -> step times as the clock counts them.
        wall_ms: label -> the same steps' real time.
    """

    ms: dict[L, list[float]] = field(default_factory=dict)
    wall_ms: dict[L, list[float]] = field(default_factory=dict)


class StepTimer:
    """Times whole training steps of several configurations, interleaved, with no per-operator hooks.

    Args:
        clock: the clock, or a device type for its default.
        rounds: measured rounds per configuration.
        warmup: unmeasured rounds per configuration before the measured ones.
    """

    def __init__(self, clock: Clock | str, rounds: int = 5, warmup: int = 2) -> None:
        self.clock = clock_for(clock)
        self.rounds = rounds
        self.warmup = warmup
        self.on_round: Callable[[], None] | None = None  # called after each round (warm-up ones too)

    def time(self, configs: Mapping[L, Callable[[], Any]], step: Callable[[], None],
             into: StepTimes[L] | None = None, rounds: int | None = None, warmup: int | None = None) -> StepTimes[L]:
        """Run ``step`` under each configuration.

        Args:
            configs: label -> a function that puts the configuration into effect (may return a context manager).
            step: one training step.
            into: earlier times to add the new rounds to (in place); a new :class:`StepTimes` if ``None``.
            rounds: measured rounds (default: the timer's).
            warmup: unmeasured rounds first (default: the timer's).
        """
        out: StepTimes[L] = into if into is not None else StepTimes()
        for label in configs:
            out.ms.setdefault(label, [])
            out.wall_ms.setdefault(label, [])
        warm = self.warmup if warmup is None else warmup
        for round_index in range(warm + (self.rounds if rounds is None else rounds)):
            for label, activate in configs.items():
                with _activated(activate):
                    start = self.clock.now()
                    step()
                    end = self.clock.now()
                    self.clock.finish()
                if round_index >= warm:
                    out.ms[label].append(self.clock.elapsed_ms(start, end))
                    out.wall_ms[label].append(self.clock.wall_ms(start, end))
            if self.on_round is not None:
                self.on_round()
        return out

    def saved_bytes(self, model: nn.Module, configs: Mapping[L, Callable[[], Any]],
                    step: Callable[[], None]) -> dict[L, int]:
        """Bytes autograd saves for backward in one step of each configuration (unique storages, parameters excluded).

        Run after :meth:`time`, so every configuration's cast boundaries are calibrated.
        """
        params = {storage_key(p) for p in model.parameters()}
        out: dict[L, int] = {}
        for label, activate in configs.items():
            seen: set[int] = set()
            sizes: list[int] = []

            def pack(tensor: torch.Tensor, seen: set[int] = seen, sizes: list[int] = sizes) -> torch.Tensor:
                sizes.append(new_storage_bytes(tensor, params, seen))
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _activated(activate):
                step()
            out[label] = sum(sizes)
        return out

    def step_peaks(self, configs: Mapping[L, Callable[[], Any]], step: Callable[[], None],
                   device: torch.device | str | None = None,
                   held: Callable[[], int] | None = None) -> dict[L, StepPeak]:
        """The peak the process needs for one step of each configuration (one extra step each).

        Run after :meth:`time`, so every configuration is warm and its peak is a steady step's.

        Args:
            configs: label -> a function that puts the configuration into effect.
            step: one training step.
            device: where the step runs (a CUDA device also reads the allocator's peaks).
            held: the bytes of tensors the step starts with (e.g. :func:`held_tensor_bytes`), read with the
                configuration in effect; it completes each peak's :attr:`StepPeak.tensor_bytes` on a CPU.
        """
        out: dict[L, StepPeak] = {}
        for label, activate in configs.items():
            with _activated(activate):
                start = None if held is None else held()
                peak = measure_step_peak(step, device)
                out[label] = peak if start is None else replace(peak, held_bytes=start)
        return out


def new_storage_bytes(tensor: torch.Tensor, skip: set[int], seen: set[int]) -> int:
    """Bytes of ``tensor``'s storage the first time it is saved (0 for a storage in ``skip``, e.g. a parameter)."""
    key = storage_key(tensor)
    if key in skip or key in seen:
        return 0
    seen.add(key)
    return tensor.untyped_storage().nbytes()


def entered(context: Any) -> Any:
    """``context`` if it is a context manager, else a no-op one."""
    return context if hasattr(context, "__enter__") else nullcontext()


@contextmanager
def _activated(activate: Callable[[], Any]) -> Iterator[None]:
    with entered(activate()):
        yield


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
