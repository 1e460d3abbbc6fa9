"""Bit-exact snapshots of a training run's state, so a rejected trial can be rewound.

A snapshot holds deep copies of the model's ``state_dict`` (parameters and buffers such as BatchNorm statistics),
every optimizer's and LR scheduler's state, the loss scaler's state, the RNG states (torch CPU and CUDA, Python,
NumPy) and the optimizer-step counter. Deep copies matter: ``state_dict()`` tensors alias the live ones.
Snapshots serialise to plain containers of tensors and numbers, so they can travel in a checkpoint that is loaded
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

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
    """Everything that must be restored for training to continue exactly as from the moment of capture."""

    model: dict[str, torch.Tensor]
    optimizers: list[dict[str, Any]]
    schedulers: list[dict[str, Any]]
    scaler: dict[str, Any] | None
    rng: dict[str, Any]

    @classmethod
    def capture(cls, trainer: pl.Trainer, pl_module: pl.LightningModule, scaler: Any = None) -> TrainingSnapshot:
        """Deep-copy the run's state now."""
        return cls(
            model=copy.deepcopy(pl_module.state_dict()),
            optimizers=[copy.deepcopy(opt.state_dict()) for opt in trainer.optimizers],
            schedulers=[copy.deepcopy(cfg.scheduler.state_dict()) for cfg in trainer.lr_scheduler_configs],
            scaler=None if scaler is None else copy.deepcopy(scaler.state_dict()),
            rng=capture_rng(),
        )

    def restore(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, scaler: Any = None, rng: bool = True
    ) -> None:
        """Put the captured state back (copies again, so the snapshot can be restored more than once)."""
        pl_module.load_state_dict(copy.deepcopy(self.model))
        for opt, state in zip(trainer.optimizers, self.optimizers):
            opt.load_state_dict(copy.deepcopy(state))
        for cfg, state in zip(trainer.lr_scheduler_configs, self.schedulers):
            cfg.scheduler.load_state_dict(copy.deepcopy(state))
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(copy.deepcopy(self.scaler))
        for param in pl_module.parameters():
            param.grad = None
        if rng:
            restore_rng(self.rng)

    def to_state(self) -> dict[str, Any]:
        """A checkpoint-friendly dictionary (tensors and plain Python values only)."""
        return {
            "model": self.model,
            "optimizers": self.optimizers,
            "schedulers": self.schedulers,
            "scaler": self.scaler,
            "rng": self.rng,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TrainingSnapshot:
        """Rebuild a snapshot from :meth:`to_state`'s dictionary."""
        return cls(
            model=state["model"],
            optimizers=list(state["optimizers"]),
            schedulers=list(state["schedulers"]),
            scaler=state.get("scaler"),
            rng=state["rng"],
        )

    def matches(self, trainer: pl.Trainer, pl_module: pl.LightningModule, scaler: Any = None) -> bool:
        """Whether the live state equals this snapshot bit for bit (for tests and checks).

        Compares the model's parameters and buffers (dtypes included), every optimizer's and LR scheduler's state
        and, when ``scaler`` is given and the snapshot holds scaler state, the loss scaler's state.
        """
        live = pl_module.state_dict()
        if live.keys() != self.model.keys():
            return False
        if not all(_equal(live[k], self.model[k]) for k in live):
            return False
        if len(trainer.optimizers) != len(self.optimizers):
            return False
        if not all(_equal(opt.state_dict(), state) for opt, state in zip(trainer.optimizers, self.optimizers)):
            return False
        configs = trainer.lr_scheduler_configs
        if len(configs) != len(self.schedulers):
            return False
        if not all(_equal(cfg.scheduler.state_dict(), state) for cfg, state in zip(configs, self.schedulers)):
            return False
        if scaler is not None and self.scaler is not None:
            return _equal(scaler.state_dict(), self.scaler)
        return True


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _bits_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality: NaNs compare equal to identical NaNs, and -0.0 differs from 0.0."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() and a.element_size() in _SAME_SIZE_INT:
        as_int = _SAME_SIZE_INT[a.element_size()]
        return torch.equal(a.detach().contiguous().view(as_int), b.detach().contiguous().view(as_int))
    return torch.equal(a, b)
