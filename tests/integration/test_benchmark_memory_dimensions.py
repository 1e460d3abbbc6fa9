"""Smoke test of ``benchmarks/memory_dimensions.py``: the tiny ``gpt`` (the suite's model with 8-bit-sized tensors;
``cnn``'s smoke tensors are all under 4096 elements) under FP32, AMP, a CoMP plan that sets every memory dimension,
and that plan with each dimension removed in turn, all in one process.

It runs the script as documented, with ``--smoke``, and checks the outputs and the accounting: every configuration
ran, each row's parts (weights, gradients, optimizer state, in-step peak) add up to its step peak, removing the
optimizer-state dimension never lowers the optimizer-state bytes, and 8-bit state is smaller than AMP's FP32 state.
It never asserts timings or throughput ratios (they depend on the machine).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

SCRIPT = REPO / "benchmarks" / "memory_dimensions.py"
MODELS = ("gpt",)
ABLATIONS = ("plan-no-state", "plan-no-master", "plan-no-recompute", "plan-no-saved")
PARTS = ("weights_bytes", "gradients_bytes", "optimizer_state_bytes", "in_step_peak_bytes")


@pytest.mark.slow
def test_memory_dimensions_smoke(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--models", ",".join(MODELS), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    for name in ("memory_dimensions.md", "memory_dimensions.json", *(f"plan_{key}.json" for key in MODELS)):
        assert (out / name).stat().st_size > 0, name

    report = json.loads((out / "memory_dimensions.json").read_text())
    assert report["smoke"] is True
    assert report["torch"] and report["device_class"] and report["commit"]
    assert set(report["models"]) == set(MODELS)
    quantised_models = []
    for key, model in report["models"].items():
        configs = model["configs"]
        # the built-in lean plan sets every dimension, so every ablation has a row
        assert list(configs) == ["fp32", "amp", "plan", *ABLATIONS], key
        for ckey, entry in configs.items():
            assert "error" not in entry, f"{key}/{ckey}: {entry['error']}"
            mem = entry["memory"]
            assert sum(mem[part] for part in PARTS) == mem["step_peak_bytes"], (key, ckey, mem)
            assert min(mem[part] for part in PARTS) >= 0 and mem["weights_bytes"] > 0, (key, ckey, mem)
            ratio = entry["throughput_vs_amp"]["median"]
            assert math.isfinite(ratio) and ratio > 0, (key, ckey)
            assert entry["step_peak_vs_amp"] > 0
        plan, amp = configs["plan"]["memory"], configs["amp"]["memory"]
        assert configs["plan-no-state"]["memory"]["optimizer_state_bytes"] >= plan["optimizer_state_bytes"], key
        assert plan["optimizer_state_bytes"] <= amp["optimizer_state_bytes"], key
        # BF16 master weights halve the weights the plan holds in BF16 (and their gradients)
        assert configs["plan-no-master"]["memory"]["weights_bytes"] > plan["weights_bytes"], key
        if configs["plan"]["optimizer_state_tensors_by_dtype"].get("uint8"):
            quantised_models.append(key)
            assert plan["optimizer_state_bytes"] < amp["optimizer_state_bytes"], key
        assert set(model["effects"]) == {a[len("plan-no-"):] for a in ABLATIONS}, key
    # tensors under 4096 elements keep FP32 state; the smoke gpt's embedding and MLP weights are above that
    assert "gpt" in quantised_models

    markdown = (out / "memory_dimensions.md").read_text()
    assert ("| model | configuration | weights MiB | grads MiB | optimizer state MiB | in-step peak MiB |"
            " step peak MiB | x AMP | throughput x AMP [interval] |") in markdown
    for key in MODELS:
        for label in ("FP32 (32-true)", "AMP (bf16-mixed)", "CoMP lean plan"):
            assert f"| {key} | {label} |" in markdown, (key, label)
    assert "## Each dimension's effect" in markdown
    assert report["device_class"] in markdown


def test_without_amp_the_plan_is_measured_beside_fp32_and_its_ablations_only() -> None:
    """``--no-amp`` (a CPU where bf16 is emulated would spend most of the run on AMP's row): no AMP configuration."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import memory_dimensions

    from lightning_comp import PrecisionPlan

    plan = PrecisionPlan.from_dict({"fc": {"state": "8bit", "master": "bf16"}})
    keys = [c.key for c in memory_dimensions.configurations(plan, "CoMP plan", amp=False)]
    assert keys == ["fp32", "plan", "plan-no-state", "plan-no-master"]
    assert [c.key for c in memory_dimensions.configurations(plan, "CoMP plan")][:3] == ["fp32", "amp", "plan"]
    assert memory_dimensions.parse_args(["--no-amp"]).no_amp
