"""Run the CUDA checks: simulated on a CPU-only torch (the default), or against the real GPU (``--real``).

Usage::

    python -m tests.cuda_sim.run [--real] [pytest arguments ...]

Simulated, it builds the shim for the installed torch and loads it before torch is imported, then runs the checks in
``tests/cuda_sim/checks`` for sm70, sm75, sm80 and sm90. With ``--real`` it loads nothing and runs the same checks on
``cuda:0`` as it is. Exit status: pytest's; 3 when the shim cannot be built here (the reason is printed).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.cuda_sim.shim import ShimUnavailable, build_shim, load_shim

CHECKS = Path(__file__).with_name("checks")
MODE_VARIABLE = "LIGHTNING_COMP_CUDA_CHECKS"  # "simulated" or "real": read by checks/conftest.py
SHARD_VARIABLE = "LIGHTNING_COMP_CUDA_SHARD"  # "i/n": every n-th check from the i-th only (checks/conftest.py)
NO_SHIM = 3


def main(argv: list[str]) -> int:
    real = "--real" in argv
    args = [a for a in argv if a != "--real"]
    if not real:
        try:
            load_shim(build_shim())
        except ShimUnavailable as err:
            print(f"the CUDA simulation cannot run here: {err}", file=sys.stderr)
            return NO_SHIM
    os.environ[MODE_VARIABLE] = "real" if real else "simulated"
    import pytest  # after the shim: pytest's plugins may import torch

    paths = [] if any(a.startswith("tests/cuda_sim/checks") for a in args) else [str(CHECKS)]
    return int(pytest.main([*paths, "-o", "python_files=check_*.py", "-p", "no:cacheprovider", *args]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
