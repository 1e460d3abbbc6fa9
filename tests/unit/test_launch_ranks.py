"""The helper that starts a 2-process test's ranks at once (``tests/helpers/distributed.launch_ranks``): a failing
rank stops the other and its status is the one reported, and a hang raises instead of waiting forever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import launch_ranks

# the environment of tests/unit/test_warm_launch.py too: the warm case shares its servers (one xdist group)
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1"}
WARM = pytest.param(True, id="warm", marks=[pytest.mark.slow, pytest.mark.xdist_group("warm_launch")])


def test_both_ranks_run_with_their_own_rank_and_one_port(tmp_path: Path) -> None:
    code = "import os; print(os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'])"
    done = launch_ranks([sys.executable, "-c", code], tmp_path, {**ENV, "LOCAL_RANK": "7", "PL_GLOBAL_SEED": "1"},
                        timeout=60, warm=False)
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines() if not line.startswith("---")]
    assert sorted(rank for rank, _, _ in lines) == ["0", "1"]  # an inherited LOCAL_RANK does not leak in
    assert {size for _, size, _ in lines} == {"2"} and len({port for _, _, port in lines}) == 1


@pytest.mark.parametrize("warm", [WARM, pytest.param(False, id="fresh")])
def test_a_failing_rank_stops_the_other_and_its_status_is_reported(tmp_path: Path, warm: bool) -> None:
    # rank 0 waits (as it would in the process group's rendezvous); rank 1 fails at once
    code = "import os, sys, time; sys.exit(3) if os.environ['LOCAL_RANK'] == '1' else time.sleep(60)"
    done = launch_ranks([sys.executable, "-c", code], tmp_path, ENV, timeout=50, warm=warm)
    assert done.returncode == 3


def test_a_hang_raises_a_timeout(tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        launch_ranks([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path, ENV, timeout=1, warm=False)
