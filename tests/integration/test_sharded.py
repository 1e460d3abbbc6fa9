"""A CoMP plan under sharded training, 2 processes over gloo on the CPU.

DDP, FSDP1 (root-only; every Linear its own unit, with activation checkpointing) and FSDP2
(``ModelParallelStrategy``; hooks alone, and plan-derived ``MixedPrecisionPolicy`` per unit plus hooks) end with
exactly the parameters of a 1-process reference over the same half-batches with averaged gradients, every matmul in
its planned dtype, for a bf16 and an fp16 plan. Sharded checkpoints resume bit for bit with their plan, a DDP
checkpoint resumes under FSDP1 and FSDP2 with its plan, and an overflow in one rank's gradient shard skips the step
on every rank.

Each run is ``tests/scripts/sharded_run.py`` in fresh interpreters, both ranks started at once as ``torchrun`` starts
them (:func:`~tests.helpers.distributed.launch_ranks`; the README's example below goes through Lightning's own
launcher); runs are cached for the module, so the checkpoint tests resume from the grid's own runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import launch_ranks
from tests.helpers.paths import REPO
from tests.helpers.warm_launch import run_warm

SCRIPT = REPO / "tests" / "scripts" / "sharded_run.py"
# FSDP1 root-only without activation checkpointing, and auto-wrapped with it (the checkpoint and overflow tests run
# that one too), in 5 modes x 2 plans; and FSDP1 auto-wrapped without it, for one plan
MODES = ("ddp", "fsdp1", "fsdp1_wrap_ac", "fsdp2", "fsdp2_policy")
PLANS = ("bf16", "fp16")
STEPS = 8  # two epochs of four
# FSDP2 all-gathers per step and rank: the three Linear units (their parameters padded to a multiple of the world
# size: 256 + 32, 1024 + 32, 64 + 2 elements) in forward and again in backward, the body's LayerNorm (64) once
LINEAR_ELEMENTS, BODY_ELEMENTS = 288 + 1056 + 66, 64
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


class Runs:
    """Runs of the script, each made once for the module (keyed by its arguments)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple[str, ...], list[dict[str, Any]]] = {}

    def __call__(self, mode: str, plan: str, *extra: str) -> list[dict[str, Any]]:
        key = (mode, plan, *extra)
        if key not in self.done:
            out = self.root / "-".join(k.strip("-").replace("/", "_") for k in key)[:120]
            out.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            argv = [sys.executable, str(SCRIPT), mode, plan, str(out), *extra]
            proc = (run_warm(argv, cwd=out, env=env, timeout=240) if mode == "reference" else
                    launch_ranks(argv, out, env, timeout=240))
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            ranks = (0,) if mode == "reference" else (0, 1)
            infos = [json.loads((out / f"rank{r}.json").read_text()) for r in ranks]
            for rank, info in zip(ranks, infos, strict=True):
                info["params"] = torch.load(out / f"rank{rank}.pt", weights_only=True)
            self.done[key] = infos
        return self.done[key]

    def checkpoint(self, mode: str, plan: str) -> str:
        """The grid run of ``mode``/``plan``, which checkpoints at the end of its first epoch: that checkpoint."""
        path = str(self.root / f"{mode}-{plan}.ckpt")
        self(mode, plan, "--save", path)
        return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("sharded"))


def _grid(runs: Runs, mode: str, plan: str) -> list[dict[str, Any]]:
    runs.checkpoint(mode, plan)
    return runs(mode, plan, "--save", str(runs.root / f"{mode}-{plan}.ckpt"))


def _same_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for name, value in a.items():
        assert torch.equal(value, b[name]), f"{what}: {name} differs"


GRID = [(mode, plan) for mode in MODES for plan in PLANS] + [("fsdp1_wrap", "bf16")]  # auto-wrapped, no AC


