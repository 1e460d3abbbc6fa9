"""Smoke test of ``benchmarks/update_kernel.py``: every configuration steps its parameter, the compiled ones through
the compiled path (every step after the first), the native ones through the native step, the eager ones through
neither; the report has a row per configuration. It
never asserts timings (they depend on the machine)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

SCRIPT = REPO / "benchmarks" / "update_kernel.py"


@pytest.mark.slow
def test_update_kernel_smoke(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads((out / "update_kernel.json").read_text())
    assert set(report["sizes"]) == {"4096", "65536"}
    for size, rows in report["sizes"].items():
        assert {"torch-adamw", "torch-adamw-foreach", "8bit+master/compiled", "state-8bit/eager",
                "state-8bit/native", "8bit+master/native", "state-bf16/native", "master-bf16/native"} <= set(rows)
        for name, row in rows.items():
            assert math.isfinite(row["us"]) and row["us"] > 0, (size, name)
            if name.endswith("/compiled"):
                assert row["compiled_steps"] > 0 and row["native_steps"] == 0, (size, name)
            elif name.endswith("/native"):
                assert row["native_steps"] > 0 and row["compiled_steps"] == 0, (size, name)
            elif name.endswith("/eager"):
                assert row["compiled_steps"] == row["native_steps"] == 0, (size, name)
    text = (out / "update_kernel.md").read_text()
    assert "| 8bit+master/compiled |" in text and "65,536 elements" in text


def test_bad_sizes_and_formats_are_refused_naming_them() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import update_kernel

    with pytest.raises(SystemExit):
        update_kernel.parse_args(["--sizes", "1000"])
    with pytest.raises(SystemExit):
        update_kernel.parse_args(["--formats", "state-fp4"])
    assert update_kernel.parse_args(["--sizes", "4096,8192"]).sizes == [4096, 8192]
