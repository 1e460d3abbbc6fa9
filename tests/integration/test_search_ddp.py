"""CoMPSearch under 2-process DDP (gloo on CPU): every rank runs the identical plan at every epoch, and with
trials of batches every rank cuts the same epochs at the same batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import DIST_VARS, launch_ranks
from tests.helpers.paths import SCRIPTS

SCRIPT = SCRIPTS / "ddp_search_run.py"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("strategy", "trial_batches", "objective"),
                         [("ddp", None, "throughput"), ("ddp_spawn", None, "throughput"), ("ddp", 2, "throughput"),
                          ("ddp", None, "memory")])
def test_every_rank_runs_the_same_plan(strategy: str, trial_batches: int | None, objective: str,
                                       tmp_path: Path) -> None:
    proc = None
    for _attempt in range(2):  # a second try only when the rendezvous itself failed (a port race on a shared host)
        with socket.socket() as sock:  # a port of our own: other 2-process jobs may run at the same time
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # Earlier in-process DDP runs leave LOCAL_RANK/WORLD_SIZE/... in os.environ; inherited, they make Lightning
        # believe the ranks are launched externally, so it never starts rank 1 and rank 0 waits for it.
        env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith(("TORCHELASTIC", "PL_"))}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        try:
            extra = [str(trial_batches or 0), objective]
            args = [sys.executable, str(SCRIPT), strategy, str(tmp_path), *extra]
            proc = (launch_ranks(args, tmp_path, env, timeout=300) if strategy == "ddp" else  # ranks started at once
                    subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                                   start_new_session=True))
        except subprocess.TimeoutExpired as err:
            proc = None
            output = str(err.stdout or "") + str(err.stderr or "")
            if "All distributed processes registered" in output:
                raise  # a hang after the rendezvous is a real failure
            continue
        if proc.returncode == 0 or "All distributed processes registered" in proc.stdout + proc.stderr:
            break  # success, or a failure after the rendezvous: a real one
    assert proc is not None, "the 2-process run never got past the rendezvous"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world_size"] == 2
    assert ranks[0]["epochs"] == ranks[1]["epochs"]  # same plan at every epoch start, trials included
    assert ranks[0]["final"] == ranks[1]["final"]
    assert ranks[0]["params"] == ranks[1]["params"]  # synchronous data parallel: identical weights
    assert ranks[0]["phase"] == "done"
    assert len({json.dumps(plan, sort_keys=True) for _, plan, _ in ranks[0]["epochs"]}) > 1  # trials did run
    if objective == "memory":  # only the pinned saved lowerings were trialled (low_precision="off")
        final = ranks[0]["final"]
        assert final and set(final) <= {"saved:l2", "saved:l3", "saved:l4"} and set(final.values()) == {"fp8"}
    batches = [b for _, _, b in ranks[0]["epochs"]]
    if trial_batches:  # each rank has 4 batches per epoch; rejected trials of 2 batches cut theirs short together
        assert 2 in batches and set(batches) == {2, 4}
    else:
        assert set(batches) == {4}
