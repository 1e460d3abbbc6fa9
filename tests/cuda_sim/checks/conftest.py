"""The GPUs the checks run on: the four simulated generations, or the real device (``run.py --real``)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.cuda_sim.run import MODE_VARIABLE, SHARD_VARIABLE
from tests.cuda_sim.simulated import GPUS, REAL, SimulatedGpu


def _mode() -> str:
    mode = os.environ.get(MODE_VARIABLE)
    if mode not in ("simulated", "real"):
        raise pytest.UsageError("run the CUDA checks with `python -m tests.cuda_sim.run [--real]` (the simulation"
                                " needs its shim loaded before torch)")
    if mode == "simulated" and torch.accelerator.current_accelerator() is None:
        raise pytest.UsageError("the simulated-CUDA shim is not in effect (torch saw no accelerator)")
    if mode == "real" and not torch.cuda.is_available():
        raise pytest.UsageError("--real needs a CUDA GPU")
    return mode


MODE = _mode()
TARGETS: tuple[SimulatedGpu, ...] = (REAL,) if MODE == "real" else GPUS


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "gpu" in metafunc.fixturenames:
        metafunc.parametrize("gpu", TARGETS, ids=[g.label for g in TARGETS])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``LIGHTNING_COMP_CUDA_SHARD=i/n`` keep the checks ``i, i + n, ...`` of the collected order: the main suite
    runs the simulation as ``n`` processes side by side, one per core, each over an equal share of every check file."""
    shard = os.environ.get(SHARD_VARIABLE)
    if not shard:
        return
    try:
        index, count = (int(part) for part in shard.split("/"))
    except ValueError:
        raise pytest.UsageError(f"{SHARD_VARIABLE}={shard!r}: expected 'i/n' with 0 <= i < n") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"{SHARD_VARIABLE}={shard!r}: expected 'i/n' with 0 <= i < n")
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index])
    items[:] = items[index::count]
