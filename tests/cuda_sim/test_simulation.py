"""The CUDA simulation, run from the main suite: one subprocess (the shim must be loaded before torch), all checks.

Skipped, saying why, only where the shim cannot be built (no C++ compiler, or a torch that is not a CPU build).
Failures are reported by check name, from the subprocess's JUnit XML.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.cuda_sim.run import SHARD_VARIABLE
from tests.cuda_sim.shim import ShimUnavailable, build_shim, load_shim
from tests.helpers.paths import REPO

# at least this many checks must run: 4 GPUs x (12 operator cases x 4 plans + the rest); fewer means checks vanished
MIN_CHECKS = 4 * 14 * 4  # GPUs x cases (litgpt, x-transformers, GPT-2 included: CI installs them) x precisions x saved


@pytest.mark.multiprocess  # two shard processes side by side
def test_the_plan_executes_on_simulated_cuda_as_cuda_requires(tmp_path: Path) -> None:
    try:
        build_shim()
    except ShimUnavailable as err:
        pytest.skip(f"the CUDA simulation cannot run here: {err}")
    # one process per core (two at most), each over every other check of each file, one thread each: the checks are
    # small and Python-bound, so two side by side take about half the time of one over all of them
    shards = max(1, min(2, os.cpu_count() or 1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    started = time.perf_counter()
    processes = []
    for index in range(shards):
        report = tmp_path / f"cuda_sim_{index}.xml"
        shard_env = {**env, SHARD_VARIABLE: f"{index}/{shards}", "OMP_NUM_THREADS": "1"}
        processes.append((report, subprocess.Popen(
            [sys.executable, "-m", "tests.cuda_sim.run", "-q", "-p", "no:randomly", f"--junitxml={report}"],
            cwd=REPO, env=shard_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    ran, failed = 0, []
    try:
        for report, process in processes:
            stdout, stderr = process.communicate(timeout=900)
            assert report.exists(), f"the simulation wrote no report (exit {process.returncode}):\n{stderr[-6000:]}"
            suite = ET.parse(report).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            assert suite is not None
            failed += [f"{case.get('classname')}::{case.get('name')}: {(bad.get('message') or '')[:400]}"
                       for case in suite.iter("testcase") for bad in (*case.findall("failure"), *case.findall("error"))]
            ran += int(suite.get("tests", 0)) - int(suite.get("skipped", 0))
            assert failed or process.returncode == 0, stdout[-4000:] + stderr[-4000:]
    finally:  # a shard that timed out, or whose sibling failed an assertion, is not left running
        for _, process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    seconds = time.perf_counter() - started
    assert not failed, f"{len(failed)} CUDA check(s) failed:\n" + "\n".join(failed[:30])
    assert ran >= MIN_CHECKS, f"only {ran} CUDA checks ran (expected at least {MIN_CHECKS})"
    print(f"CUDA simulation: {ran} checks in {seconds:.0f} s, {shards} processes")


def test_the_shim_refuses_to_load_after_torch() -> None:
    """Loaded after torch it would do nothing (torch would still see no accelerator): refused, saying so."""
    import torch  # noqa: F401  (already imported by the suite; the point is that it is)

    with pytest.raises(ShimUnavailable, match="torch was imported before the shim"):
        load_shim(Path("unused.so"))


def test_the_gpu_check_script_refuses_a_machine_without_a_gpu(tmp_path: Path) -> None:
    """``benchmarks/gpu_check.sh`` is for a GPU machine; elsewhere it stops at once (exit 2), saying why."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run benchmarks/gpu_check.sh itself")
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device visible to torch" in (tmp_path / "device.txt").read_text()
