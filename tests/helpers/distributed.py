"""What the 2-process test scripts share: every parameter in full on every rank, and the gloo group released; and
how a test starts such a script's ranks (:func:`launch_ranks`)."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_comp.operators.discovery import operator_name
from tests.helpers.warm_launch import DIST_VARS, WarmProcess, can_start_warm, start_warm

__all__ = ["DIST_VARS", "ReleaseProcessGroup", "full_parameters", "launch_ranks"]



def launch_ranks(argv: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: float,
                 ranks: int = 2, warm: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a script whose Trainer asks for ``ranks`` devices) as ``ranks`` processes started at once, as
    ``torchrun`` starts them (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` set: Lightning launches
    nothing itself), rather than letting Lightning's launcher start rank 1 once rank 0 reaches ``fit``: each process
    imports torch, Lightning and the package for 5-7 s on 2 loaded cores, and started together they import side by
    side instead of one after the other. A rank that fails stops the others (they would wait for it in the process
    group until its timeout), as Lightning's launcher does.

    With ``warm`` (the default) and ``argv`` this interpreter running a script or code, each rank is forked from a
    server that imported torch, Lightning and the package once (:mod:`tests.helpers.warm_launch`; one server per rank,
    so ranks keep distinct string-hash seeds): a rank then costs its own work, not 10 s of imports.

    Returns:
        One result: the first failing rank's exit status (0 when every rank succeeded), every rank's output.

    Raises:
        subprocess.TimeoutExpired: a rank still ran after ``timeout`` seconds (every rank is killed).
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    deadline = time.monotonic() + timeout
    clean = {k: v for k, v in env.items() if k not in DIST_VARS and not k.startswith(("TORCHELASTIC", "PL_"))}
    envs = [{**clean, "LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)} for rank in range(ranks)]
    with tempfile.TemporaryDirectory() as folder:
        logs = [(Path(folder) / f"rank{rank}.out", Path(folder) / f"rank{rank}.err") for rank in range(ranks)]
        procs: list[subprocess.Popen[bytes] | WarmProcess]
        if warm and can_start_warm(argv):
            procs = list(start_warm(argv, cwd, envs, logs))
        else:
            with ExitStack() as stack:
                procs = [subprocess.Popen(list(argv), cwd=cwd, env=rank_env, stdout=stack.enter_context(out.open("wb")),
                                          stderr=stack.enter_context(err.open("wb")))
                         for rank_env, (out, err) in zip(envs, logs, strict=True)]
        timed_out, failed = False, None  # failed: the first rank seen exiting non-zero (before the others are killed)
        try:
            while [proc.poll() for proc in procs].count(None):  # every rank polled (any() would stop at the first)
                failed = next((proc.returncode for proc in procs if proc.returncode not in (None, 0)), None)
                if failed is not None:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        texts = [(out.read_text(errors="replace"), err.read_text(errors="replace")) for out, err in logs]
    stdout = "".join(f"--- rank {r} ---\n{o}" for r, (o, _) in enumerate(texts))
    stderr = "".join(f"--- rank {r} ---\n{e}" for r, (_, e) in enumerate(texts))
    if timed_out:
        raise subprocess.TimeoutExpired(list(argv), timeout, stdout, stderr)
    if failed is None:  # every rank ended by itself
        failed = next((proc.returncode for proc in procs if proc.returncode != 0), 0)
    return subprocess.CompletedProcess(list(argv), failed, stdout, stderr)


def full_parameters(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """Every parameter in full, named as the plan names modules (all ranks must call this: it gathers)."""
    from torch.distributed.tensor import DTensor

    model = trainer.strategy.model
    if type(model).__name__ == "FullyShardedDataParallel":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return {operator_name(n): p.detach().clone() for n, p in pl_module.named_parameters()}
    return {operator_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in pl_module.named_parameters()}


class ReleaseProcessGroup(pl.Callback):
    """Destroy the gloo group at the end of the fit, in every rank's process (a gloo group left to interpreter
    shutdown can abort a finished rank)."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
