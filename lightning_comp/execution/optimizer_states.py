"""Optimizer-state and master-weight precisions: the parameters a plan names are stepped here, in their own formats.

A plan's ``state`` and ``master`` entries (:class:`~lightning_comp.PrecisionPlan`) apply to the parameters each
operator owns (:mod:`lightning_comp.execution.parameter_groups`):

- ``state="bf16"`` keeps Adam's two moments in bfloat16 (4 bytes per parameter instead of 8), rounded
  stochastically at every write (rounded to nearest, the second moment stops decaying:
  :mod:`lightning_comp.execution.adam_step`); ``state="8bit"``
  keeps them as block-quantised codes (:mod:`lightning_comp.numerics.block_quant`, about 2 bytes per parameter;
  tensors under 4096 elements stay FP32, as in torchao).
- ``master="bf16"`` holds the parameter itself in bfloat16 (2 bytes instead of 4, and its gradient too) with no FP32
  copy anywhere; each update is rounded stochastically into it
  (:mod:`lightning_comp.numerics.stochastic_rounding`), so updates below half a BF16 step still count in expectation.

The state stays where it always was: in the user's own ``torch.optim.Adam``/``AdamW``, under the keys that optimizer
uses (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), in plain tensors; an 8-bit moment is one flat
``uint8`` tensor of codes and block scales. Checkpoints, the search's snapshots and rewinds therefore hold it as they
hold any optimizer state, and it loads with ``torch.load(weights_only=True)``. Two rules make that exact:

- **Loading keeps the saved dtypes.** ``Optimizer.load_state_dict`` casts every state tensor to its parameter's
  dtype. Packed 8-bit moments survive that (bytes cast to a float dtype and back are the same integers); for the
  rest, a load hook the plugins register on the run's optimizers puts back the tensors whose dtype the cast changed
  (FP32 moments of a BF16 master), so a resume is bit-exact. (Under Fabric, where the plugin meets the optimizer
  only at its first step, load a checkpoint before the first forward, while the parameters are still FP32.)
- **A format follows the plan lazily.** When the plan changes, each parameter's state is converted to its new format
  at its next step (an FP32 moment quantised, an 8-bit one decoded for the optimizer's own step), and master weights
  change dtype when the plan is applied (FP32 <-> BF16; a parameter returns to the dtype it had).

At a step (:meth:`OptimizerStates.step`), the managed parameters are updated with Adam(W)'s arithmetic in FP32
(:mod:`lightning_comp.execution.adam_step`: decoupled or L2 weight decay, AMSGrad, ``maximize``, each from its group's
current hyper-parameters; an ``AdamW`` decouples weight decay by its class, an ``Adam`` where its group says so; LR
schedulers work as they do), and their gradients are hidden from the optimizer's own ``step``, which updates the rest.
``tests/unit/test_optimizer_states.py`` checks the FP32 arithmetic against ``torch.optim.Adam``/``AdamW`` step by step.
Optimizers other than ``torch.optim.Adam`` and ``AdamW`` are refused with an error naming them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_comp.errors import PlanError, UnsupportedSetupError
from lightning_comp.execution.adam_step import AdamSettings, adam_step, check_optimizer, to_own_format, undo_load_cast
from lightning_comp.execution.parameter_groups import parameter_owners
from lightning_comp.execution.update_path import CompiledUpdates, ManagedStep, UpdatePath
from lightning_comp.numerics.precision import MasterPrecision, StatePrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan

__all__ = ["OptimizerStates", "ParameterTreatment", "state_bytes"]

_ROUNDING_SEED = 0x5EED


@dataclass(frozen=True)
class ParameterTreatment:
    """How one parameter is held and stepped.

    Attributes:
        state: the precision of its optimizer state.
        master: the precision of the parameter itself.
    """

    state: StatePrecision = StatePrecision.FP32
    master: MasterPrecision = MasterPrecision.FP32

    @property
    def managed(self) -> bool:
        """Whether this package steps the parameter (anything but FP32 state and FP32 master)."""
        return self.state.managed or self.master.managed


def state_bytes(optimizer: Optimizer) -> int:
    """Bytes of every tensor in ``optimizer``'s state (moments, codes, scales and step counters)."""
    total = 0
    for state in optimizer.state.values():
        total += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
    return total


