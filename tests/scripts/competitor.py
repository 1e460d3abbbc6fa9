"""A competing workload for busy-machine tests and benchmarks: processes that keep every CPU busy.

Like the neighbour in the bug report (a ``pip install`` and a second training run): one PyTorch process running
matrix products on as many intra-op threads as there are CPUs, plus one single-threaded Python loop. The context
manager waits until the load shows in ``/proc/stat`` and yields what it measured.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from lightning_comp.search.measurement.machine_load import LoadMeter, MachineLoad, cpus_available

# Both stop when their parent dies (a SIGKILLed test run cannot clean up after itself).
TRAINING_LIKE = """
import os, sys, torch
parent = int(sys.argv[2])
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(384, 384)
while os.getppid() == parent:
    a @ a
"""
SPINNER = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    pass
"""


def measure_load(seconds: float = 0.5) -> MachineLoad:
    """The load over the next ``seconds`` (this process idle)."""
    meter = LoadMeter()
    meter.start()
    time.sleep(seconds)
    return meter.stop()


@contextmanager
def competing_load(threads: int | None = None, timeout: float = 30.0) -> Iterator[MachineLoad]:
    """Keep the CPUs busy while the block runs; yields the load measured once the competitors are running.

    Args:
        threads: intra-op threads of the training-like competitor (default: every CPU this process may use).
        timeout: seconds to wait for the load to show before giving up and yielding what was measured.
    """
    cpus = cpus_available()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # hold no pipe of the caller's
    parent = str(os.getpid())
    procs = [subprocess.Popen([sys.executable, "-c", TRAINING_LIKE, str(threads or cpus), parent], **quiet),
             subprocess.Popen([sys.executable, "-c", SPINNER, parent], **quiet)]
    try:
        deadline = time.monotonic() + timeout
        load = measure_load()
        while (load.others_cpus is not None and load.others_cpus < cpus - 0.5 and time.monotonic() < deadline
               and all(p.poll() is None for p in procs)):
            load = measure_load()  # the torch import takes a moment
        yield load
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)
