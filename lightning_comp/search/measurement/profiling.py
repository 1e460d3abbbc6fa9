"""The batch stage's measurements: per-operator time and memory in FP32 and in a low precision, and step times.

Timing is by forward pre/post hooks (forward) and by gradient hooks on each operator's output (backward: the time
from the moment an operator's output gradient is ready to the next such moment is charged to that operator, which
matches the autograd engine's reverse execution order). A ``FUNCTIONAL`` operator (a container computing between its
children) is charged its own work only: its children's forward time is taken off its own, and the tensors its own
work hands to a child get gradient hooks of its own, so that the backward of its work (from the moment a child's
input gradient is ready) is charged to it and not to the child that ran before. What a millisecond counts is the clock's
(:mod:`lightning_comp.search.measurement.clocks`): CUDA events, wall time, or the measuring thread's CPU time; wall
time is kept beside a CPU-time measurement. The memory an operator holds for backward is the bytes of the tensors
it saves (``torch.autograd.graph.saved_tensors_hooks``), not counting tensors that alias parameters.

Measurements are interleaved across configurations and warm-up rounds are dropped. Every measured round is kept
(``ProfileResult.rounds``), so comparisons can be made round by round
(:mod:`lightning_comp.search.measurement.estimates`); the summary figure of each operator is the *minimum* over the
rounds: noise only ever adds time. More rounds can be added to a finished profile (:meth:`OperatorProfiler.extend`)
when the first ones cannot tell two configurations apart.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_comp.adapters.torch_internals import storage_key
from lightning_comp.common.nested import tensors
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.operators.kinds import is_functional
from lightning_comp.search.measurement.clocks import Clock, ClockKind
from lightning_comp.search.measurement.step_timing import clock_for, entered, new_storage_bytes

__all__ = ["OperatorMeasurement", "OperatorProfiler", "ProfileResult"]

L = TypeVar("L", bound=Hashable)  # what names a configuration (the search's profiled plans)


@dataclass
class OperatorMeasurement:
    """Minimum over the measured rounds for one operator under one configuration (milliseconds, bytes)."""

    forward_ms: float = 0.0
    compute_ms: float = 0.0  # forward excluding the casts the plan inserts around the operator
    backward_ms: float = 0.0
    saved_bytes: int = 0  # storages this operator was the first to save in the step
    calls: int = 0
    wall_ms: float = 0.0  # forward plus backward in real time (equals total_ms unless the clock counts CPU time)
    own_saved_bytes: int = 0  # every storage this operator saves, shared with other operators or not

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
            "wall_ms": round(self.wall_ms, 5),
            "saved_bytes": int(self.saved_bytes),
            "own_saved_bytes": int(self.own_saved_bytes),
            "calls": int(self.calls),
        }


@dataclass
class ProfileResult:
    """Per-operator measurements and the execution order of operators for one configuration.

    Attributes:
        operators: per operator, the minimum over the rounds.
        order: operators in the order they first ran.
        step_ms: the fastest round's step time (with the per-operator hooks in place).
        peak_bytes: peak device memory of a step (CUDA only): the caching allocator's allocated peak.
        reserved_bytes: the caching allocator's reserved peak of a step (CUDA only): what the process holds.
        rounds: every measured round's per-operator measurements, in order (paired across configurations).
        sharing: per operator, the other operators that save a tensor it saves too (first measured round).
        step_rounds: every measured round's step time (with the hooks in place), in the order of ``rounds``: what a
            time measured inside a round is a share of.
    """

    operators: dict[str, OperatorMeasurement] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    step_ms: float = 0.0
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    rounds: list[dict[str, OperatorMeasurement]] = field(default_factory=list)
    sharing: dict[str, set[str]] = field(default_factory=dict)  # operator -> others that save one of its tensors
    step_rounds: list[float] = field(default_factory=list)

    def series(self, name: str, attribute: str = "total_ms") -> list[float]:
        """One operator's ``attribute`` per round (0.0 in a round where it did not run)."""
        return [float(getattr(r[name], attribute)) if name in r else 0.0 for r in self.rounds]

    def summed_series(self, names: Sequence[str]) -> list[float]:
        """The per-round total time of ``names`` together (each round's ``total_ms`` of each, summed)."""
        return [sum(values) for values in zip(*(self.series(name) for name in names), strict=True)]

    @property
    def saved_bytes(self) -> int:
        """Bytes all operators save for backward in one step."""
        return sum(m.saved_bytes for m in self.operators.values())


