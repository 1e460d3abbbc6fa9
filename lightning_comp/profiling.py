"""The batch stage's measurements: per-operator time and memory in FP32 and in a low precision, and step times.

Timing is by forward pre/post hooks (forward) and by gradient hooks on each operator's output (backward: the time
from the moment an operator's output gradient is ready to the next such moment is charged to that operator, which
matches the autograd engine's reverse execution order). On CUDA, times come from CUDA events; on CPU from
``time.perf_counter``. The memory an operator holds for backward is the bytes of the tensors it saves
(``torch.autograd.graph.saved_tensors_hooks``), not counting tensors that alias parameters.

Measurements are interleaved across configurations and warm-up rounds are dropped. Each figure is the *minimum*
over the measured rounds: on a shared machine, noise (preemption, other processes' threads) only ever adds time,
so the minimum estimates an operation's own cost best.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_comp.cast_boundaries import iter_tensors as _iter_tensors
from lightning_comp.operators import iter_operators

__all__ = ["OperatorMeasurement", "ProfileResult", "OperatorProfiler", "StepTimer"]


@dataclass
class OperatorMeasurement:
    """Minimum over the measured rounds for one operator under one configuration (milliseconds, bytes)."""

    forward_ms: float = 0.0
    compute_ms: float = 0.0  # forward excluding the casts the plan inserts around the operator
    backward_ms: float = 0.0
    saved_bytes: int = 0
    calls: int = 0

    @property
    def total_ms(self) -> float:
        """Forward plus backward time."""
        return self.forward_ms + self.backward_ms

    def to_dict(self) -> dict[str, float | int]:
        """Plain-typed copy."""
        return {
            "forward_ms": round(self.forward_ms, 5),
            "compute_ms": round(self.compute_ms, 5),
            "backward_ms": round(self.backward_ms, 5),
            "total_ms": round(self.total_ms, 5),
            "saved_bytes": int(self.saved_bytes),
            "calls": int(self.calls),
        }


@dataclass
class ProfileResult:
    """Per-operator measurements and the execution order of operators for one configuration."""

    operators: dict[str, OperatorMeasurement] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    step_ms: float = 0.0
    peak_bytes: int | None = None  # peak device memory of a step (CUDA only)

    @property
    def saved_bytes(self) -> int:
        """Bytes all operators save for backward in one step."""
        return sum(m.saved_bytes for m in self.operators.values())


class _Clock:
    """Timestamps that are correct on CPU (perf_counter) and on CUDA (events on the current stream)."""

    def __init__(self, device_type: str) -> None:
        self.cuda = device_type == "cuda" and torch.cuda.is_available()

    def now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            return float(start.elapsed_time(end))
        return (end - start) * 1e3


class _RoundRecorder:
    """Hooks that time every operator of a model during one forward+backward."""

    def __init__(self, model: nn.Module, clock: _Clock) -> None:
        self.clock = clock
        self.handles: list[RemovableHandle] = []
        self.stack: list[str] = []
        self.marks: dict[str, list[list[Any]]] = defaultdict(list)  # per call: [t0, t1, t2, t3]
        self.grad_events: list[tuple[Any, str]] = []
        self.saved: dict[str, int] = defaultdict(int)
        self.order: list[str] = []
        self._param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen_storages: set[int] = set()
        self._hooked: list[torch.Tensor] = []
        self._hooked_ids: set[int] = set()
        for name, module in iter_operators(model):
            self.handles += [
                module.register_forward_pre_hook(self._pre_outer(name), prepend=True),
                module.register_forward_pre_hook(self._pre_inner(name)),
                module.register_forward_hook(self._post_inner(name), prepend=True),
                module.register_forward_hook(self._post_outer(name), always_call=True),
            ]

    def _pre_outer(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(name)
            if name not in self.marks:
                self.order.append(name)
            self.marks[name].append([self.clock.now(), None, None, None])

        return hook

    def _pre_inner(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.marks[name][-1][1] = self.clock.now()

        return hook

    def _post_inner(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.marks[name][-1][2] = self.clock.now()

        return hook

    def _post_outer(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.marks[name][-1][3] = self.clock.now()
            if self.stack:
                self.stack.pop()
            inputs = {id(t) for t in _iter_tensors(args)}
            for tensor in _iter_tensors(output):
                # An operator that hands back its input (Dropout(p=0) in training, Identity, in-place
                # activations) must not hook that tensor: its gradient event would fire together with the
                # producer's and the producer's whole backward would be charged to it.
                if not tensor.requires_grad or id(tensor) in inputs or id(tensor) in self._hooked_ids:
                    continue
                self._hooked_ids.add(id(tensor))
                self._hooked.append(tensor)  # keeps ids unique for the round
                tensor.register_hook(self._grad_hook(name))
                break

        return hook

    def _grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.grad_events.append((self.clock.now(), name))

        return hook

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.stack:
            self.saved[self.stack[-1]] += _new_storage_bytes(tensor, self._param_storages, self._seen_storages)
        return tensor

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._hooked.clear()
        self._hooked_ids.clear()

    def measurements(self, backward_end: Any) -> dict[str, OperatorMeasurement]:
        """Per-operator times for this round (sums over calls)."""
        out: dict[str, OperatorMeasurement] = {}
        for name, calls in self.marks.items():
            m = OperatorMeasurement(calls=len(calls), saved_bytes=self.saved.get(name, 0))
            for t0, t1, t2, t3 in calls:
                if t3 is None:
                    continue
                m.forward_ms += self.clock.elapsed_ms(t0, t3)
                m.compute_ms += self.clock.elapsed_ms(t1, t2)
            out[name] = m
        events = self.grad_events + [(backward_end, "")]
        for (start, name), (end, _) in zip(events, events[1:]):
            if name in out:
                out[name].backward_ms += max(0.0, self.clock.elapsed_ms(start, end))
        return out


def _min_measurements(rounds: Sequence[dict[str, OperatorMeasurement]]) -> dict[str, OperatorMeasurement]:
    names = {name for r in rounds for name in r}
    out = {}
    for name in names:
        series = [r[name] for r in rounds if name in r]
        out[name] = OperatorMeasurement(
            forward_ms=min(m.forward_ms for m in series),
            compute_ms=min(m.compute_ms for m in series),
            backward_ms=min(m.backward_ms for m in series),
            saved_bytes=int(statistics.median(m.saved_bytes for m in series)),
            calls=max(m.calls for m in series),
        )
    return out


class OperatorProfiler:
    """Measures per-operator cost of a model's training step under several configurations, interleaved.

    Args:
        model: the model whose operators are timed.
        device_type: ``"cpu"`` or ``"cuda"``.
        rounds: measured rounds per configuration (the minimum is taken).
        warmup: unmeasured rounds per configuration before the measured ones.
    """

    def __init__(self, model: nn.Module, device_type: str, rounds: int = 5, warmup: int = 2) -> None:
        self.model = model
        self.clock = _Clock(device_type)
        self.rounds = rounds
        self.warmup = warmup

    def profile(
        self, configs: dict[str, Callable[[], Any]], step: Callable[[], None]
    ) -> dict[str, ProfileResult]:
        """Time ``step`` under each configuration.

        Args:
            configs: label -> a function that puts the configuration into effect (e.g. applies a plan); if it
                returns a context manager, each measured step runs inside it.
            step: runs one forward and backward pass of the model.

        Returns:
            label -> per-operator minima and the operators' execution order.
        """
        collected: dict[str, list[dict[str, OperatorMeasurement]]] = {label: [] for label in configs}
        steps: dict[str, list[float]] = {label: [] for label in configs}
        peaks: dict[str, list[int]] = {label: [] for label in configs}
        orders: dict[str, list[str]] = {}
        for round_index in range(self.warmup + self.rounds):
            for label, activate in configs.items():
                context = activate()
                recorder = _RoundRecorder(self.model, self.clock)
                if self.clock.cuda:
                    torch.cuda.reset_peak_memory_stats()
                try:
                    start = self.clock.now()
                    # the configuration's own context (e.g. weight-cast recording) goes inside the recorder's
                    # saved-tensor hooks, so the recorder counts what that configuration really keeps for backward
                    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), _entered(context):
                        step()
                    end = self.clock.now()
                    self.clock.finish()
                finally:
                    recorder.remove()
                if round_index >= self.warmup:
                    collected[label].append(recorder.measurements(end))
                    steps[label].append(self.clock.elapsed_ms(start, end))
                    orders[label] = recorder.order
                    if self.clock.cuda:
                        peaks[label].append(int(torch.cuda.max_memory_allocated()))
        return {
            label: ProfileResult(
                _min_measurements(collected[label]), orders[label], min(steps[label]),
                max(peaks[label]) if peaks[label] else None,
            )
            for label in configs
        }


class StepTimer:
    """Times whole training steps of several configurations, interleaved, with no per-operator hooks."""

    def __init__(self, device_type: str, rounds: int = 5, warmup: int = 2) -> None:
        self.clock = _Clock(device_type)
        self.rounds = rounds
        self.warmup = warmup

    def time(self, configs: dict[str, Callable[[], Any]], step: Callable[[], None]) -> dict[str, list[float]]:
        """Run ``step`` under each configuration; return label -> measured step times in milliseconds."""
        times: dict[str, list[float]] = {label: [] for label in configs}
        for round_index in range(self.warmup + self.rounds):
            for label, activate in configs.items():
                with _activated(activate):
                    start = self.clock.now()
                    step()
                    end = self.clock.now()
                    self.clock.finish()
                if round_index >= self.warmup:
                    times[label].append(self.clock.elapsed_ms(start, end))
        return times

    def saved_bytes(self, model: nn.Module, configs: dict[str, Callable[[], Any]],
                    step: Callable[[], None]) -> dict[str, int]:
        """Bytes autograd saves for backward in one step of each configuration (unique storages, parameters excluded).

        Run after :meth:`time`, so every configuration's cast boundaries are calibrated.
        """
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        out: dict[str, int] = {}
        for label, activate in configs.items():
            seen: set[int] = set()
            sizes: list[int] = []

            def pack(tensor: torch.Tensor, seen: set[int] = seen, sizes: list[int] = sizes) -> torch.Tensor:
                sizes.append(_new_storage_bytes(tensor, params, seen))
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _activated(activate):
                step()
            out[label] = sum(sizes)
        return out


def _new_storage_bytes(tensor: torch.Tensor, skip: set[int], seen: set[int]) -> int:
    """Bytes of ``tensor``'s storage the first time it is saved (0 for a storage in ``skip``, e.g. a parameter)."""
    storage = tensor.untyped_storage()
    ptr = storage.data_ptr()
    if ptr in skip or ptr in seen:
        return 0
    seen.add(ptr)
    return storage.nbytes()


def _entered(context: Any) -> Any:
    """``context`` if it is a context manager, else a no-op one."""
    return context if hasattr(context, "__enter__") else nullcontext()


@contextmanager
def _activated(activate: Callable[[], Any]) -> Iterator[None]:
    with _entered(activate()):
        yield
