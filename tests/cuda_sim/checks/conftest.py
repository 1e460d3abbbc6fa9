"""The GPUs the checks run on: the four simulated generations, or the real device (``run.py --real``)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.cuda_sim.simulated import GPUS, REAL, SimulatedGpu


def _mode() -> str:
    mode = os.environ.get("LIGHTNING_COMP_CUDA_CHECKS")
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
