"""Bit-exact snapshots of a training run's state, so a rejected trial can be rewound.

A snapshot holds deep copies of the model's state on this rank (its ``state_dict``: parameters and buffers such as
BatchNorm statistics; under FSDP this rank's shards, :mod:`lightning_comp.search.rewind.model_state`) and of its
non-persistent buffers, every optimizer's and LR scheduler's state, the loss scaler's state, the RNG states
(torch CPU and CUDA, Python, NumPy), the selected stateful callbacks' states and the training dataloaders'
generators. Deep copies matter: ``state_dict()`` tensors alias the live ones.
Snapshots serialise to plain containers of tensors and numbers, so they can travel in a checkpoint that is loaded
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from lightning_comp.adapters import lightning_internals as lightning
from lightning_comp.common.nested import structures_equal, to_device
from lightning_comp.errors import SnapshotMismatchError
from lightning_comp.search.rewind.model_state import load_model_state, model_state, plain_tensors, rehydrate

__all__ = ["TrainingSnapshot", "capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """The state of every random number generator training may use, as plain containers and tensors."""
    np_state: Any = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _plain_python_rng(random.getstate()),
        "numpy": {
            "kind": str(np_state[0]),
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore the generators captured by :func:`capture_rng`."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _plain_python_rng(state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


@dataclass
class TrainingSnapshot:
    """Everything that must be restored for training to continue exactly as from the moment of capture.

    Attributes:
        model: the LightningModule's ``state_dict()`` (parameters and persistent buffers).
        optimizers: every optimizer's state, in the Trainer's order.
        schedulers: every LR scheduler's state.
        scaler: the loss scaler's state, if there is one.
        rng: the global RNG states (:func:`capture_rng`).
        buffers: non-persistent buffers (``register_buffer(..., persistent=False)``), missing from ``state_dict()``.
        callbacks: ``state_key -> state_dict()`` of the stateful callbacks that were selected at capture.
        generators: the states of the training dataloaders' own ``torch.Generator`` objects (the loader's, its
            sampler's, its batch sampler's sampler's), which decide the batch order of the next epoch.
    """

    model: dict[str, torch.Tensor]
    optimizers: list[dict[str, Any]]
    schedulers: list[dict[str, Any]]
    scaler: dict[str, Any] | None
    rng: dict[str, Any]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    callbacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    generators: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def capture(cls, trainer: pl.Trainer, pl_module: pl.LightningModule, scaler: Any = None,
                callbacks: Callable[[Callback], bool] | None = None,
                device: torch.device | str | None = None) -> TrainingSnapshot:
        """Deep-copy the run's state now.

        Args:
            trainer: the Trainer (optimizers, schedulers, callbacks and dataloaders come from it).
            pl_module: the model.
            scaler: the loss scaler, if any.
            callbacks: which stateful callbacks to capture (``None``: none). Never select the caller itself.
            device: where to keep the tensor copies (e.g. ``"cpu"`` to spare accelerator memory); ``None``: where
                they are. Restoring moves them back.
        """
        def copy_to(obj: Any) -> Any:
            copied = copy.deepcopy(obj)
            return copied if device is None else to_device(copied, torch.device(device))

        persistent = set(pl_module.state_dict())
        return cls(
            model=copy_to(model_state(trainer, pl_module)),
            optimizers=[copy_to(opt.state_dict()) for opt in trainer.optimizers],
            schedulers=[copy.deepcopy(cfg.scheduler.state_dict()) for cfg in trainer.lr_scheduler_configs],
            scaler=None if scaler is None else copy.deepcopy(scaler.state_dict()),
            rng=capture_rng(),
            buffers={n: copy_to(b) for n, b in pl_module.named_buffers() if n not in persistent},
            callbacks={} if callbacks is None else {
                cb.state_key: copy.deepcopy(cb.state_dict()) for cb in lightning.callbacks(trainer)
                if callbacks(cb) and cb.state_dict()},
            generators=[g.get_state() for g in _loader_generators(trainer)],
        )

    def restore(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, scaler: Any = None, rng: bool = True
    ) -> None:
        """Put the captured state back (copies again, so the snapshot can be restored more than once).

        Raises:
            SnapshotMismatchError: if the Trainer's optimizers, schedulers, captured callbacks or dataloader
                generators no longer pair one to one with the snapshot's.
        """
        self._check_pairs(trainer)
        # (a snapshot read back from a sharded checkpoint holds local shards: DTensors again, as the live ones are)
        load_model_state(trainer, pl_module, rehydrate(copy.deepcopy(self.model), model_state(trainer, pl_module)))
        for opt, state in zip(trainer.optimizers, self.optimizers):
            opt.load_state_dict(rehydrate(copy.deepcopy(state), opt.state_dict()))
        for cfg, state in zip(trainer.lr_scheduler_configs, self.schedulers):
            cfg.scheduler.load_state_dict(copy.deepcopy(state))
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(copy.deepcopy(self.scaler))
        live_buffers = dict(pl_module.named_buffers())
        with torch.no_grad():
            for name, value in self.buffers.items():
                live_buffers[name].copy_(value)
        by_key = {cb.state_key: cb for cb in lightning.callbacks(trainer)}
        for key, callback_state in self.callbacks.items():
            by_key[key].load_state_dict(copy.deepcopy(callback_state))
        for generator, generator_state in zip(_loader_generators(trainer), self.generators):
            generator.set_state(generator_state)
        for param in pl_module.parameters():
            param.grad = None
        if rng:
            restore_rng(self.rng)

    def _check_pairs(self, trainer: pl.Trainer) -> None:
        problems = []
        if len(trainer.optimizers) != len(self.optimizers):
            problems.append(f"{len(self.optimizers)} optimizer(s) captured, {len(trainer.optimizers)} now")
        if len(trainer.lr_scheduler_configs) != len(self.schedulers):
            problems.append(f"{len(self.schedulers)} scheduler(s) captured, {len(trainer.lr_scheduler_configs)} now")
        keys = {cb.state_key for cb in lightning.callbacks(trainer)}
        missing = sorted(set(self.callbacks) - keys)
        if missing:
            problems.append(f"callbacks {missing} captured but no longer on the Trainer")
        generators = len(_loader_generators(trainer))
        if self.generators and generators != len(self.generators):
            problems.append(f"{len(self.generators)} dataloader generator(s) captured, {generators} now")
        if problems:
            raise SnapshotMismatchError(
                "Cannot restore the training snapshot: " + "; ".join(problems) + ". The Trainer was changed between"
                " capture and restore (configure_optimizers, callbacks or dataloaders); keep them fixed during a"
                " search."
            )

    def to_state(self) -> dict[str, Any]:
        """A checkpoint-friendly dictionary (tensors and plain Python values only)."""
        return {
            "model": self.model,
            "optimizers": self.optimizers,
            "schedulers": self.schedulers,
            "scaler": self.scaler,
            "rng": self.rng,
            "buffers": self.buffers,
            "callbacks": self.callbacks,
            "generators": self.generators,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TrainingSnapshot:
        """Rebuild a snapshot from :meth:`to_state`'s dictionary.

        Raises:
            SnapshotMismatchError: on missing or unknown keys, naming them.
        """
        known = {f.name for f in fields(cls)}
        if set(state) != known:
            raise SnapshotMismatchError(
                f"Malformed training snapshot: missing keys {sorted(known - set(state))}, unknown keys"
                f" {sorted(set(state) - known)}; a snapshot has exactly {sorted(known)}."
            )
        return cls(model=state["model"], optimizers=list(state["optimizers"]), schedulers=list(state["schedulers"]),
                   scaler=state["scaler"], rng=state["rng"], buffers=dict(state["buffers"]),
                   callbacks=dict(state["callbacks"]), generators=list(state["generators"]))

    def matches(self, trainer: pl.Trainer, pl_module: pl.LightningModule, scaler: Any = None) -> bool:
        """Whether the live state equals this snapshot bit for bit (for tests and checks).

        Compares the model's parameters and buffers (dtypes included; non-persistent ones too), every optimizer's
        and LR scheduler's state, the captured callbacks' and dataloader generators' states and, when ``scaler``
        is given and the snapshot holds scaler state, the loss scaler's state.
        """
        buffers = dict(pl_module.named_buffers())
        by_key = {cb.state_key: cb for cb in lightning.callbacks(trainer)}
        pairs = [
            (model_state(trainer, pl_module), self.model),
            ({name: buffers.get(name) for name in self.buffers}, self.buffers),
            ([opt.state_dict() for opt in trainer.optimizers], self.optimizers),
            ([cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs], self.schedulers),
            ({key: by_key[key].state_dict() if key in by_key else None for key in self.callbacks}, self.callbacks),
        ]
        if self.generators:
            pairs.append(([g.get_state() for g in _loader_generators(trainer)], self.generators))
        if scaler is not None and self.scaler is not None:
            pairs.append((scaler.state_dict(), self.scaler))
        cpu = torch.device("cpu")  # (each rank compares what it holds: a DTensor's local shard)
        return all(structures_equal(to_device(plain_tensors(live), cpu), to_device(plain_tensors(stored), cpu),
                                    _bits_equal) for live, stored in pairs)


def _loader_generators(trainer: pl.Trainer) -> list[torch.Generator]:
    """The distinct ``torch.Generator`` objects of the training dataloaders, in a stable order."""
    found: list[torch.Generator] = []
    for loader in lightning.train_dataloaders(trainer):
        batch_sampler = getattr(loader, "batch_sampler", None)
        for owner in (loader, getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and not any(generator is g for g in found):
                found.append(generator)
    return found


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality: NaNs compare equal to identical NaNs, and -0.0 differs from 0.0."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() and a.element_size() in _SAME_SIZE_INT:
        as_int = _SAME_SIZE_INT[a.element_size()]
        return torch.equal(a.detach().contiguous().view(as_int), b.detach().contiguous().view(as_int))
    return torch.equal(a, b)
