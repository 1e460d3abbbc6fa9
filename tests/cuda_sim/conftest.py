"""The checks in ``checks/`` run only through ``python -m tests.cuda_sim.run`` (their own process, the shim loaded
before torch); the main suite runs them through ``test_simulation.py``."""

import os

collect_ignore = [] if os.environ.get("LIGHTNING_COMP_CUDA_CHECKS") else ["checks"]
