"""The model state a snapshot copies, on each rank: what that rank holds, whether the model is sharded or not.

- Not sharded (one device, DDP): the LightningModule's ``state_dict()``.
- FSDP2 (``fully_shard``, e.g. under ``ModelParallelStrategy``): the same ``state_dict()``, whose parameters are
  ``DTensor`` shards; a copy keeps each rank's local shard (and its placement), and loading it writes each rank's
  shard back in place. No collective is needed either way.
- FSDP1 (``FullyShardedDataParallel``, under ``FSDPStrategy``): the wrapper's *local* state dict (each flat
  parameter's shard on this rank, ``StateDictType.SHARDED_STATE_DICT``), since the wrapped module's own parameters are
  views into flat parameters that hold nothing between steps. No collective either.

Every rank copies and restores only its own part, so a rewind costs each rank a copy of its shard of the model and of
its optimizer state (the optimizers hold flat or ``DTensor`` shards under FSDP, and their ``state_dict()`` is per rank
already).

A checkpoint written during a sharded search must carry every rank's snapshot, while Lightning writes only rank 0's
callback states into it: :func:`gather_to_rank_zero` sends each rank's to rank 0 as the checkpoint is written (one
copy of every shard of the snapshots on rank 0's CPU while it is written), and :func:`own_part` gives each rank its
own back on resume.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_comp.adapters.lightning_internals import fsdp1_wrapper
from lightning_comp.errors import SnapshotMismatchError

__all__ = ["gather_to_rank_zero", "load_model_state", "model_state", "own_part", "plain_tensors", "portable",
           "rehydrate", "sharded_run"]


_FSDP1 = "fsdp1:"


@contextmanager
def _sharded_state_dicts(wrapper: nn.Module) -> Iterator[None]:
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    with warnings.catch_warnings():  # (FSDP1's state-dict API warns of its deprecation in favour of FSDP2's)
        warnings.simplefilter("ignore", FutureWarning)
        with FullyShardedDataParallel.state_dict_type(wrapper, StateDictType.SHARDED_STATE_DICT):
            yield


def model_state(trainer: pl.Trainer | None, pl_module: nn.Module) -> dict[str, Any]:
    """This rank's model state (parameters and persistent buffers): see the module docstring. Its tensors alias the
    live ones: copy them to keep them."""
    wrapper = fsdp1_wrapper(trainer, pl_module)
    if wrapper is None:
        return pl_module.state_dict()
    with _sharded_state_dicts(wrapper):
        return {f"{_FSDP1}{key}": value for key, value in wrapper.state_dict().items()}


def load_model_state(trainer: pl.Trainer | None, pl_module: nn.Module, state: dict[str, Any]) -> None:
    """Write ``state`` (:func:`model_state`'s form, or with each sharded tensor as the list of this rank's local
    shards, :func:`plain_tensors`' form, as a checkpoint carries it) back into the live model on this rank.

    Raises:
        SnapshotMismatchError: if an FSDP1 state does not match the model's sharding now.
    """
    wrapper = fsdp1_wrapper(trainer, pl_module)
    if wrapper is None or not any(key.startswith(_FSDP1) for key in state):
        pl_module.load_state_dict(state)
        return
    with _sharded_state_dicts(wrapper):
        live = wrapper.state_dict()
        values = {}
        for key, value in state.items():
            name = key[len(_FSDP1):]
            if isinstance(value, list):  # this rank's local shards: written into the live sharded tensor's
                shards = [shard.tensor for shard in live[name].local_shards()]
                if len(shards) != len(value) or any(a.shape != b.shape for a, b in zip(shards, value, strict=True)):
                    raise SnapshotMismatchError(
                        f"The search's snapshot holds another shard of {name!r} than this rank holds now: resume"
                        " with the same strategy, sharding and number of processes.")
                with torch.no_grad():
                    for shard, saved in zip(shards, value, strict=True):
                        shard.copy_(saved)
                value = live[name]
            values[name] = value
        wrapper.load_state_dict(values)


_LOCAL = "__local_shard__"  # a DTensor's local shard in a portable state (a plain dict: weights_only loads it)


def portable(state: Any) -> Any:
    """``state`` with each ``DTensor`` as ``{"__local_shard__": its local tensor}`` and each ``ShardedTensor`` as the
    list of this rank's local shards: picklable anywhere, loadable with ``weights_only=True``."""
    if isinstance(state, dict):
        return {key: portable(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(portable(value) for value in state)
    if isinstance(state, torch.Tensor) and callable(getattr(state, "to_local", None)):
        return {_LOCAL: state.to_local()}  # type: ignore[attr-defined]
    return plain_tensors(state)


def rehydrate(stored: Any, live: Any) -> Any:
    """``stored`` (:func:`portable`'s form, or as it was) with each local shard made the ``DTensor`` it was again, on
    the mesh and placements of the live ``DTensor`` at the same place in ``live`` (a plain tensor where there is
    none)."""
    if isinstance(stored, dict) and set(stored) == {_LOCAL}:
        local = stored[_LOCAL]
        if isinstance(live, torch.Tensor) and callable(getattr(live, "to_local", None)):
            from torch.distributed.tensor import DTensor

            mesh, placements = live.device_mesh, live.placements  # type: ignore[attr-defined]
            return DTensor.from_local(local.to(live.device), mesh, placements, run_check=False, shape=live.shape,
                                      stride=live.stride())
        return local
    if isinstance(stored, dict):
        mapping: dict[Any, Any] = live if isinstance(live, dict) else {}
        return {key: rehydrate(value, mapping.get(key)) for key, value in stored.items()}
    if isinstance(stored, (list, tuple)):
        items: Any = live if isinstance(live, (list, tuple)) and len(live) == len(stored) else [None] * len(stored)
        return type(stored)(rehydrate(value, other) for value, other in zip(stored, items, strict=True))
    return stored


def plain_tensors(state: Any) -> Any:
    """``state`` with each ``ShardedTensor`` replaced by the list of this rank's local shards and each ``DTensor`` (or
    its portable form) by its local tensor: what each rank holds, for bit-for-bit comparisons."""
    if isinstance(state, dict) and set(state) == {_LOCAL}:
        return state[_LOCAL]
    if isinstance(state, dict):
        return {key: plain_tensors(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(plain_tensors(value) for value in state)
    to_local = getattr(state, "to_local", None)
    if isinstance(state, torch.Tensor) and callable(to_local):
        return to_local()
    local_shards = getattr(state, "local_shards", None)
    if callable(local_shards):
        return [shard.tensor for shard in local_shards()]
    return state


def sharded_run(trainer: pl.Trainer) -> bool:
    """Whether ``trainer`` trains a model sharded over more than one process (FSDP1 or FSDP2), its process group up."""
    if trainer.world_size < 2 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from lightning_comp.execution.fsdp2_policies import fsdp2_units

    return fsdp1_wrapper(trainer, trainer.lightning_module) is not None or bool(fsdp2_units(trainer.lightning_module))


def gather_to_rank_zero(value: Any) -> list[Any] | None:
    """Every rank's ``value`` (moved to the CPU), as a list by rank on rank 0 (``None`` on the others). Every rank
    must call it."""
    import torch.distributed as dist

    from lightning_comp.common.nested import to_device

    # a ShardedTensor or DTensor unpickles only where its process group and mesh are: their local shards travel,
    # on the CPU, and :func:`rehydrate` makes them distributed tensors again against the live ones
    local = to_device(portable(value), torch.device("cpu"))
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    return gathered


def own_part(value: Any) -> Any:
    """This rank's part of a value :func:`gather_to_rank_zero` wrote (``{"per_rank": [...]}``), or ``value`` as it is.

    Raises:
        SnapshotMismatchError: if the checkpoint was written by another number of processes.
    """
    if not (isinstance(value, dict) and set(value) == {"per_rank"}):
        return value
    import torch.distributed as dist

    parts = value["per_rank"]
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if parts is None or len(parts) != world:
        raise SnapshotMismatchError(
            f"This checkpoint was written inside a sharded search by {0 if parts is None else len(parts)} processes;"
            f" resuming it needs the same number, not {world} (each holds its own shards of the search's snapshots).")
    return parts[rank]
