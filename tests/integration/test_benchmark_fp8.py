"""Smoke test of ``benchmarks/fp8_check.py`` (the fp8 part of the GPU check) on the CPU with tiny sizes: both parts
run, every mode trains, torchao's conversions swap the Linears they should, and the report has its rows. It never
asserts timings (fp8 is emulated on a CPU, and the machine is shared)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

SCRIPT = REPO / "benchmarks" / "fp8_check.py"


@pytest.mark.slow
def test_fp8_check_smoke(tmp_path: Path) -> None:
    out = tmp_path / "fp8"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    result = json.loads((out / "fp8_check.json").read_text())
    assert [(r["tokens"], r["in"], r["out"]) for r in result["linears"]] == [(48, 32, 64), (18, 64, 64)]
    assert all(r["ms"]["fp8"] > 0 and r["ms"]["fp8-rowwise"] > 0 and r["ms"]["bf16"] > 0 for r in result["linears"])
    modes = result["training"]["modes"]
    assert set(modes) == {"bf16-mixed", "torchao-all", "torchao-auto", "comp"}
    assert all("error" not in row and math.isfinite(row["val_loss"]) for row in modes.values()), modes
    assert modes["torchao-all"]["fp8_linears"] == 5  # every Linear of the tiny CharGPT has sizes fp8 takes
    assert modes["torchao-auto"]["fp8_linears"] == 0  # torchao's H100 rule: all of them too small
    assert modes["comp"]["fp8_linears"] == 0  # "auto": fp8 is emulated on a CPU, so not searched
    assert result["training"]["search"]["plan"] is not None
    assert "| torchao-all |" in (out / "fp8_check.md").read_text()