class _RoundRecorder:
    """Hooks that time every operator of a model during one forward+backward."""

    def __init__(self, model: nn.Module, clock: Clock) -> None:
        self.clock = clock
        self.handles: list[RemovableHandle] = []
        self.stack: list[str] = []
        # per call: [t0, t1, t2, t3, the children's forward ms, their wall ms] (children: of FUNCTIONAL operators)
        self.marks: dict[str, list[list[Any]]] = defaultdict(list)
        self.functional: set[str] = set()
        self.grad_events: list[tuple[Any, str]] = []
        self.saved: dict[str, int] = defaultdict(int)
        self.own: dict[str, int] = defaultdict(int)
        self._own_seen: dict[str, set[int]] = defaultdict(set)
        self.order: list[str] = []
        self._param_storages = {storage_key(p) for p in model.parameters()}
        self._seen_storages: set[int] = set()
        self._hooked: list[torch.Tensor] = []
        self._hooked_ids: set[int] = set()
        for name, module in iter_operators(model):
            if is_functional(module):
                self.functional.add(name)
            self.handles += [
                module.register_forward_pre_hook(self._pre_outer(name), prepend=True),
                module.register_forward_pre_hook(self._pre_inner(name)),
                module.register_forward_hook(self._post_inner(name), prepend=True),
                module.register_forward_hook(self._post_outer(name), always_call=True),
            ]

    def _pre_outer(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            parent = self.stack[-1] if self.stack else None
            if parent in self.functional:  # what the container's own work hands this child: its backward is his
                for tensor in tensors(args):
                    if tensor.requires_grad and id(tensor) not in self._hooked_ids:
                        self._hooked_ids.add(id(tensor))
                        self._hooked.append(tensor)
                        tensor.register_hook(self._grad_hook(parent))
            self.stack.append(name)
            if name not in self.marks:
                self.order.append(name)
            self.marks[name].append([self.clock.now(), None, None, None, 0.0, 0.0])

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
            call = self.marks[name][-1]
            call[3] = self.clock.now()
            if self.stack:
                self.stack.pop()
            if self.stack and self.stack[-1] in self.functional:  # the container is charged its own work only
                outer = self.marks[self.stack[-1]][-1]
                outer[4] += self.clock.elapsed_ms(call[0], call[3])
                outer[5] += self.clock.wall_ms(call[0], call[3])
            inputs = {id(t) for t in tensors(args)}
            for tensor in tensors(output):
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
            name = self.stack[-1]
            self.saved[name] += new_storage_bytes(tensor, self._param_storages, self._seen_storages)
            self.own[name] += new_storage_bytes(tensor, self._param_storages, self._own_seen[name])
        return tensor

    def sharing(self) -> dict[str, set[str]]:
        """Per operator, the other operators that saved one of the same storages in this round."""
        savers: dict[int, set[str]] = defaultdict(set)
        for name, storages in self._own_seen.items():
            for ptr in storages:
                savers[ptr].add(name)
        return {name: set().union(*(savers[p] for p in storages)) - {name} for name, storages in self._own_seen.items()}

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
            m = OperatorMeasurement(calls=len(calls), saved_bytes=self.saved.get(name, 0),
                                    own_saved_bytes=self.own.get(name, 0))
            for t0, t1, t2, t3, inner_ms, inner_wall_ms in calls:
                if t3 is None:
                    continue
                m.forward_ms += max(0.0, self.clock.elapsed_ms(t0, t3) - inner_ms)
                m.compute_ms += max(0.0, self.clock.elapsed_ms(t1, t2) - inner_ms)
                m.wall_ms += max(0.0, self.clock.wall_ms(t0, t3) - inner_wall_ms)
            out[name] = m
        events = self.grad_events + [(backward_end, "")]
        for (start, name), (end, _) in zip(events, events[1:]):
            if name in out:
                out[name].backward_ms += max(0.0, self.clock.elapsed_ms(start, end))
                out[name].wall_ms += max(0.0, self.clock.wall_ms(start, end))
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
            own_saved_bytes=int(statistics.median(m.own_saved_bytes for m in series)),
            calls=max(m.calls for m in series),
            wall_ms=min(m.wall_ms for m in series),
        )
    return out


