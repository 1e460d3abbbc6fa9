"""Smoke test of ``benchmarks/compare.py``: the whole pipeline on tiny models, so the benchmark does not rot.

It runs the script exactly as documented, with ``--smoke`` (tiny models, 4 steps per mode, one measured round) and
checks that every model and mode produced results (the three CoMP modes, each with the plan of its own search:
``comp`` for throughput, ``comp-balanced`` and ``comp-memory`` for the memory axis; the one-line type rule
``type-linear``, a fixed plan) and that every output file was written, with CoMP against the best fixed policy, the
trialled plan against the fastest measured and the forecast against training in the ratios and the Markdown. It
never asserts timings or ratios: those depend on the machine and are the benchmark's business, not the test's.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_comp.devices import device_class
from lightning_comp.numerics.precision import ComputePrecision
from tests.helpers.paths import REPO

ROOT = REPO
SCRIPT = ROOT / "benchmarks" / "compare.py"
MODELS = ("cnn", "gpt", "lstm", "mlp")
AXIS_MODES = {"comp-balanced": ("CoMP (balanced)", "balanced"), "comp-memory": ("CoMP (memory)", "memory")}
MEMORY_TARGET_MODELS = ("cnn", "gpt")


@pytest.mark.slow
def test_compare_smoke(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--models", ",".join(MODELS), "--out", str(out), "--img", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"

    report = json.loads((out / "compare.json").read_text())
    assert report["smoke"] is True
    assert set(report["models"]) == set(MODELS)
    expected_modes = {"fp32", "bf16-mixed", "bf16-true", "type-linear", "comp", *AXIS_MODES}
    if "16-mixed" in report["modes"]:
        expected_modes.add("16-mixed")
    if report["device"] == "cpu":  # never on a CPU (Lightning runs bf16-mixed for it); why depends on the CPU class
        fp16_native = device_class("cpu").is_native(ComputePrecision.FP16)
        why = report["skipped_modes"]["16-mixed"]
        assert ("FP16 is native on this CPU" if fp16_native else "no fast FP16") in why, why
    skipped = {key: set(model.get("skipped_modes", {})) for key, model in report["models"].items()}
    # a Lightning precision is skipped only where it cannot run (bf16-mixed LSTM on an AVX2-only CPU)
    assert all(modes <= {"bf16-mixed"} for modes in skipped.values()), skipped
    for key, model in report["models"].items():
        assert set(model["modes"]) == expected_modes - skipped[key], key
        for mode, entry in model["modes"].items():
            assert "error" not in entry, f"{key}/{mode}: {entry.get('error')}"
            assert entry["steps"] == report["specs"][key]["steps"]
            assert entry["throughput"]["samples_per_s"] > 0
            assert entry["memory"]["peak_bytes"] > 0
            assert entry["saved_for_backward"]["activation_bytes"] > 0
            assert entry["validation"] and entry["validation"][-1]["step"] == entry["steps"]
            assert math.isfinite(entry["final_validation"]["val_loss"])
        search = model["search"]
        assert "error" not in search, search.get("error")
        assert search["measured"]["search_seconds"] >= 0
        assert search["chosen_trial"]
        assert search["objective"] == "throughput"
        if "bf16-mixed" in model["modes"]:
            assert "throughput_vs_bf16-mixed" in model["ratios"]
        assert model["modes"]["type-linear"]["plan_lowered"] == ["type:Linear"], key
        ratios = model["ratios"]
        assert "throughput_vs_type-linear" in ratios, key
        assert ratios["best_fixed_policy"]["mode"] in {"fp32", "bf16-mixed", "bf16-true", "type-linear"}, key
        assert "throughput_vs_best_fixed" in ratios, key
        assert "trialled_vs_fastest_measured" in ratios, key  # NaN until the search record has trialled_plan
        assert {"forecast", "training", "gap_pct"} <= set(ratios["forecast_vs_training_amp"]), key
        assert "trialled_plan" in search, key
        assert set(model["searches"]) == set(AXIS_MODES), key
        for mode, (_, objective) in AXIS_MODES.items():
            axis_search = model["searches"][mode]
            assert "error" not in axis_search, f"{key}/{mode}: {axis_search.get('error')}"
            assert axis_search["objective"] == objective
            assert axis_search["chosen_trial"] and axis_search["measured"]["search_seconds"] >= 0
            assert isinstance(axis_search["saved_lowered"], dict)
            assert isinstance(model["modes"][mode]["plan_saved"], dict)
            ratios = model["ratios_by_mode"][mode]
            assert isinstance(ratios["converges_like_fp32"], bool)
            if "bf16-mixed" in model["modes"]:
                assert {"throughput_vs_bf16-mixed", "memory_step_peak_vs_bf16-mixed",
                        "saved_bytes_vs_bf16-mixed"} <= set(ratios), (key, mode)
    assert report["targets"]["checks"], "no target was evaluated"
    targets = {(c["target"], c["model"]) for c in report["targets"]["checks"]}
    for key in MODELS:
        for name in ("throughput CoMP/best fixed policy that converges",
                     "trialled plan/fastest measured plan (batch stage)", "|gap| training vs forecast CoMP/AMP (%)"):
            assert (name, key) in targets, (name, key)
    for key in MEMORY_TARGET_MODELS:
        for mode, (label, _) in AXIS_MODES.items():
            if mode in report["models"][key]["modes"] and "bf16-mixed" in report["models"][key]["modes"]:
                assert (f"peak tensor memory of a training step {label}/AMP", key) in targets
                assert (f"throughput {label}/AMP", key) in targets
        assert ("val_loss CoMP (memory)/FP32", key) in targets

    with (out / "compare.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["model"], r["mode"]) for r in rows} == {(k, m) for k in MODELS for m in expected_modes - skipped[k]}
    markdown = (out / "compare.md").read_text()
    assert "| model | mode |" in markdown and "Ratios and targets" in markdown
    # every trained mode's steady batches split into forward, backward and the update
    phases = markdown.split("## Where a training step's time goes", 1)[1].split("\n## ", 1)[0]
    assert all(f"| {key} | {label} |" in phases for key in MODELS for label in ("FP32 (32-true)", "CoMP (memory)")), \
        phases
    fixed = markdown.split("## CoMP vs fixed policies and the batch stage's forecast", 1)[1].split("\n## ", 1)[0]
    assert 'CoMP / Type rule {"type:Linear": "bf16"}' in fixed and "trialled vs fastest" in fixed
    for key in MODELS:
        assert f"| {key} |" in fixed, key
    axis = markdown.split("## Memory axis", 1)[1].split("\n## ", 1)[0]
    for key in MODELS:
        for label, _ in AXIS_MODES.values():
            assert f"| {key} | {label} |" in axis, (key, label)
    searches = markdown.split("## CoMP searches by objective", 1)[1].split("\n## ", 1)[0]
    for key in MODELS:
        for label, objective in AXIS_MODES.values():
            assert f"| {key} | {label} | {objective} |" in searches, (key, label)
    raw = json.loads(gzip.decompress((out / "compare_raw.json.gz").read_bytes()))
    assert set(raw["raw"]) == set(MODELS)
    for name in ("compare_throughput.png", "compare_memory.png", "compare_val_curves.png"):
        assert (out / name).stat().st_size > 0, name
    assert "CoMP/AMP" in proc.stdout and "CoMP (memory)/AMP" in proc.stdout


@pytest.mark.slow
def test_compare_smoke_compiled(tmp_path: Path) -> None:
    """``--compile``: FP32, AMP and CoMP with a compiled forward, each run's graphs and graph breaks reported."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--compile", "--models", "mlp", "--no-plots", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads((out / "compare.json").read_text())
    assert report["compile"] is True and report["modes"] == ["fp32", "bf16-mixed", "comp"]
    raw = json.loads(gzip.decompress((out / "compare_raw.json.gz").read_bytes()))["raw"]["mlp"]
    for mode in ("fp32", "bf16-mixed", "comp"):
        stats = raw["runs"][mode]["dynamo"]
        assert stats["unique_graphs"] >= 1, mode  # the forward was compiled
        assert stats["graph_breaks"] == 0, (mode, stats["break_reasons"])
    assert raw["search"]["dynamo"]["unique_graphs"] >= 1
    text = (out / "compare.md").read_text()
    assert "## torch.compile" in text and "| mlp | CoMP (searched plan) |" in text.split("## torch.compile")[1]
