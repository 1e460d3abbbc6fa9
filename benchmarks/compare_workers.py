"""The worker processes of ``benchmarks/compare.py`` and the coordinator that drives them.

Every search and every training mode runs in a fresh process of its own (``mp_context``: ``forkserver`` with torch and
Lightning preloaded, else ``spawn``), so each keeps its own memory peak. The process target is a function of this
module (the child imports it by name, with ``benchmarks/`` on ``sys.path`` as in the parent); it reports over a pipe:
``("ready", ...)``, ``("yield", None)`` after each turn, then ``("done", result)`` or ``("error", traceback)``.
``run_search`` runs one ``CoMPSearch`` (with a CoMP mode's ``objective``); ``run_interleaved`` starts one process per
mode, each searched CoMP mode with the plan of its own search, each fixed-plan mode (``Mode.fixed_plan``) with its
fixed plan, and hands out turns round-robin.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
import multiprocessing as mp
import os
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from compare_probes import _device_of, _make_baton_callback, _max_rss_bytes
from compare_suite import MODES, ModelSpec
from harness import rotated


def _quiet() -> None:
    """Silence warnings and Lightning's info lines in a worker (call after importing lightning: it sets INFO)."""
    import lightning.pytorch  # noqa: F401

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_comp"):
        logging.getLogger(name).setLevel(logging.ERROR)


def mp_context() -> Any:
    """``forkserver`` with torch and Lightning preloaded (each worker starts in ~0.1 s instead of several seconds of
    imports, and is still a fresh process whose memory is its own); ``spawn`` where there is no forkserver."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # profiler notes about blocks allocated before it started
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "lightning.pytorch", "torchmetrics", "lightning_comp",
                                    "lightning_comp.zoo", "omegaconf"])
        return ctx
    return mp.get_context("spawn")


def _build(spec: dict[str, Any], seed: int, compile_model: bool = False) -> tuple[Any, Any]:
    """The model and data of ``spec``; with ``compile_model`` the model's ``forward`` is compiled (Inductor).

    The zoo models log in ``training_step``, which Lightning 2.6 cannot compile with PyTorch 2.12/2.13
    (Lightning-AI/pytorch-lightning#21836), so ``forward`` is compiled rather than the whole LightningModule.
    """
    import lightning.pytorch as pl
    import torch

    from lightning_comp import zoo

    pl.seed_everything(seed, workers=True, verbose=False)
    datamodule = getattr(zoo, spec["data"])(**spec["data_kwargs"])
    datamodule.setup("fit")
    pl.seed_everything(seed, workers=True, verbose=False)
    model = getattr(zoo, spec["model"])(**spec["model_kwargs"])
    if compile_model:
        model.forward = torch.compile(model.forward)
    return model, datamodule


def _dynamo_stats() -> dict[str, Any]:
    """What TorchDynamo did in this process: graphs compiled, graph breaks and their reasons (first line each)."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {"unique_graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": int(sum(breaks.values())),
            "break_reasons": {reason.splitlines()[0][:160]: int(n) for reason, n in breaks.items()}}


