"""Which code steps the managed parameters: Adam's step op by op, one compiled kernel, or a native C loop.

The eager update (:func:`~lightning_comp.execution.adam_step.adam_step`) runs every op of the step as its own pass
over memory: in training on 2 CPU cores (the default example, every Linear managed, the whole update of its 3.3 M
parameters) 14.7 ns per parameter with BF16 moments (rounded stochastically, the random bits drawn from a generator:
2.6 ns when they were rounded to nearest), 8.1 with 8-bit moments, 7.4 with BF16 masters rounded stochastically,
against 2.2-2.7 ns for ``torch.optim.AdamW``'s own FP32 step; on CUDA, a dozen kernel launches per
parameter. The compiled update traces the same step, per state format, as one pure function
(:mod:`~lightning_comp.execution.fused_adam`) with ``torch.compile(dynamic=True, fullgraph=True)`` into one kernel:
one graph per format serves every shape and every learning rate (the hyper-parameters come in a tensor), and it reads
nothing back to the host. On a CPU the native update (:mod:`~lightning_comp.execution.native_adam`) runs the same
arithmetic as a C loop built on the machine at first use (under a second; cached), per block of 8-bit codes or per
element: side by side on 2 AVX2 cores at 1 Mi elements (``benchmarks/update_kernel.py``, 2026-12-07), 2.04 ns per
parameter with 8-bit moments (compiled 6.16, eager 12.95), 1.13 with BF16 moments (3.83), 0.87 with BF16 masters
(2.73), 2.80 with both 8-bit moments and BF16 masters (9.96), against 1.55 for ``torch.optim.AdamW``'s FP32 step; a
native call costs microseconds where a compiled one costs about 300 us, and one native call steps every parameter
it covers (:meth:`CompiledUpdates.step_many`; the compiled path makes one call per parameter).
``benchmarks/update_speed.py`` measures the paths in training.

:class:`UpdatePath` chooses: ``"eager"``; ``"compiled"`` (an error, naming the cause, where it cannot compile);
``"native"`` (every managed parameter on a CPU natively, an error naming the cause where the C loop cannot be built;
on CUDA as ``"compiled"``); ``"auto"`` (the default): on a CPU natively at any size; where the C loop cannot be built
(no C compiler, say), with a warning, as before it: compiled once the managed parameters of a step hold at least
:data:`AUTO_MIN_ELEMENTS` elements (each format's first compilation takes a few seconds there) for 8-bit and BF16
moments and BF16 masters, eager for FP32 moments (a compiled call's fixed cost exceeds their eager step's); on CUDA
compiled always. Where compiling fails ``"auto"`` falls back to eager, with a warning naming why. A step neither
covers runs eagerly: the first step of a parameter (its state is created) and the step after its format changed (the
state is converted), AMSGrad, non-contiguous parameters, sharded ones (DTensor).

The paths agree to FP32 rounding, except in two places. A BF16 master and BF16 moments are rounded stochastically
from the generator the plugin checkpoints by the eager path, and from a counter-based hash of (seed, parameter name,
step, element) by the compiled and native ones (:mod:`~lightning_comp.numerics.stochastic_rounding`; the same bits on
both): each is unbiased and each resumes bit-exactly. 8-bit codes are looked up in tables by the eager path, computed
by :mod:`~lightning_comp.numerics.dynamic_codec` by the compiled and native ones (which decode through the map's own
values, as eagerly, where the compiled one computes them to a relative 2e-7): the codes differ for about one value in
a million, at a midpoint between two codes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_comp.common.spelled_enum import SpelledEnum
from lightning_comp.errors import CoMPError, NativeBuildError, UnsupportedSetupError
from lightning_comp.execution import fused_adam
from lightning_comp.execution.adam_step import AdamSettings
from lightning_comp.execution.native_adam import NativeAdam, NativeStep, native_adam
from lightning_comp.numerics import block_quant
from lightning_comp.numerics.precision import StatePrecision
from lightning_comp.numerics.stochastic_rounding import rounding_key

__all__ = ["AUTO_MIN_ELEMENTS", "CompiledUpdates", "ManagedStep", "UpdatePath"]

AUTO_MIN_ELEMENTS = 1 << 20
"""On a CPU, ``"auto"`` compiles once a step's managed parameters hold this many elements: the eager path's extra
6-60 ns per element then costs 6-60 ms a step, and a compilation of 2-5 s is repaid within some hundred steps."""


class UpdatePath(SpelledEnum):
    """The code that steps the parameters a plan's ``state``/``master`` entries manage (see the module docstring)."""

    EAGER = "eager"
    COMPILED = "compiled"
    NATIVE = "native"
    AUTO = "auto"

    @classmethod
    def noun(cls) -> str:
        return "update path"

    @classmethod
    def notes(cls) -> Mapping[str, str]:
        return {"eager": "op by op", "compiled": "torch.compile, one kernel per parameter",
                "native": "a C loop built here, on a CPU (CUDA: compiled)",
                "auto": "native or compiled where it pays, else eager"}


