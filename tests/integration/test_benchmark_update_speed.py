"""Smoke test of ``benchmarks/update_speed.py``: every configuration trains the suite's tiny model through the
Trainer, the compiled configurations take the compiled path without falling back, the native ones the native step,
and the report has its columns. It never asserts timings (they depend on the machine)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

SCRIPT = REPO / "benchmarks" / "update_speed.py"


@pytest.mark.slow
def test_update_speed_smoke(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--plans", "state-8bit,8bit+master", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads((out / "update_speed.json").read_text())
    rows = report["models"]["gpt"]["configs"]
    assert set(rows) == {"torch-adamw", "torch-adamw-foreach", "state-8bit/eager", "state-8bit/compiled",
                         "state-8bit/native", "8bit+master/eager", "8bit+master/compiled", "8bit+master/native"}
    for name, row in rows.items():
        assert math.isfinite(row["update_ms"]) and row["update_ms"] > 0 and row["ns_per_param"] > 0, name
        for run in row["runs"]:
            if row["path"] == "compiled":
                assert run["compiled_steps"] > 0 and run["fallback"] is None and run["native_steps"] == 0, name
            elif row["path"] == "native":
                assert run["native_steps"] > 0 and run["native_fallback"] is None, name
            elif row["path"] == "eager":
                assert run["compiled_steps"] == run["native_steps"] == 0, name
    assert "eager_over_compiled" in rows["state-8bit/compiled"]
    assert "compiled_over_native" in rows["state-8bit/native"]
    assert "| 8bit+master/compiled |" in (out / "update_speed.md").read_text()
