"""``CoMPFabricPrecision``: a Lightning Fabric precision plugin that trains with an operator-wise precision plan.

The search is a Trainer callback; a Fabric loop gets its plan from a file a Trainer search saved
(``CoMPSearch`` writes ``plan.json``; ``PrecisionPlan.save``), or a mapping of the user's own.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities import rank_zero_warn
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_comp.errors import UsageError
from lightning_comp.execution.executor import StepKind
from lightning_comp.execution.loss_scaling import scaler_step
from lightning_comp.execution.saved_tensors import DEFAULT_MIN_SAVED_BYTES
from lightning_comp.execution.update_path import UpdatePath
from lightning_comp.plan.plan import PlanLike
from lightning_comp.plugins.runtime import PlanRuntime
from lightning_comp.plugins.shell import PlanShell

__all__ = ["CoMPFabricPrecision"]


class CoMPFabricPrecision(PlanShell, Precision):
    """Train a Fabric loop with a per-operator precision plan: FP32 master weights, each operator in its precision.

    Pass it as ``Fabric(plugins=[CoMPFabricPrecision(plan)])`` and leave Fabric's ``precision`` unset. The plan is put
    into effect with forward hooks on the module given to ``fabric.setup`` once it is on its device (its first
    forward); every forward of the module runs as a step of the kind its mode says (``train()``: training,
    ``eval()``: validation), the first of each kind tracing the model's own work
    (:mod:`lightning_comp.operators.owned_work`). FP16 plans scale the loss (``fabric.backward``) and step through
    the scaler (``optimizer.step()`` of the optimizer ``fabric.setup`` returned); BF16 plans need no scaling.

    **Checkpoints.** The plugin is stateful: put it into the state Fabric saves and loads, and the plan, the
    scaler's state and the step counters travel with the checkpoint::

        state = {"model": model, "optimizer": optimizer, "comp": plugin}
        fabric.save(path, state)
        fabric.load(path, state)  # puts the checkpoint's plan back, unless the plugin was given one

    A plan of the user's own (the constructor's, or :meth:`set_plan`'s) wins over the checkpoint's, with a warning
    naming what the checkpoint held, as under the Trainer. The plugin maps Fabric's hooks onto the
    :class:`~lightning_comp.plugins.runtime.PlanRuntime` it shares with :class:`~lightning_comp.CoMPPrecision`.

    Args:
        plan: a :class:`PrecisionPlan`, a ``{selector: precision}`` mapping, a path to a saved plan, or ``None``
            (all FP32, until a checkpoint's plan is loaded; a warning at the first training forward says so when
            none was, while ``{}``, all FP32 on purpose, gets none).
        allow_slow_fp16: keep FP16 entries on a device without fast FP16 (else they run in FP32, with a warning).
        scaler: a ``torch.amp.GradScaler`` for FP16 plans instead of a default one.
        recast_weights_in_backward: as :class:`~lightning_comp.CoMPPrecision`.
        min_saved_bytes: as :class:`~lightning_comp.CoMPPrecision`.
        update_path: as :class:`~lightning_comp.CoMPPrecision`.

    Raises:
        PlanError: if ``plan`` cannot be read.
    """

    precision = "32-true"  # master weights and everything outside the plan's operators

    def __init__(self, plan: PlanLike = None, *, allow_slow_fp16: bool = False,
                 scaler: torch.amp.GradScaler | None = None, recast_weights_in_backward: bool = True,
                 min_saved_bytes: int = DEFAULT_MIN_SAVED_BYTES,
                 update_path: UpdatePath | str = UpdatePath.AUTO) -> None:
        self._runtime = PlanRuntime(plan, owner=type(self).__name__, hooks_on_attach=False,
                                    allow_slow_fp16=allow_slow_fp16, scaler=scaler, scaler_factory=None,
                                    recast_weights_in_backward=recast_weights_in_backward,
                                    min_saved_bytes=min_saved_bytes, update_path=update_path)
        self._unplanned_checked = False  # the first training forward looked whether a plan was ever given

    # ---------------------------------------------------------------------------------------- Fabric hooks
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Check the plan fits ``module`` and remember it; the hooks go on at its first forward, on its device.

        Raises:
            PlanMismatchError: if the plan does not fit ``module``.
            UsageError: if another module was set up with this plugin (a plugin holds one module's plan).
        """
        attached = self._runtime.executor.model
        if attached is not None and attached is not module:
            raise UsageError(
                f"CoMPFabricPrecision already holds the plan of a {type(attached).__name__}; setting up a second module"
                f" ({type(module).__name__}) with it would take the plan off the first. Set up one module per Fabric,"
                " or put both into one nn.Module."
            )
        self._runtime.attach(module)
        return module

    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        """The context of one forward of the module: a step of the plan (training or validation, by its mode)."""
        return self._step()

    @contextmanager
    def _step(self) -> Generator[None, None, None]:
        model = self._runtime.executor.model
        if model is None:
            raise UsageError("CoMPFabricPrecision: no module was set up; call fabric.setup(model, optimizer) first.")
        if model.training and not self._unplanned_checked:
            self._unplanned_checked = True
            self._warn_if_unplanned()
        with self._runtime.step(StepKind.TRAIN if model.training else StepKind.VALIDATION):
            yield

    def _warn_if_unplanned(self) -> None:
        """At the first training forward (after any ``fabric.load`` that put a checkpoint's plan back): warn where this
        plugin was never given a plan, so the loop trains entirely in fp32."""
        if self._runtime.unplanned:
            rank_zero_warn(
                f"{type(self).__name__} was given no plan (none in its constructor, by set_plan, or from a loaded"
                " checkpoint): this loop trains entirely in fp32. Pass a plan (e.g. the plan.json a CoMPSearch run"
                " saved, or {'type:Linear': 'bf16'}), or CoMPFabricPrecision({}) to train in fp32 on purpose."
            )

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward of the (FP16 plans: scaled) loss, with forwards that activation checkpointing re-runs computing
        the step's own dtypes."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        with self._runtime.executor.recomputing():
            tensor.backward(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Step the optimizer; under an FP16 plan through the scaler (a step whose gradients overflowed is skipped
        and the scale backs off).

        Raises:
            UnsupportedSetupError: for LBFGS under an FP16 plan (it re-evaluates the loss: it cannot be scaled).
        """
        runtime = self._runtime
        if runtime.begin_optimizer_step(optimizer):  # the plan manages some of its parameters
            assert isinstance(optimizer, Optimizer)
            return runtime.managed_step(optimizer, lambda: optimizer.step(**kwargs))
        if self.scaler is None:
            return optimizer.step(**kwargs)
        output, skipped = scaler_step(self.scaler, optimizer, **kwargs)
        runtime.count_skipped(skipped)
        return output

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale the gradients before clipping (``fabric.clip_gradients``) under an FP16 plan."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    @override
    def teardown(self) -> None:
        """Take the hooks off the model: it computes in FP32 afterwards (the plan stays inspectable)."""
        self._runtime.release()