_Step = Callable[..., None]
_KERNELS: dict[StatePrecision, _Step] = {}


def _kernel(state: StatePrecision) -> _Step:
    """The compiled step of moments in ``state``'s format (compiled on first call; shared by every instance)."""
    kernel = _KERNELS.get(state)
    if kernel is None:
        functions: dict[StatePrecision, _Step] = {StatePrecision.FP32: fused_adam.step_fp32_moments,
                                                  StatePrecision.BF16: fused_adam.step_bf16_moments,
                                                  StatePrecision.INT8: fused_adam.step_8bit_moments}
        function = functions[state]
        kernel = torch.compile(function, dynamic=True, fullgraph=True)
        _KERNELS[state] = kernel
    return kernel


def _alias(tensor: torch.Tensor, offset: int, size: tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor of ``size`` over the memory of contiguous ``tensor`` from its element ``offset`` on, that
    is not a view of it, so that one graph serves every shape: Dynamo guards on a tensor's dimensions, and on the
    dimensions of the base of a view (a weight's, or the gradient bucket's under DDP), so square weights and others,
    or matrices and vectors, would each compile anew."""
    strides = tuple(math.prod(size[i + 1:]) for i in range(len(size)))
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset() + offset, size, strides)


def _flat_alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as a 1-D :func:`_alias`."""
    return _alias(tensor, 0, (tensor.numel(),))


def _on_device(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The hyper-parameters ``values`` (:data:`~lightning_comp.execution.fused_adam.HYPER_PARAMETERS`) as an FP32
    tensor on ``device``; on CUDA copied from pinned memory without waiting for the device."""
    hyper = torch.tensor(values, dtype=torch.float32)
    if device.type == "cpu":
        return hyper
    if device.type == "cuda":
        return hyper.pin_memory().to(device, non_blocking=True)
    return hyper.to(device)


def _block_aliases(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
                   ) -> tuple[torch.Tensor, ...]:
    """The arguments of :func:`~lightning_comp.execution.fused_adam.step_8bit_moments`: ``p`` and ``grad`` as
    ``(blocks, BLOCK_SIZE)`` :func:`_alias` es, each packed moment as its codes shaped so and its scales' bytes."""
    numel = p.numel()
    blocks = numel // block_quant.BLOCK_SIZE
    shape = (blocks, block_quant.BLOCK_SIZE)
    moments = [(_alias(m, 0, shape), _alias(m, numel, (4 * blocks,))) for m in (exp_avg, exp_avg_sq)]
    return _alias(p, 0, shape), _alias(grad, 0, shape), *moments[0], *moments[1]


class ManagedStep(NamedTuple):
    """One managed parameter's step, as :meth:`CompiledUpdates.step_many` takes it.

    Attributes:
        p: the parameter.
        grad: its gradient.
        state: its optimizer state (the optimizer's own dict, updated in place).
        settings: its group's hyper-parameters now.
        precision: the format of its moments.
        stochastic: whether its BF16 weights are rounded stochastically.
        name: its name (keys its rounding).
    """

    p: torch.Tensor
    grad: torch.Tensor
    state: dict[str, Any]
    settings: AdamSettings
    precision: StatePrecision
    stochastic: bool
    name: str


def _hyper(settings: AdamSettings, t: float) -> tuple[float, ...]:
    """The :data:`~lightning_comp.execution.fused_adam.HYPER_PARAMETERS` of step ``t`` with ``settings``."""
    beta1, beta2 = settings.betas
    decay = settings.weight_decay
    return (-1.0 if settings.maximize else 1.0, 0.0 if settings.decoupled else decay,
            1.0 - settings.lr * decay if settings.decoupled else 1.0, 1.0 - beta1, beta2, 1.0 - beta2,
            settings.lr / (1.0 - beta1**t), math.sqrt(1.0 - beta2**t), settings.eps)


def _held(precision: StatePrecision, p: torch.Tensor) -> StatePrecision:
    """The format ``p``'s moments are held in under ``precision``: 8-bit ones of a tensor too small to quantise stay
    FP32."""
    if precision is StatePrecision.INT8 and not block_quant.quantisable(p):
        return StatePrecision.FP32
    return precision


def _count(states: Sequence[dict[str, Any]]) -> list[float]:
    """Add one to each state's step counter (a CPU tensor, as ``torch.optim.Adam`` keeps it: no device sync) and
    return their new values."""
    for state in states:
        state["step"] += 1
    return [float(state["step"]) for state in states]


class CompiledUpdates:
    """Steps managed parameters with the native or the compiled functions where :class:`UpdatePath` says so (the
    name is older than the native path; either way the caller's eager step covers the rest).

    Args:
        path: the update path (an :class:`UpdatePath` or its spelling).
        seed: the seed of the stochastic rounding of BF16 masters, mixed with each parameter's name and step.

    Raises:
        ConfigError: if ``path`` is not a valid update path.
    """

    def __init__(self, path: UpdatePath | str = UpdatePath.AUTO, *, seed: int = 0) -> None:
        self.path = UpdatePath.parse(path)
        self.seed = seed
        self.failure: str | None = None  # why compiling failed under "auto" (the path is eager from then on)
        self.native_failure: str | None = None  # why the native step could not be built under "auto"
        self.compiled_steps = 0  # parameter steps the compiled functions took
        self.native_steps = 0  # parameter steps the native C function took
        self._on = False
        self._native_on = False

    def begin(self, elements: int, device: torch.device) -> bool:
        """Decide for the step about to run, whose managed parameters hold ``elements`` elements on ``device``;
        returns whether it runs compiled (8-bit moments on a CPU may run natively either way: :meth:`step`)."""
        if self.path is UpdatePath.EAGER or self.failure is not None:
            self._on = False
        elif self.path in (UpdatePath.COMPILED, UpdatePath.NATIVE):
            self._on = True
        else:
            self._on = device.type == "cuda" or elements >= AUTO_MIN_ELEMENTS
        self._native_on = device.type == "cpu" and (
            self.path is UpdatePath.NATIVE or (self.path is UpdatePath.AUTO and self.native_failure is None))
        return self._on

    def step(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], settings: AdamSettings,
             precision: StatePrecision, stochastic: bool, name: str) -> bool:
        """Step ``p`` as :meth:`step_many` steps one parameter; returns whether it did (else the caller steps it
        eagerly, creating or converting the state).

        Raises:
            UnsupportedSetupError: as :meth:`step_many`.
        """
        return not self.step_many([ManagedStep(p, grad, state, settings, precision, stochastic, name)])

    def step_many(self, steps: Sequence[ManagedStep]) -> list[ManagedStep]:
        """Step each of ``steps`` whose state is already in its ``precision``'s format natively (on a CPU, where this
        path says so; all of them in one native call) or compiled (if this step runs compiled, one call each), and
        return the others, in order: the caller steps those eagerly, creating or converting their state.

        Raises:
            UnsupportedSetupError: under ``"compiled"``, if the step cannot be compiled here; under ``"native"``, if
                the native step cannot be built here.
        """
        native: list[ManagedStep] = []
        rest: list[ManagedStep] = []
        for one in steps:
            route = self._route(one)
            if route == "native":
                native.append(one)
            elif route != "compiled" or not self._step_compiled(one):
                rest.append(one)
        if native:
            hyper: dict[tuple[int, float], tuple[float, ...]] = {}
            calls = []
            for one, t in zip(native, _count([one.state for one in native])):
                values = hyper.get((id(one.settings), t))
                if values is None:
                    values = hyper[(id(one.settings), t)] = _hyper(one.settings, t)
                calls.append(NativeStep(one.p.detach(), one.grad, one.state["exp_avg"], one.state["exp_avg_sq"],
                                        values, one.stochastic, rounding_key(self.seed, one.name, int(t))))
            native_adam().step(calls)
            self.native_steps += len(native)
        return rest

    def _route(self, one: ManagedStep) -> str | None:
        """``"native"`` or ``"compiled"``: the code that steps ``one`` now; None: the caller's eager step."""
        p, grad, precision = one.p, one.grad, _held(one.precision, one.p)
        if one.settings.amsgrad or not self._covers(p, grad, one.state, precision):
            return None
        if self._native_on and NativeAdam.covers(p, grad) and self._native() is not None:
            return "native"
        if not self._on:
            return None
        if self.path is UpdatePath.AUTO and p.device.type == "cpu" and not one.stochastic \
                and precision is StatePrecision.FP32:
            return None  # FP32 moments alone: the eager step is as fast on a CPU (module docstring)
        return "compiled"

    def _step_compiled(self, one: ManagedStep) -> bool:
        """Step ``one`` with the compiled function of its format; False where compiling failed under ``"auto"``."""
        p, state = one.p, one.state
        precision = _held(one.precision, p)
        t = _count([state])[0]
        scalars = (_on_device(_hyper(one.settings, t), p.device), one.stochastic,
                   rounding_key(self.seed, one.name, int(t)))
        tensors = (p.detach(), one.grad, state["exp_avg"], state["exp_avg_sq"])
        try:
            if precision is StatePrecision.INT8:
                _kernel(precision)(*_block_aliases(*tensors), *scalars)
            else:
                _kernel(precision)(*(_flat_alias(t) for t in tensors), *scalars)
        except CoMPError:
            raise
        except Exception as error:  # noqa: BLE001 - a backend's failure to compile, reported below
            state["step"] -= 1
            self._failed(error)
            return False
        self.compiled_steps += 1
        return True

    @staticmethod
    def _covers(p: torch.Tensor, grad: torch.Tensor, state: Mapping[str, Any], precision: StatePrecision) -> bool:
        """Whether ``p``'s state is in ``precision``'s format already and the compiled step applies to it."""
        if type(p.detach()) is not torch.Tensor:
            return False  # a sharded parameter (DTensor) or another subclass: stepped eagerly
        if "step" not in state or not p.is_contiguous() or grad.dtype != p.dtype or not grad.is_contiguous() \
                or grad.layout is not torch.strided:
            return False
        moments = [state.get("exp_avg"), state.get("exp_avg_sq")]
        if precision is StatePrecision.INT8:
            size = block_quant.packed_size(p.numel())
            return block_quant.quantisable(p) and all(
                isinstance(m, torch.Tensor) and m.dtype == torch.uint8 and m.numel() == size and m.is_contiguous()
                for m in moments)
        dtype = torch.bfloat16 if precision is StatePrecision.BF16 else torch.float32
        return all(isinstance(m, torch.Tensor) and m.dtype == dtype and m.shape == p.shape and m.is_contiguous()
                   for m in moments)

    def _native(self) -> NativeAdam | None:
        """The native step (built on first use); None under ``"auto"`` where it cannot be built (warned once).

        Raises:
            UnsupportedSetupError: under ``"native"``, if it cannot be built here.
        """
        try:
            return native_adam()
        except NativeBuildError as error:
            if self.path is UpdatePath.NATIVE:
                raise UnsupportedSetupError(
                    f"update_path='native': the native optimizer step could not be built here ({error}). Use"
                    " update_path='auto' (falls back to the compiled step) or 'compiled'.") from error
            self.native_failure = str(error)
            self._native_on = False
            rank_zero_warn(f"The native optimizer step could not be built ({error}); managed parameters are stepped by"
                           " the compiled or eager step instead (2-3x slower per parameter on a CPU).")
            return None

    def _failed(self, error: Exception) -> None:
        """Compiling failed: raise under ``"compiled"``; under ``"auto"``, warn and step eagerly from now on."""
        inner = getattr(error, "inner_exception", None) or error  # a backend's own error, inside dynamo's
        lines = str(inner).strip().splitlines()
        cause = f"{type(inner).__name__}: {lines[0]}" if lines else type(inner).__name__
        if self.path is UpdatePath.COMPILED:
            raise UnsupportedSetupError(
                f"update_path='compiled': the managed optimizer step could not be compiled here ({cause}). Use"
                " update_path='auto' (falls back to the eager step) or 'eager'.") from error
        self.failure = cause
        self._on = False
        rank_zero_warn(f"The managed optimizer step could not be compiled ({cause}); it runs eagerly from now on"
                       " (several times slower per parameter). Pass update_path='eager' to skip the attempt.")