@pytest.mark.parametrize(("mode", "plan"), GRID)
def test_a_sharded_run_equals_the_one_process_reference(runs: Runs, mode: str, plan: str) -> None:
    ref = runs("reference", plan)[0]
    low = "torch.bfloat16" if plan == "bf16" else "torch.float16"
    for info in _grid(runs, mode, plan):
        assert info["steps"] == ref["steps"] == STEPS
        assert info["plugin"] == ("CoMPFSDPPrecision" if mode.startswith("fsdp1") else "CoMPPrecision")
        assert info["plan"] == {"type:Linear": plan, "type:ReLU": plan}
        assert info["precisions"] == {"net.0": plan, "net.1": plan, "net.2": plan, "net.3": "fp32", "net.4": plan}
        assert info["matmuls"] == [[low]] * STEPS  # every matmul of every step, forward and backward
        assert info["param_dtypes"] == ["torch.float32"]  # fp32 masters
        scaler = None if plan == "bf16" else "ShardedGradScaler" if mode.startswith("fsdp1") else "GradScaler"
        assert info["scaler"] == scaler
        assert info["skipped"] == ref["skipped"]
        if mode.startswith("fsdp2"):  # back to their DTensor shards between steps (the post-hooks run first)
            assert info["sharded_between_steps"] == info["sharded_before_backward"] == [["DTensor"]] * STEPS
            # the plan's policies all-gather the lowered units in 16 bits: given to fully_shard (fsdp2_policy) or put
            # on the units by the plugin (fsdp2, sharded with no policy), the same
            linear_bytes = 2
            assert info["gathered_bytes"] == [2 * LINEAR_ELEMENTS * linear_bytes + BODY_ELEMENTS * 4] * STEPS
        _same_parameters(info["params"], ref["params"], f"{mode}/{plan} against the reference")


@pytest.mark.parametrize("mode", ["fsdp1_wrap_ac", "fsdp2"])
def test_a_sharded_checkpoint_resumes_bit_for_bit_with_its_plan(runs: Runs, mode: str) -> None:
    uninterrupted = _grid(runs, mode, "fp16")
    resumed = runs(mode, "fp16", "--resume", runs.checkpoint(mode, "fp16"), "--no-plan")
    for before, after in zip(uninterrupted, resumed, strict=True):
        assert after["plan"] == before["plan"]  # from the checkpoint: this run's plugin was given none
        assert after["global_step"] == STEPS and after["skipped"] == before["skipped"]  # the scaler's state too
        _same_parameters(after["params"], before["params"], f"{mode}: resumed against uninterrupted")


@pytest.mark.parametrize("mode", ["fsdp1_wrap_ac", "fsdp2"])
def test_a_ddp_checkpoint_resumes_under_fsdp_with_its_plan(runs: Runs, mode: str) -> None:
    """The plan's checkpoint key is the same for every plugin class; its fingerprint ignores FSDP2's FSDP<Class>."""
    uninterrupted = _grid(runs, "ddp", "bf16")
    resumed = runs(mode, "bf16", "--resume", runs.checkpoint("ddp", "bf16"), "--no-plan")
    for after in resumed:
        assert after["plugin"] == ("CoMPFSDPPrecision" if mode.startswith("fsdp1") else "CoMPPrecision")
        assert after["plan"] == uninterrupted[0]["plan"]
        assert after["precisions"] == uninterrupted[0]["precisions"]
        _same_parameters(after["params"], uninterrupted[0]["params"], f"ddp -> {mode}")


@pytest.mark.parametrize("mode", ["fsdp1_wrap_ac", "fsdp2"])
def test_an_overflow_in_one_ranks_gradient_shard_skips_the_step_on_every_rank(runs: Runs, mode: str) -> None:
    """Rank 1's gradient shard gets an inf after backward at step 3, a step the reference takes: only a scaler that
    checks every rank's shard (ShardedGradScaler under FSDP1; FSDP2's DTensor gradients) notices it everywhere."""
    reference = runs("reference", "fp16")[0]
    assert reference["changed"][3]
    infos = runs(mode, "fp16", "--overflow-step", "3")
    for info in infos:
        assert info["changed"][3] is False, f"{mode}: a rank took the step another rank's overflow skipped"
        assert info["skipped"] == reference["skipped"] + 1
    _same_parameters(infos[0]["params"], infos[1]["params"], f"{mode}: the ranks")


@pytest.mark.parametrize("strategy", ["fsdp2"])  # (its FSDP1 path is the grid's fsdp1_wrap_ac)
def test_the_sharded_example_runs_as_the_readme_says(tmp_path: Path, strategy: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "sharded.py"), "--strategy", strategy, "--devices",
                           "2", "--steps", "4"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{strategy}: 11 operators lowered" in proc.stdout and "val_loss" in proc.stdout


def test_saved_tensors_are_stored_at_their_planned_precision_under_fsdp2(runs: Runs) -> None:
    """The saved-tensor engine tells an FSDP2 module's DTensor parameters apart by their local shards."""
    ref = runs("reference", "bf16", "--saved", "bf16", "--epochs", "1")[0]
    for info in runs("fsdp2", "bf16", "--saved", "bf16", "--epochs", "1"):
        assert info["saved"] == {"type:Linear": "bf16"}
        _same_parameters(info["params"], ref["params"], "fsdp2 saving bf16 against the reference")