class OptimizerStates:
    """Puts a plan's ``state`` and ``master`` entries into effect and steps the parameters they name (see the module
    docstring).

    Args:
        update_path: which code steps them (:class:`~lightning_comp.execution.update_path.UpdatePath`: ``"auto"``
            compiles the step where it pays).

    Raises:
        ConfigError: if ``update_path`` is not a valid update path.
    """

    def __init__(self, update_path: UpdatePath | str = UpdatePath.AUTO) -> None:
        self.updates = CompiledUpdates(update_path, seed=_ROUNDING_SEED)
        self._treatments: dict[int, ParameterTreatment] = {}
        self._names: dict[int, str] = {}
        # parameters whose dtype a master entry changed, with the dtype they had
        self._original: dict[int, tuple[nn.Parameter, torch.dtype]] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._pending_rounding: dict[str, torch.Tensor] = {}
        self._watched: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._converted: weakref.WeakSet[Optimizer] = weakref.WeakSet()  # whose states follow the assignment

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the plugin: parameter ids and hooked optimizers belong to this process
        return {**self.__dict__, "_treatments": {}, "_names": {}, "_original": {}, "_watched": None,
                "_converted": None, "_generators": {}, "_pending_rounding": self.rounding_state()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._watched, self._converted = weakref.WeakSet(), weakref.WeakSet()

    def steps(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s step must go through :meth:`step`: it has parameters the plan manages."""
        if not self._treatments:
            return False
        return any(id(p) in self._treatments for group in optimizer.param_groups for p in group["params"])

    def convert(self, optimizer: Optimizer) -> None:
        """Return the state of ``optimizer``'s unmanaged parameters to its own format, once per assignment or load
        (a plan that managed them before, or a checkpoint that did, may have left 8-bit or bf16 moments)."""
        if optimizer in self._converted:
            return
        self._converted.add(optimizer)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in self._treatments and p in optimizer.state:
                        to_own_format(optimizer.state[p], p)

    # ------------------------------------------------------------------------------------------------- the plan
    def assign(self, model: nn.Module, plan: PrecisionPlan) -> dict[str, ParameterTreatment]:
        """Put ``plan``'s optimizer-state and master-weight precisions in force for ``model``'s parameters.

        Master weights change dtype now (a BF16 master for ``master="bf16"``; back to the dtype it had otherwise);
        optimizer states change format at their next step.

        Returns:
            parameter name -> treatment, for the managed parameters.

        Raises:
            PlanError: if a parameter to hold in BF16 is neither FP32 nor BF16.
            UnsupportedSetupError: if master weights would change dtype under a sharded or multi-process run, or the
                plan also computes in fp16 (loss-scaled steps are not combined with these yet).
        """
        if plan.manages_parameters and plan.uses("fp16"):
            raise UnsupportedSetupError(
                "This plan computes in fp16 (with loss scaling) and sets optimizer-state or master-weight precisions;"
                " the two do not combine yet. Use bf16 compute, or keep state='fp32' and master='fp32'.")
        treatments: dict[int, ParameterTreatment] = {}
        names: dict[int, str] = {}
        for owned in parameter_owners(model):
            p = owned.parameter
            if owned.owner is None:
                treatment = ParameterTreatment(plan[Dimension.STATE].default, plan[Dimension.MASTER].default)
            else:
                treatment = ParameterTreatment(plan.of(Dimension.STATE, owned.owner, owned.owner_type),
                                               plan.of(Dimension.MASTER, owned.owner, owned.owner_type))
            self._hold(owned.name, p, treatment.master)
            if treatment.managed and p.requires_grad:
                treatments[id(p)] = treatment
                names[id(p)] = owned.name
        self._treatments, self._names = treatments, names
        self._converted = weakref.WeakSet()
        return {names[key]: treatment for key, treatment in treatments.items()}

    def _hold(self, name: str, p: nn.Parameter, master: MasterPrecision) -> None:
        """Give ``p`` the dtype ``master`` asks for (or back the one it had)."""
        key = id(p)
        if master.managed:
            if p.dtype == master.dtype:
                return
            if p.dtype != torch.float32:
                raise PlanError(f"Parameter {name!r} is {p.dtype}: master='bf16' holds FP32 parameters in bfloat16;"
                                " keep master='fp32' for it.")
            target = master.dtype
            self._original[key] = (p, p.dtype)
        elif key in self._original:
            target = self._original.pop(key)[1]
        else:
            return
        if isinstance(p.data, torch.Tensor) and type(p.data) is not torch.Tensor:
            raise UnsupportedSetupError(f"Parameter {name!r} is a {type(p.data).__name__} (a sharded parameter):"
                                        " master='bf16' is not supported with sharded training; keep master='fp32'.")
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            raise UnsupportedSetupError(
                f"master='bf16' for {name!r} would change a parameter's dtype in a multi-process run, whose gradient"
                " buckets are built for the dtypes they were made with; keep master='fp32' there (state='bf16'/'8bit'"
                " work under DDP).")
        p.grad = None
        p.data = p.data.to(target)

    def release(self) -> None:
        """Give every parameter a master entry made BF16 its own dtype back (exactly: BF16 values are FP32 values),
        so the model handed back after a fit computes as it did before it; the next :meth:`assign` holds them in
        BF16 again."""
        for p, dtype in self._original.values():
            p.grad = None
            p.data = p.data.to(dtype)
        self._original.clear()
        self._treatments, self._names = {}, {}
        self._converted = weakref.WeakSet()

    # ----------------------------------------------------------------------------------------- checkpoint hooks
    def watch(self, optimizer: Optimizer) -> None:
        """Register the load hooks that keep saved state dtypes on ``optimizer`` (once)."""
        if optimizer in self._watched:
            return
        self._watched.add(optimizer)
        stash: dict[str, Any] = {}

        def before(opt: Optimizer, state_dict: dict[str, Any]) -> None:
            stash["state"] = {k: dict(v) for k, v in state_dict.get("state", {}).items()}
            stash["ids"] = [i for group in state_dict.get("param_groups", []) for i in group["params"]]

        def after(opt: Optimizer) -> None:
            params = [p for group in opt.param_groups for p in group["params"]]
            for index, p in zip(stash.pop("ids", []), params):
                saved = stash["state"].get(index)
                if not saved or p not in opt.state:
                    continue
                state = opt.state[p]
                for key, value in saved.items():
                    if isinstance(value, torch.Tensor) and key != "step" and key in state \
                            and state[key].dtype != value.dtype:
                        state[key] = value.to(device=p.device)
            stash.clear()
            self._converted.discard(opt)

        optimizer.register_load_state_dict_pre_hook(before)
        optimizer.register_load_state_dict_post_hook(after)

    def rounding_state(self) -> dict[str, torch.Tensor]:
        """The stochastic-rounding generators' states (device -> state), for the plugin's checkpoint."""
        states = dict(self._pending_rounding)
        states.update({device: generator.get_state() for device, generator in self._generators.items()})
        return states

    def load_rounding_state(self, states: dict[str, torch.Tensor] | None) -> None:
        """Restore :meth:`rounding_state` (generators of devices not seen yet are restored when first used)."""
        self._pending_rounding = dict(states or {})
        for device in list(self._generators):
            if device in self._pending_rounding:
                self._generators[device].set_state(self._pending_rounding.pop(device))

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        generator = self._generators.get(key)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(_ROUNDING_SEED)
            if key in self._pending_rounding:
                generator.set_state(self._pending_rounding.pop(key))
            self._generators[key] = generator
        return generator

    # ------------------------------------------------------------------------------------------------ the step
    def step(self, optimizer: Optimizer, own_step: Any) -> Any:
        """Update ``optimizer``'s managed parameters here, then run ``own_step()`` (the optimizer's own step) with
        their gradients hidden, and return what it returns.

        Raises:
            UnsupportedSetupError: if a managed parameter belongs to an optimizer other than Adam/AdamW, or to one
                set up in a way this step does not reproduce (``capturable``, ``differentiable``, sparse gradients).
        """
        hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.convert(optimizer)
        steps: list[ManagedStep] = []
        for group in optimizer.param_groups:
            managed = [(p, treatment) for p in group["params"]
                       if (treatment := self._treatments.get(id(p))) is not None and p.grad is not None]
            if not managed:
                continue
            check_optimizer(optimizer, group, self._names[id(managed[0][0])])
            settings = AdamSettings.of(optimizer, group)
            for p, treatment in managed:
                steps.append(self._managed_step(p, optimizer.state[p], settings, treatment))
        if steps:
            self.updates.begin(sum(one.p.numel() for one in steps), steps[0].p.device)
        try:
            with torch.no_grad():
                for one in self.updates.step_many(steps):  # what it leaves (new or converted states): eagerly
                    self._step_eagerly(one)
                for one in steps:
                    hidden.append((one.p, one.grad))
                    one.p.grad = None
            return own_step()
        finally:
            for p, grad in hidden:
                p.grad = grad

    def _managed_step(self, p: nn.Parameter, state: dict[str, Any], settings: AdamSettings,
                      treatment: ParameterTreatment) -> ManagedStep:
        """``p``'s step as the update paths take it, its state's load casts undone."""
        grad = p.grad
        assert grad is not None
        if grad.is_sparse:
            raise UnsupportedSetupError(f"Parameter {self._names[id(p)]!r} has a sparse gradient: state/master"
                                        " precisions need dense gradients; keep them fp32 for it.")
        undo_load_cast(state, p, treatment.state)
        stochastic = p.dtype == torch.bfloat16 and treatment.master.managed
        return ManagedStep(p, grad, state, settings, treatment.state, stochastic, self._names[id(p)])

    def _step_eagerly(self, one: ManagedStep) -> None:
        bf16_moments = one.precision is StatePrecision.BF16
        generator = self._generator(one.p.device) if one.stochastic or bf16_moments else None
        adam_step(one.p, one.grad, one.state, one.settings, one.precision, generator if one.stochastic else None,
                  generator if bf16_moments else None)