class OperatorProfiler:
    """Measures per-operator cost of a model's training step under several configurations, interleaved.

    Args:
        model: the model whose operators are timed.
        clock: the clock (:mod:`lightning_comp.search.measurement.clocks`), or a device type (``"cpu"``/``"cuda"``) for
        its default. rounds: measured rounds per configuration.
        warmup: unmeasured rounds per configuration before the measured ones.
    """

    def __init__(self, model: nn.Module, clock: Clock | str, rounds: int = 5, warmup: int = 2) -> None:
        self.model = model
        self.clock = clock_for(clock)
        self.rounds = rounds
        self.warmup = warmup
        self._cuda = self.clock.kind is ClockKind.CUDA
        self.on_round: Callable[[], None] | None = None  # called after each round (warm-up ones too)

    def profile(self, configs: Mapping[L, Callable[[], Any]], step: Callable[[], None]) -> dict[L, ProfileResult]:
        """Time ``step`` under each configuration.

        Args:
            configs: label -> a function that puts the configuration into effect (e.g. applies a plan); if it
                returns a context manager, each measured step runs inside it.
            step: runs one forward and backward pass of the model.

        Returns:
            label -> per-operator minima, every round, and the operators' execution order.
        """
        results = {label: ProfileResult() for label in configs}
        self._run(results, configs, step, self.warmup, self.rounds)
        return results

    def extend(self, results: dict[L, ProfileResult], configs: Mapping[L, Callable[[], Any]],
               step: Callable[[], None], rounds: int) -> None:
        """Add ``rounds`` measured rounds (no warm-up) to ``results`` from :meth:`profile`, in place."""
        self._run(results, configs, step, 0, rounds)

    def _run(self, results: dict[L, ProfileResult], configs: Mapping[L, Callable[[], Any]],
             step: Callable[[], None], warmup: int, rounds: int) -> None:
        steps: dict[L, list[float]] = {label: [] for label in configs}
        peaks: dict[L, list[int]] = {label: [] for label in configs}
        reserved: dict[L, list[int]] = {label: [] for label in configs}
        for round_index in range(warmup + rounds):
            for label, activate in configs.items():
                context = activate()
                recorder = _RoundRecorder(self.model, self.clock)
                if self._cuda:
                    torch.cuda.reset_peak_memory_stats()
                try:
                    start = self.clock.now()
                    # the configuration's own context (e.g. weight-cast recording) goes inside the recorder's
                    # saved-tensor hooks, so the recorder counts what that configuration really keeps for backward
                    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), entered(context):
                        step()
                    end = self.clock.now()
                    self.clock.finish()
                finally:
                    recorder.remove()
                if round_index >= warmup:
                    result = results[label]
                    result.rounds.append(recorder.measurements(end))
                    result.order = result.order or recorder.order
                    result.sharing = result.sharing or recorder.sharing()
                    steps[label].append(self.clock.elapsed_ms(start, end))
                    result.step_rounds.append(steps[label][-1])
                    if self._cuda:
                        peaks[label].append(int(torch.cuda.max_memory_allocated()))
                        reserved[label].append(int(torch.cuda.max_memory_reserved()))
            if self.on_round is not None:
                self.on_round()
        for label, result in results.items():
            result.operators = _min_measurements(result.rounds)
            fastest = min(steps[label], default=result.step_ms)
            result.step_ms = min(result.step_ms, fastest) if result.step_ms else fastest
            if peaks[label]:
                result.peak_bytes = max(peaks[label] + ([result.peak_bytes] if result.peak_bytes else []))
            if reserved[label]:
                result.reserved_bytes = max(reserved[label]
                                            + ([result.reserved_bytes] if result.reserved_bytes else []))