def _data_sizes(spec: dict[str, Any], datamodule: Any) -> dict[str, int]:
    batch = int(spec["data_kwargs"]["batch_size"])
    n_train, n_val = len(datamodule.train_set), len(datamodule.val_set)
    return {"train_examples": n_train, "val_examples": n_val, "batch_size": batch,
            "train_batches_per_epoch": n_train // batch, "val_batches_per_epoch": math.ceil(n_val / batch)}


def _trainer_common() -> dict[str, Any]:
    return dict(accelerator="auto", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, gradient_clip_val=1.0, deterministic=False)


def _exit_with_parent() -> None:
    """End this worker if the coordinator dies (a worker inside ``trainer.fit`` reads no pipe for minutes)."""
    import threading

    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _set_threads(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(int(threads))


_WorkerBody = Callable[[Any, dict[str, Any]], dict[str, Any]]


def _reports_to_coordinator(body: _WorkerBody) -> Callable[[Any, dict[str, Any]], None]:
    """A worker process's entry point: exit with the parent, quiet the logs, set the threads, run ``body`` and send
    its result as ``("done", result)``, or any failure as ``("error", traceback)``, then close the pipe."""

    @functools.wraps(body)
    def worker(conn: Any, job: dict[str, Any]) -> None:
        try:
            _exit_with_parent()
            _quiet()
            _set_threads(job.get("threads"))
            conn.send(("done", body(conn, job)))
        except BaseException:  # noqa: BLE001 - report every failure to the coordinator
            with contextlib.suppress(Exception):
                conn.send(("error", traceback.format_exc()))
        finally:
            conn.close()

    return worker


@_reports_to_coordinator
def train_worker(conn: Any, job: dict[str, Any]) -> dict[str, Any]:
    """One mode of one model: wait for turns, train, report (runs in a fresh process).

    A CoMP mode (``trainer_precision`` None) trains ``CoMPPrecision(job["plan"])``: the plan its own search chose; a
    fixed-plan mode trains ``CoMPPrecision(PrecisionPlan.from_dict(mode.fixed_plan))``, no search.
    """
    import lightning.pytorch as pl
    import torch

    from lightning_comp import CoMPPrecision, PrecisionPlan

    spec = job["spec"]
    mode = MODES[job["mode"]]
    model, datamodule = _build(spec, job["seed"], bool(job.get("compile")))
    sizes = _data_sizes(spec, datamodule)
    kwargs = _trainer_common()
    if mode.fixed_plan is not None:
        kwargs["plugins"] = [CoMPPrecision(plan=PrecisionPlan.from_dict(mode.fixed_plan))]
    elif mode.trainer_precision is None:
        kwargs["plugins"] = [CoMPPrecision(plan=job["plan"])]
    else:
        kwargs["precision"] = mode.trainer_precision
    probe_step = min(1, spec["steps"] - 1)
    profile_step = min(2, spec["steps"] - 1) if job.get("profile", True) else None
    if profile_step == probe_step:
        profile_step = None
    # the step after the probes, warm (it reads RSS per operator, so it is a special step: never timed)
    process_step: int | None = max(probe_step, profile_step or 0) + 1
    if process_step is not None and process_step >= spec["steps"]:
        process_step = None
    baton = _make_baton_callback(conn, spec, probe_step, profile_step, process_step)
    trainer = pl.Trainer(max_steps=spec["steps"], val_check_interval=spec["val_every"],
                         check_val_every_n_epoch=None, limit_val_batches=spec["val_batches"],
                         callbacks=[baton], **kwargs)
    started = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    fit_seconds = time.perf_counter() - started
    assert baton.memory is not None
    last = baton.memory.peak()  # since the steady-state reset (round 1) where it worked, else since the baseline
    peak = max(last, baton.warmup_peak or 0)
    plugin: Any = trainer.precision_plugin  # CoMPPrecision in the CoMP modes (its plan and executor are read below)
    result = {
        "mode": mode.key,
        "device": _device_of(model),
        "torch_threads": torch.get_num_threads(),
        "trainer_precision": str(trainer.precision),
        "plugin": type(plugin).__name__,
        "sizes": sizes,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "param_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "batches": baton.batches,
        "validation": baton.vals,
        "memory": {"method": baton.memory.method, "baseline_bytes": baton.memory.baseline, "peak_bytes": peak,
                   "increment_bytes": peak - baton.memory.baseline,
                   "warmup_peak_bytes": baton.warmup_peak,
                   "steady_peak_bytes": last if baton.steady_reset_ok else None,
                   "steady_increment_bytes": last - baton.memory.baseline if baton.steady_reset_ok else None,
                   "max_rss_bytes": _max_rss_bytes(),
                   "step_peak": baton.step_peak, "process_peak": baton.process_peak},
        "saved_for_backward": None if baton.saved is None else baton.saved.to_dict(),
        "profile": baton.profile,
        "forward_hooks": baton.hooks,
        "fit_seconds": fit_seconds,
        "global_step": int(trainer.global_step),
        "dynamo": _dynamo_stats() if job.get("compile") else None,
    }
    if mode.trainer_precision is None:
        result["plan_lowered"] = [s for s, p in plugin.plan["compute"].entries if p.value != "fp32"]
        result["plan_saved"] = {s: p.value for s, p in plugin.plan["saved"].entries if p.value != "fp32"}
        result["hooked_operators"] = len(plugin.executor._operators)  # noqa: SLF001 - diagnostics only
    return result


def _search_kwargs(overrides: dict[str, Any], record_dir: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    import lightning_comp

    comp_yaml = Path(lightning_comp.__file__).resolve().parent / "conf" / "precision" / "comp.yaml"
    node = OmegaConf.to_container(OmegaConf.load(comp_yaml).callbacks.comp_search, resolve=True)
    assert isinstance(node, dict)
    node.pop("_target_", None)
    node.update(overrides)
    node["record_dir"] = record_dir
    node["verbose"] = False
    return {str(k): v for k, v in node.items()}


@_reports_to_coordinator
def search_worker(conn: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Run CoMPSearch on short epochs and report the chosen plan and the search's cost (fresh process).

    The search settings are those of the shipped ``comp.yaml``, then the spec's ``search_overrides``, then the job's
    ``objective`` (where given).
    """
    import lightning.pytorch as pl

    from lightning_comp import CoMPPrecision, CoMPSearch
    from lightning_comp.zoo import EpochTimer

    spec = job["spec"]
    model, datamodule = _build(spec, job["seed"], bool(job.get("compile")))
    sizes = _data_sizes(spec, datamodule)
    full = int(spec["search_batches"]) <= 0
    train_batches = sizes["train_batches_per_epoch"] if full else min(int(spec["search_batches"]),
                                                                       sizes["train_batches_per_epoch"])
    # Validation shortened in the same proportion as training, so that trial times scale to full epochs.
    val_batches = sizes["val_batches_per_epoch"] if full else max(
        1, round(train_batches * sizes["val_batches_per_epoch"] / sizes["train_batches_per_epoch"]))
    overrides = dict(spec.get("search_overrides") or {})
    if job.get("objective"):
        overrides["objective"] = job["objective"]
    kwargs = _search_kwargs(overrides, job["record_dir"])
    search = CoMPSearch(**kwargs)
    timer = EpochTimer()
    user_epochs = max(int(spec.get("search_epochs") or 0),
                      int(kwargs.get("warmup_epochs", 1)) + int(kwargs.get("trial_epochs", 1)))
    trainer = pl.Trainer(plugins=[CoMPPrecision()], callbacks=[search, timer], max_epochs=user_epochs,
                         limit_train_batches=1.0 if full else train_batches,
                         limit_val_batches=1.0 if full else val_batches,
                         check_val_every_n_epoch=1, **_trainer_common())
    started = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    fit_seconds = time.perf_counter() - started
    record = search.record
    return {
        "search_kwargs": kwargs,
        "sizes": sizes,
        "search_train_batches": train_batches,
        "search_val_batches": val_batches,
        "fit_seconds": fit_seconds,
        "epochs_run": int(trainer.current_epoch),
        "epoch_times": timer.epochs,
        "record": record,
        "plan": None if search.chosen_plan is None else search.chosen_plan.to_dict(),
        "final_metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", None)
                          and v.numel() == 1},
        "dynamo": _dynamo_stats() if job.get("compile") else None,
    }


# ------------------------------------------------------------------------------------------------- coordinator
def _recv(conn: Any, process: Any, timeout: float, what: str) -> tuple[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        if conn.poll(0.5):
            try:
                return conn.recv()
            except EOFError:
                return ("error", f"{what}: worker closed the pipe (exit code {process.exitcode})")
        if not process.is_alive() and not conn.poll(0.1):
            return ("error", f"{what}: worker died with exit code {process.exitcode}")
        if time.monotonic() > deadline:
            return ("error", f"{what}: no answer within {timeout:.0f} s")


def run_search(ctx: Any, spec: ModelSpec, args: argparse.Namespace, record_dir: Path,
               objective: str | None = None) -> dict[str, Any]:
    """Run ``CoMPSearch`` on ``spec``'s model in a fresh process (``search_worker``).

    Args:
        ctx: The multiprocessing context (``mp_context()``).
        spec: The model.
        args: The command-line options (``seed``, ``threads``, ``timeout``).
        record_dir: Where the search writes its record and plan.
        objective: The search's ``objective`` (``None``: that of ``comp.yaml``).

    Returns:
        The worker's result plus ``wall_seconds``, or ``{"error": ..., "wall_seconds": ...}``.
    """
    parent, child = ctx.Pipe()
    job = {"spec": asdict(spec), "seed": args.seed, "threads": args.threads, "record_dir": str(record_dir),
           "objective": objective, "compile": getattr(args, "compile", False)}
    name = f"search-{spec.key}" + (f"-{objective}" if objective else "")
    process = ctx.Process(target=search_worker, args=(child, job), name=name)
    started = time.perf_counter()
    process.start()
    child.close()
    what = f"search {spec.key}" + (f" ({objective})" if objective else "")
    kind, payload = _recv(parent, process, args.timeout, what)
    process.join(30)
    if kind != "done":
        return {"error": payload, "wall_seconds": time.perf_counter() - started}
    payload["wall_seconds"] = time.perf_counter() - started
    return payload


def run_interleaved(ctx: Any, spec: ModelSpec, modes: list[str], plans: dict[str, Any],
                    args: argparse.Namespace) -> tuple[dict[str, Any], list[list[str]]]:
    """Start one process per mode, wait until all are set up, then hand out turns round-robin.

    Args:
        ctx: The multiprocessing context (``mp_context()``).
        spec: The model.
        modes: The modes to train, in their first round's order.
        plans: The plan (``PrecisionPlan.to_dict()``) of each searched CoMP mode in ``modes``, by mode (a fixed-plan
            mode brings its own: ``Mode.fixed_plan``).
        args: The command-line options (``seed``, ``threads``, ``timeout``, ``no_profile``).

    Returns:
        Each mode's result (or ``{"error": ...}``) and the order of every round.
    """
    missing = [m for m in modes if MODES[m].trainer_precision is None and MODES[m].fixed_plan is None
               and m not in plans]
    if missing:
        raise ValueError(f"run_interleaved: no plan for the CoMP mode(s) {missing}")
    workers: dict[str, tuple[Any, Any]] = {}
    results: dict[str, Any] = {}
    for mode in modes:
        parent, child = ctx.Pipe()
        job = {"spec": asdict(spec), "mode": mode, "seed": args.seed, "threads": args.threads,
               "plan": plans.get(mode, MODES[mode].fixed_plan), "profile": not args.no_profile,
               "compile": getattr(args, "compile", False)}
        process = ctx.Process(target=train_worker, args=(child, job), name=f"{spec.key}-{mode}")
        process.start()
        child.close()
        workers[mode] = (parent, process)
    active = []
    for mode, (conn, process) in workers.items():
        kind, payload = _recv(conn, process, args.timeout, f"{spec.key}/{mode} setup")
        if kind == "ready":
            active.append(mode)
            results[mode] = {"baseline_bytes": payload["baseline_bytes"]}
        else:
            results[mode] = {"error": payload}
    orders: list[list[str]] = []
    round_index = 0
    while active:
        order = rotated(active, round_index)
        orders.append(order)
        for mode in order:
            conn, process = workers[mode]
            try:
                conn.send(("go", round_index))
            except (BrokenPipeError, OSError) as err:
                results[mode] = {"error": f"send failed: {err}"}
                active.remove(mode)
                continue
            kind, payload = _recv(conn, process, args.timeout, f"{spec.key}/{mode} round {round_index}")
            if kind == "yield":
                continue
            active.remove(mode)
            results[mode] = payload if kind == "done" else {"error": payload}
        round_index += 1
    for conn, process in workers.values():
        with contextlib.suppress(Exception):
            conn.send(("stop", None))
        process.join(30)
        if process.is_alive():
            process.terminate()
            process.join(5)
    return results, orders
