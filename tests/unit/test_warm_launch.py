"""The warm start of test scripts (``tests/helpers/warm_launch.py``): a child forked from a server that imported torch,
Lightning and the package once must see what ``python script.py`` would, and report what it would report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.warm_launch import can_start_warm, run_warm, start_warm

# each server imports torch and Lightning once (seconds); one group with tests/unit/test_launch_ranks.py, whose ENV
# is this one, so that the two files share the servers
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("warm_launch"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="warm starts fork: Linux only")]

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1"}

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "path0": sys.path[0],
                  "rank": os.environ.get("LOCAL_RANK"), "preloaded": "lightning_comp" in sys.modules,
                  "hash": hash("a string")}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def _script(folder: Path, text: str = SCRIPT) -> Path:
    path = folder / "script.py"
    path.write_text(text)
    return path


def test_a_script_sees_what_a_fresh_process_would_and_reports_its_status(tmp_path: Path) -> None:
    code, work = tmp_path / "code", tmp_path / "work"
    code.mkdir()
    work.mkdir()
    script = _script(code)
    # LOCAL_RANK differs per launch: the server is ENV's, the child gets the request's environment
    done = run_warm([sys.executable, str(script), "3", "more"], cwd=work, env={**ENV, "LOCAL_RANK": "5"}, timeout=120)
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv"] == [str(script), "3", "more"] and seen["cwd"] == str(work) and seen["name"] == "__main__"
    assert seen["path0"] == str(script.parent) and seen["rank"] == "5"
    assert seen["preloaded"], "the child imported nothing of its own: torch, Lightning and the package came loaded"
    assert done.stderr.strip() == "to stderr"


def test_an_uncaught_exception_and_a_signal_end_it_as_they_would_end_a_fresh_process(tmp_path: Path) -> None:
    failing = run_warm([sys.executable, "-c", "raise ValueError('bad value 7')"], cwd=tmp_path, env=ENV, timeout=120)
    assert failing.returncode == 1 and "ValueError: bad value 7" in failing.stderr
    killed = run_warm([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                      cwd=tmp_path, env=ENV, timeout=120)
    assert killed.returncode == -9


def test_ranks_start_from_servers_of_their_own_and_keep_distinct_hash_seeds(tmp_path: Path) -> None:
    script = _script(tmp_path)
    outputs = [(tmp_path / f"{rank}.out", tmp_path / f"{rank}.err") for rank in (0, 1)]
    processes = start_warm([sys.executable, str(script), "0"], tmp_path, [ENV, ENV], outputs)
    assert [process.wait(120) for process in processes] == [0, 0]
    seen = [json.loads(out.read_text()) for out, _ in outputs]
    assert seen[0]["hash"] != seen[1]["hash"]  # as two interpreters, each with its own random string-hash seed


def test_a_run_past_its_timeout_is_killed_and_raises(tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_warm([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"], cwd=tmp_path,
                 env=ENV, timeout=3)


def test_what_is_not_this_interpreter_running_a_script_starts_fresh(tmp_path: Path) -> None:
    assert not can_start_warm(["/bin/echo", "hi"]) and not can_start_warm([sys.executable, "-m", "pytest"])
    assert can_start_warm([sys.executable, "x.py"]) and can_start_warm([sys.executable, "-c", "pass"])
    done = run_warm(["/bin/echo", "hi"], cwd=tmp_path, env=ENV, timeout=30)
    assert done.returncode == 0 and done.stdout == "hi\n"
    with pytest.raises(ValueError, match="cannot start"):
        start_warm(["/bin/echo", "hi"], tmp_path, [ENV], [(tmp_path / "o", tmp_path / "e")])


def test_a_server_that_cannot_start_raises_with_what_it_printed(tmp_path: Path) -> None:
    broken = {**ENV, "PYTHONHOME": str(tmp_path / "no-such-python")}  # the interpreter itself fails to start
    with pytest.raises(RuntimeError, match="did not start") as raised:
        run_warm([sys.executable, "-c", "pass"], cwd=tmp_path, env=broken, timeout=60)
    assert "no-such-python" in str(raised.value)
