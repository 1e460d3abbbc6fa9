"""CoMP against FP32, AMP (``bf16-mixed``), pure BF16 (``bf16-true``) and, where fast, ``16-mixed``: side by side.

One run of this script trains every model of a suite under every precision mode and writes a Markdown table, a JSON
record (plus the raw measurements), a CSV and PNG plots. Reproduce ``docs/benchmark.md`` with::

    python benchmarks/compare.py                   # full suite: ~7 min on 2 quiet CPU cores, ~10-15 with noise
    python benchmarks/compare.py --models cnn,gpt  # a subset
    python benchmarks/compare.py --smoke           # tiny models, a few steps (what tests/test_benchmark_smoke.py runs)
    python benchmarks/compare.py --reanalyse benchmarks/results/compare_raw.json   # re-render without measuring

How each number is measured (per model):

1. **CoMP search.** A fresh process trains the model with ``CoMPPrecision()`` + ``CoMPSearch``, using the search
   settings of the shipped default example (``lightning_comp/conf/precision/comp.yaml``). The default example's model
   (``gpt``) searches on full epochs; the others on epochs shortened to ``search_batches`` batches (validation
   shortened in the same proportion), and their cost is scaled to full epochs. The share of a 20-epoch run divides
   the search cost by 20 full epochs at the chosen plan's measured step time (a real 20-epoch run per model does not
   fit the time budget).
2. **Interleaved training.** One fresh process per mode (``32-true``, ``bf16-mixed``, ``bf16-true``, ``16-mixed`` if
   the device has fast FP16, and ``CoMPPrecision(plan=<chosen>)``), all from the same seed, initial weights and
   batches. A coordinator hands a baton to one process at a time, which trains ``segment`` optimizer steps and hands
   it back; the order rotates every round, so all modes see the same machine conditions while each keeps a process
   (and a memory peak) of its own. Round 0 is warm-up. Each batch is timed from ``on_train_batch_start`` to
   ``on_train_batch_end`` (forward, backward, clipping, optimizer step; synchronised on CUDA). Throughput = batch
   size / median batch time of a round; summary = median over rounds (spread: min-max); ratios between modes are
   medians of per-round ratios.
3. **Memory.** The peak tensor memory of one steady training step: parameters, gradients and optimizer state at the
   step's start plus the peak of live tensors during the step from ``torch.profiler`` memory events (on CUDA,
   ``torch.cuda.max_memory_allocated``). Bytes saved for backward over one step come from
   ``torch.autograd.graph.saved_tensors_hooks`` (unique storages; parameters, saved by reference, counted apart).
   The process's peak RSS (Linux ``VmHWM``) and its rise over the pre-training RSS are recorded too: they include
   allocator retention and vary from run to run, so the target is judged on the tensor metric.
4. **Convergence.** All modes train the same number of optimizer steps and validate on the same batches every
   ``val_every`` steps; the final validation loss is compared with FP32 under the search's tolerance.

One step per mode (in the warm-up round) also runs under ``torch.profiler`` to attribute time to casts
(``aten::_to_copy``/``aten::copy_``). ``benchmarks/compare_diagnose.py`` digs further into a miss.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import gc
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
IMG_DIR = ROOT / "docs" / "img"

# Targets of the issue (ratios measured in one run).
TARGET_GEOMEAN_VS_AMP = 1.15
TARGET_PER_MODEL_VS_AMP = 1.0
TARGET_PER_MODEL_VS_FP32 = 1.0
TARGET_VS_BF16_TRUE = 0.95
TARGET_MEMORY_VS_AMP = 0.8
MEMORY_TARGET_MODELS = ("cnn", "gpt")
TARGET_SEARCH_SHARE = 0.10
REFERENCE_EPOCHS = 20


# ------------------------------------------------------------------------------------------------------ the suite
@dataclass(frozen=True)
class ModelSpec:
    """One model of the suite, its data and its run lengths."""

    key: str
    title: str
    model: str  # class name in lightning_comp.zoo
    model_kwargs: dict[str, Any]
    data: str  # class name in lightning_comp.zoo
    data_kwargs: dict[str, Any]
    steps: int  # optimizer steps per mode in the interleaved run
    segment: int  # steps per turn
    val_every: int  # validate every this many steps (and at the end)
    val_batches: int  # validation batches per validation
    search_batches: int  # training batches per epoch in the search run (0: full epochs, nothing extrapolated)
    default_example: bool = False  # the model/data of ``python examples/train.py`` (the search-cost target)
    search_epochs: int = 0  # max_epochs of the search run (0: just warm-up + one trial); 20 = a real 20-epoch run
    search_overrides: dict[str, Any] = field(default_factory=dict)


def _default_example() -> dict[str, dict[str, Any]]:
    """Model and data keyword arguments of the default example, read from the shipped Hydra config tree."""
    from omegaconf import OmegaConf

    import lightning_comp

    conf = Path(lightning_comp.__file__).resolve().parent / "conf"
    cfg = OmegaConf.create({"model": OmegaConf.load(conf / "model" / "char_gpt.yaml"),
                            "data": OmegaConf.load(conf / "data" / "text.yaml")})
    out = {}
    for group in ("model", "data"):
        node = OmegaConf.to_container(cfg[group], resolve=True)
        assert isinstance(node, dict)
        out[group] = {k: v for k, v in node.items() if not k.startswith("_")}
    return out


_DEFAULT_EXAMPLE = _default_example()

SUITE: dict[str, ModelSpec] = {
    "cnn": ModelSpec(
        key="cnn", title="ConvNetBN (CNN + BatchNorm, 32-64-128 ch) on Shapes10 32x32, batch 128",
        model="ConvNetBN", model_kwargs={"width": 32, "depth": 3},
        data="ShapesDataModule", data_kwargs={"num_samples": 10000, "batch_size": 128},
        steps=60, segment=5, val_every=20, val_batches=4, search_batches=10,
    ),
    "gpt": ModelSpec(
        key="gpt", title="CharGPT on pydoc text bytes: the default example (python examples/train.py), model and data"
        " as configured in lightning_comp/conf/{model/char_gpt,data/text}.yaml",
        model="CharGPT", model_kwargs=_DEFAULT_EXAMPLE["model"],
        data="CharTextDataModule", data_kwargs=_DEFAULT_EXAMPLE["data"],
        steps=60, segment=5, val_every=15, val_batches=3, search_batches=0, default_example=True, search_epochs=20,
    ),
    "lstm": ModelSpec(
        key="lstm", title="CharLSTM (2-layer LSTM LM, h256, T128) on pydoc text, batch 32",
        model="CharLSTM", model_kwargs={"width": 256, "depth": 2},
        data="CharTextDataModule", data_kwargs={"seq_len": 128, "batch_size": 32},
        steps=64, segment=4, val_every=16, val_batches=3, search_batches=8,
    ),
    "mlp": ModelSpec(
        key="mlp", title="NarrowMLP (8 x Linear width 32: small operators) on MNIST-1D, batch 64",
        model="NarrowMLP", model_kwargs={"width": 32, "depth": 8},
        data="MNIST1DDataModule", data_kwargs={"num_samples": 4000, "batch_size": 64},
        steps=1000, segment=50, val_every=250, val_batches=8, search_batches=40,
    ),
    # Not in the default suite (``--models all`` or by name):
    "cnn1d": ModelSpec(
        key="cnn1d", title="Conv1DClassifier on MNIST-1D",
        model="Conv1DClassifier", model_kwargs={"width": 64, "depth": 3},
        data="MNIST1DDataModule", data_kwargs={"num_samples": 4000, "batch_size": 64},
        steps=1000, segment=50, val_every=250, val_batches=8, search_batches=40,
    ),
    "gru": ModelSpec(
        key="gru", title="GRUClassifier (2-layer GRU, h128) on MNIST-1D",
        model="GRUClassifier", model_kwargs={"width": 128, "depth": 2},
        data="MNIST1DDataModule", data_kwargs={"num_samples": 4000, "batch_size": 64},
        steps=80, segment=10, val_every=20, val_batches=4, search_batches=20,
    ),
}
DEFAULT_MODELS = ("cnn", "gpt", "lstm", "mlp")

_SMOKE_SIZES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "cnn": ({"width": 8, "depth": 2}, {"num_samples": 400, "batch_size": 16, "image_size": 16}),
    "gpt": ({"width": 32, "depth": 1, "heads": 2, "block_size": 32}, {"seq_len": 32, "num_samples": 200,
                                                                       "batch_size": 8}),
    "lstm": ({"width": 32, "depth": 2}, {"seq_len": 32, "num_samples": 200, "batch_size": 8}),
    "mlp": ({"width": 16, "depth": 3}, {"num_samples": 400, "batch_size": 16}),
    "cnn1d": ({"width": 8, "depth": 2}, {"num_samples": 400, "batch_size": 16}),
    "gru": ({"width": 16, "depth": 1}, {"num_samples": 400, "batch_size": 16}),
}
_SMOKE_SEARCH = {"profile_steps": 1, "profile_warmup": 0, "max_trials": 2}


def smoke_spec(spec: ModelSpec) -> ModelSpec:
    """The seconds-scale version of a suite entry (same model and data classes)."""
    model_kwargs, data_kwargs = _SMOKE_SIZES[spec.key]
    return replace(spec, model_kwargs={**spec.model_kwargs, **model_kwargs},
                   data_kwargs={**spec.data_kwargs, **data_kwargs}, steps=4, segment=2, val_every=2, val_batches=1,
                   search_batches=3, search_epochs=0, search_overrides=dict(_SMOKE_SEARCH))


@dataclass(frozen=True)
class Mode:
    key: str
    label: str
    trainer_precision: str | None  # None: CoMPPrecision plugin


MODES: dict[str, Mode] = {
    "fp32": Mode("fp32", "FP32 (32-true)", "32-true"),
    "bf16-mixed": Mode("bf16-mixed", "AMP (bf16-mixed)", "bf16-mixed"),
    "bf16-true": Mode("bf16-true", "BF16 (bf16-true)", "bf16-true"),
    "16-mixed": Mode("16-mixed", "AMP FP16 (16-mixed)", "16-mixed"),
    "comp": Mode("comp", "CoMP (searched plan)", None),
}


# ------------------------------------------------------------------------------------------------------ workers
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


def _build(spec: dict[str, Any], seed: int) -> tuple[Any, Any]:
    import lightning.pytorch as pl

    from lightning_comp import zoo

    pl.seed_everything(seed, workers=True, verbose=False)
    datamodule = getattr(zoo, spec["data"])(**spec["data_kwargs"])
    datamodule.setup("fit")
    pl.seed_everything(seed, workers=True, verbose=False)
    model = getattr(zoo, spec["model"])(**spec["model_kwargs"])
    return model, datamodule


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


def _device_of(module: Any) -> str:
    for p in module.parameters():
        return p.device.type
    return "cpu"


class _Memory:
    """Peak memory of this process from a baseline on: VmHWM (Linux, reset via clear_refs) or CUDA allocator peak."""

    def __init__(self, device_type: str) -> None:
        self.cuda = device_type == "cuda"
        self.method = ""
        self.baseline = 0
        self._sampler: Any = None
        self._samples: list[int] = []

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    def can_reset(self) -> bool:
        return not self.cuda and self._sampler is None and self.method.startswith("VmHWM")

    def reset_peak(self) -> bool:
        """Restart the high-water mark (CPU: VmHWM) without moving the baseline; False where it cannot."""
        if self.cuda or self._sampler is not None:
            return False
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = int(torch.cuda.memory_allocated())
            self.method = "torch.cuda.max_memory_allocated"
            return
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.baseline = self._status("VmRSS")
            self.method = "VmHWM (reset via /proc/self/clear_refs)"
        except OSError:
            import psutil

            process = psutil.Process()
            self.baseline = int(process.memory_info().rss)
            self.method = "psutil RSS sampled every 5 ms"
            import threading

            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    self._samples.append(int(process.memory_info().rss))
                    stop.wait(0.005)

            thread = threading.Thread(target=sample, daemon=True)
            thread.start()
            self._sampler = (stop, thread)

    def peak(self) -> int:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated())
        if self._sampler is not None:
            stop, thread = self._sampler
            stop.set()
            thread.join()
            return max(self._samples, default=self.baseline)
        return self._status("VmHWM")


class _SavedBytes:
    """``saved_tensors_hooks`` pack hook that counts unique storages saved for backward."""

    def __init__(self, model: Any) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.activation_bytes = 0
        self.parameter_bytes = 0
        self.by_dtype: dict[str, int] = {}
        self.tensors = 0

    def pack(self, tensor: Any) -> Any:
        self.tensors += 1
        try:
            storage = tensor.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except Exception:  # noqa: BLE001 - tensor subclasses without storage
            return tensor
        if ptr in self.seen:
            return tensor
        self.seen.add(ptr)
        if ptr in self.params:
            self.parameter_bytes += nbytes
        else:
            self.activation_bytes += nbytes
            key = str(tensor.dtype).replace("torch.", "")
            self.by_dtype[key] = self.by_dtype.get(key, 0) + nbytes
        return tensor

    @staticmethod
    def unpack(tensor: Any) -> Any:
        return tensor

    def to_dict(self) -> dict[str, Any]:
        return {"activation_bytes": self.activation_bytes, "parameter_bytes": self.parameter_bytes,
                "by_dtype": self.by_dtype, "saved_tensors": self.tensors}


def _tensor_peak_delta(prof: Any, device: str) -> int | None:
    """Peak increase of live tensor bytes on ``device`` during a profiled region (profiler memory events)."""
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except Exception:  # noqa: BLE001 - profiler internals differ between versions
        return None
    want = "CUDA" if device == "cuda" else "CPU"
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        if want in str(event.device_type()):
            live += int(event.nbytes())
            peak = max(peak, live)
    return peak


def _static_bytes(model: Any, optimizers: list[Any]) -> dict[str, int]:
    """Bytes held between steps: parameters, their gradients (if any) and optimizer state tensors."""
    import torch

    seen: set[int] = set()

    def size(t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            return 0
        seen.add(ptr)
        return int(t.untyped_storage().nbytes())

    params = sum(size(p) for p in model.parameters())
    grads = sum(size(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(size(v) for opt in optimizers for st in opt.state.values() for v in st.values())
    return {"parameters": params, "gradients": grads, "optimizer_state": state, "total": params + grads + state}


def _profile_summary(prof: Any, steps_ms: float) -> dict[str, Any]:
    cast_names = {"aten::_to_copy", "aten::to", "aten::copy_", "aten::_autocast_to_reduced_precision",
                  "aten::_autocast_to_full_precision"}
    rows = []
    cast_self_us = 0.0
    cast_calls = 0
    for evt in prof.key_averages():
        self_us = float(getattr(evt, "self_cpu_time_total", 0.0)) + float(getattr(evt, "self_device_time_total", 0.0)
                                                                           or 0.0)
        rows.append((evt.key, self_us, int(evt.count)))
        if evt.key in ("aten::_to_copy", "aten::copy_"):
            cast_self_us += self_us
        if evt.key == "aten::_to_copy":
            cast_calls += int(evt.count)
    rows.sort(key=lambda r: -r[1])
    total_self = sum(r[1] for r in rows) or 1.0
    return {
        "profiled_step_ms": steps_ms,
        "cast_self_ms": cast_self_us / 1e3,
        "cast_share_of_op_time": cast_self_us / total_self,
        "to_copy_calls": cast_calls,
        "op_self_ms_total": total_self / 1e3,
        "top_ops": [{"op": k, "self_ms": round(v / 1e3, 3), "calls": c} for k, v, c in rows[:12]],
        "cast_ops_counted": sorted(cast_names & {r[0] for r in rows}),
    }


def _make_baton_callback(conn: Any, spec: dict[str, Any], probe_step: int, profile_step: int | None) -> Any:
    import torch
    from lightning.pytorch.callbacks import Callback

    class Baton(Callback):
        """Trains ``segment`` steps per turn; times batches; records validation, memory, saved bytes, a profile."""

        def __init__(self) -> None:
            self.segment = int(spec["segment"])
            self.batch_size = int(spec["data_kwargs"]["batch_size"])
            self.round = -1
            self.count = 0
            self.t0 = 0.0
            self.batches: list[dict[str, Any]] = []
            self.vals: list[dict[str, Any]] = []
            self.memory: _Memory | None = None
            self.saved: _SavedBytes | None = None
            self._saved_ctx: Any = None
            self._prof: Any = None
            self.profile: dict[str, Any] | None = None
            self.static: dict[str, int] = {}
            self.step_peak: dict[str, Any] | None = None
            self._steady_reset = False
            self.steady_reset_ok = False
            self.warmup_peak: int | None = None
            self.hooks = 0
            self.cuda = False

        def _sync(self) -> None:
            if self.cuda:
                torch.cuda.synchronize()

        def _wait(self) -> None:
            message = conn.recv()
            if message[0] != "go":
                raise SystemExit(0)
            self.round = int(message[1])
            self.count = 0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.cuda = _device_of(pl_module) == "cuda"
            self.hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in pl_module.modules())
            self.memory = _Memory("cuda" if self.cuda else "cpu")
            self.memory.start()
            conn.send(("ready", {"baseline_bytes": self.memory.baseline}))
            self._wait()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            step = trainer.global_step
            if step == probe_step:
                self.saved = _SavedBytes(pl_module)
                self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self.saved.pack, self.saved.unpack)
                self._saved_ctx.__enter__()
            if profile_step is not None and step == profile_step:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if self.cuda:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                self.static = _static_bytes(pl_module, trainer.optimizers)
                self._prof = torch.profiler.profile(activities=activities, profile_memory=True)
                self._prof.__enter__()
            if self.round >= 1 and not self._steady_reset and not self.cuda:
                self._steady_reset = True
                if self.memory is not None and self.memory.can_reset():
                    self.warmup_peak = self.memory.peak()
                    self.steady_reset_ok = self.memory.reset_peak()
            self._sync()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self._sync()
            ms = (time.perf_counter() - self.t0) * 1e3
            step = trainer.global_step - 1
            special = ""
            if self._saved_ctx is not None:
                self._saved_ctx.__exit__(None, None, None)
                self._saved_ctx = None
                special = "saved_bytes_probe"
            if self._prof is not None:
                self._prof.__exit__(None, None, None)
                self.profile = _profile_summary(self._prof, ms)
                delta = _tensor_peak_delta(self._prof, "cuda" if self.cuda else "cpu")
                if self.cuda:
                    peak = int(torch.cuda.max_memory_allocated())
                    method = "torch.cuda.max_memory_allocated over one steady step"
                else:
                    peak = None if delta is None else self.static["total"] + delta
                    method = "parameters + grads + optimizer state at step start + profiler peak of live tensors"
                self.step_peak = {"bytes": peak, "delta_bytes": delta, "static": self.static, "method": method,
                                  "step": step}
                self._prof = None
                special = "profiler"
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            loss_value = float(loss.detach().float()) if isinstance(loss, torch.Tensor) else None
            self.batches.append({"step": step, "round": self.round, "ms": ms, "special": special,
                                 "loss": loss_value})
            self.count += 1
            if self.count >= self.segment and trainer.global_step < trainer.max_steps:
                conn.send(("yield", None))
                self._wait()

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.sanity_checking:
                return
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                       if isinstance(v, torch.Tensor) and v.numel() == 1 and k.startswith("val_")}
            self.vals.append({"step": int(trainer.global_step), **metrics})

    return Baton()


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
    """One mode of one model: wait for turns, train, report (runs in a fresh process)."""
    import lightning.pytorch as pl
    import torch

    from lightning_comp import CoMPPrecision

    spec = job["spec"]
    mode = MODES[job["mode"]]
    model, datamodule = _build(spec, job["seed"])
    sizes = _data_sizes(spec, datamodule)
    kwargs = _trainer_common()
    if mode.trainer_precision is None:
        kwargs["plugins"] = [CoMPPrecision(plan=job["plan"])]
    else:
        kwargs["precision"] = mode.trainer_precision
    probe_step = min(1, spec["steps"] - 1)
    profile_step = min(2, spec["steps"] - 1) if job.get("profile", True) else None
    if profile_step == probe_step:
        profile_step = None
    baton = _make_baton_callback(conn, spec, probe_step, profile_step)
    trainer = pl.Trainer(max_steps=spec["steps"], val_check_interval=spec["val_every"],
                         check_val_every_n_epoch=None, limit_val_batches=spec["val_batches"],
                         callbacks=[baton], **kwargs)
    started = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    fit_seconds = time.perf_counter() - started
    assert baton.memory is not None
    last = baton.memory.peak()  # since the steady-state reset (round 1) where it worked, else since the baseline
    peak = max(last, baton.warmup_peak or 0)
    plugin = trainer.precision_plugin
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
                   "step_peak": baton.step_peak},
        "saved_for_backward": None if baton.saved is None else baton.saved.to_dict(),
        "profile": baton.profile,
        "forward_hooks": baton.hooks,
        "fit_seconds": fit_seconds,
        "global_step": int(trainer.global_step),
    }
    if mode.trainer_precision is None:
        result["plan_lowered"] = [s for s, p in plugin.plan.entries if p.value != "fp32"]
        result["hooked_operators"] = len(plugin.executor._operators)  # noqa: SLF001 - diagnostics only
    return result


def _max_rss_bytes() -> int:
    import resource

    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


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
    return node


@_reports_to_coordinator
def search_worker(conn: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Run CoMPSearch on short epochs and report the chosen plan and the search's cost (fresh process)."""
    import lightning.pytorch as pl

    from lightning_comp import CoMPPrecision, CoMPSearch
    from lightning_comp.zoo import EpochTimer

    spec = job["spec"]
    model, datamodule = _build(spec, job["seed"])
    sizes = _data_sizes(spec, datamodule)
    full = int(spec["search_batches"]) <= 0
    train_batches = sizes["train_batches_per_epoch"] if full else min(int(spec["search_batches"]),
                                                                       sizes["train_batches_per_epoch"])
    # Validation shortened in the same proportion as training, so that trial times scale to full epochs.
    val_batches = sizes["val_batches_per_epoch"] if full else max(
        1, round(train_batches * sizes["val_batches_per_epoch"] / sizes["train_batches_per_epoch"]))
    kwargs = _search_kwargs(spec.get("search_overrides") or {}, job["record_dir"])
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


def run_search(ctx: Any, spec: ModelSpec, args: argparse.Namespace, record_dir: Path) -> dict[str, Any]:
    parent, child = ctx.Pipe()
    job = {"spec": asdict(spec), "seed": args.seed, "threads": args.threads, "record_dir": str(record_dir)}
    process = ctx.Process(target=search_worker, args=(child, job), name=f"search-{spec.key}")
    started = time.perf_counter()
    process.start()
    child.close()
    kind, payload = _recv(parent, process, args.timeout, f"search {spec.key}")
    process.join(30)
    if kind != "done":
        return {"error": payload, "wall_seconds": time.perf_counter() - started}
    payload["wall_seconds"] = time.perf_counter() - started
    return payload


def run_interleaved(ctx: Any, spec: ModelSpec, modes: list[str], plan: Any,
                    args: argparse.Namespace) -> tuple[dict[str, Any], list[list[str]]]:
    """Start one process per mode, wait until all are set up, then hand out turns round-robin."""
    workers: dict[str, tuple[Any, Any]] = {}
    results: dict[str, Any] = {}
    for mode in modes:
        parent, child = ctx.Pipe()
        job = {"spec": asdict(spec), "mode": mode, "seed": args.seed, "threads": args.threads, "plan": plan,
               "profile": not args.no_profile}
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
        shift = round_index % len(active)
        order = active[shift:] + active[:shift]
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


# ---------------------------------------------------------------------------------------------------- analysis
def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def _geomean(values: list[float]) -> float:
    values = [v for v in values if v and math.isfinite(v) and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def throughput_stats(result: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """Per-round throughput (samples/s from the round's median batch time); round 0 is warm-up."""
    per_round: dict[int, list[float]] = {}
    steady: list[float] = []
    for b in result["batches"]:
        if b["round"] < 1 or b["special"]:
            continue
        per_round.setdefault(b["round"], []).append(b["ms"])
        steady.append(b["ms"])
    rounds = {r: batch_size / (_median(v) / 1e3) for r, v in sorted(per_round.items())}
    values = list(rounds.values())
    if not values:  # too few steps for a warm-up round: use everything but the special steps
        steady = [b["ms"] for b in result["batches"] if not b["special"]]
        values = [batch_size / (_median(steady) / 1e3)] if steady else []
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3 if values else [math.nan] * 3
    return {
        "samples_per_s": _median(values),
        "min": min(values) if values else math.nan,
        "max": max(values) if values else math.nan,
        "q1": q[0], "q3": q[2],
        "rounds": {str(k): v for k, v in rounds.items()},
        "pooled_samples_per_s": batch_size / (_median(steady) / 1e3) if steady else math.nan,
        "median_step_ms": _median(steady),
        "min_step_ms": min(steady) if steady else math.nan,
        "steady_batches": len(steady),
    }


def round_ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Median (and min/max) over rounds of the per-round throughput ratio a/b."""
    ra, rb = a["rounds"], b["rounds"]
    ratios = [ra[r] / rb[r] for r in ra if r in rb and rb[r] > 0]
    if not ratios:
        value = a["samples_per_s"] / b["samples_per_s"] if b["samples_per_s"] else math.nan
        return {"median": value, "min": value, "max": value, "rounds": 0}
    return {"median": _median(ratios), "min": min(ratios), "max": max(ratios), "rounds": len(ratios),
            "ratio_of_medians": a["samples_per_s"] / b["samples_per_s"]}


def _step_peak(entry: dict[str, Any]) -> float:
    """Peak tensor bytes of one steady training step (the memory target's metric), NaN if not measured."""
    peak = ((entry.get("memory") or {}).get("step_peak") or {}).get("bytes")
    return float(peak) if peak else math.nan


def _final_val(result: dict[str, Any]) -> dict[str, float]:
    return result["validation"][-1] if result.get("validation") else {}


def _within(value: float, reference: float, tolerance: float, mode: str, relative: bool = True) -> bool:
    if not (math.isfinite(value) and math.isfinite(reference)):
        return False
    slack = tolerance * (abs(reference) if relative else 1.0)
    return value <= reference + slack if mode == "min" else value >= reference - slack


def analyse_model(spec: ModelSpec, search: dict[str, Any], runs: dict[str, Any],
                  tolerance: float, tolerance_mode: str) -> dict[str, Any]:
    batch = int(spec.data_kwargs["batch_size"])
    from lightning_comp import zoo

    model_cls = getattr(zoo, spec.model)
    metric, metric_mode = model_cls.val_metric, model_cls.val_metric_mode
    out: dict[str, Any] = {"modes": {}, "metric": metric, "metric_mode": metric_mode}
    for mode, result in runs.items():
        if "error" in result:
            out["modes"][mode] = {"error": result["error"]}
            continue
        entry = {
            "throughput": throughput_stats(result, batch),
            "memory": result["memory"],
            "saved_for_backward": result["saved_for_backward"],
            "final_validation": _final_val(result),
            "validation": result["validation"],
            "profile": result.get("profile"),
            "forward_hooks": result.get("forward_hooks"),
            "param_dtype": result.get("param_dtype"),
            "device": result.get("device"),
            "torch_threads": result.get("torch_threads"),
            "steps": result.get("global_step"),
            "fit_seconds": result.get("fit_seconds"),
            "train_loss_last": next((b["loss"] for b in reversed(result["batches"]) if b["loss"] is not None), None),
        }
        for key in ("plan_lowered", "hooked_operators"):
            if key in result:
                entry[key] = result[key]
        out["modes"][mode] = entry
    modes = out["modes"]
    ok = {m for m, e in modes.items() if "error" not in e}
    fp32_loss = modes["fp32"]["final_validation"].get("val_loss", math.nan) if "fp32" in ok else math.nan
    for mode in ok:
        val = modes[mode]["final_validation"].get("val_loss", math.nan)
        modes[mode]["converges_like_fp32"] = _within(val, fp32_loss, tolerance, "min", tolerance_mode == "relative")
    ratios: dict[str, Any] = {}
    if "comp" in ok:
        comp = modes["comp"]
        for other in ("bf16-mixed", "fp32", "bf16-true", "16-mixed"):
            if other in ok:
                ratios[f"throughput_vs_{other}"] = round_ratio(comp["throughput"], modes[other]["throughput"])
                inc_o = modes[other]["memory"]["increment_bytes"]
                inc_c = comp["memory"]["increment_bytes"]
                ratios[f"memory_increment_vs_{other}"] = inc_c / inc_o if inc_o else math.nan
                step_o, step_c = _step_peak(modes[other]), _step_peak(comp)
                ratios[f"memory_step_peak_vs_{other}"] = step_c / step_o if step_o else math.nan
                peak_o = modes[other]["memory"]["peak_bytes"]
                ratios[f"memory_peak_vs_{other}"] = comp["memory"]["peak_bytes"] / peak_o if peak_o else math.nan
                so, sc = modes[other]["saved_for_backward"], comp["saved_for_backward"]
                if so and sc and so["activation_bytes"]:
                    ratios[f"saved_bytes_vs_{other}"] = sc["activation_bytes"] / so["activation_bytes"]
    if "bf16-mixed" in ok and "fp32" in ok:
        ratios["amp_vs_fp32"] = round_ratio(modes["bf16-mixed"]["throughput"], modes["fp32"]["throughput"])
    if "bf16-true" in ok and "fp32" in ok:
        ratios["bf16_true_vs_fp32"] = round_ratio(modes["bf16-true"]["throughput"], modes["fp32"]["throughput"])
    out["ratios"] = ratios
    out["search"] = search_summary(spec, search, modes)
    return out


def search_summary(spec: ModelSpec, search: dict[str, Any], modes: dict[str, Any]) -> dict[str, Any]:
    if "error" in search:
        return {"error": search["error"]}
    record = search.get("record") or {}
    cost = record.get("cost") or {}
    sizes = search["sizes"]
    scale = sizes["train_batches_per_epoch"] / max(1, search["search_train_batches"])
    profiling = float(cost.get("profiling_seconds") or 0.0)
    rejected_recorded = float(cost.get("rejected_trial_seconds") or 0.0)
    search_recorded = float(cost.get("search_seconds") or 0.0)
    # Since commit bb58650 the record counts the batch stage once (before, the reference trial's seconds contained
    # it and search_seconds = profiling + rejected counted it twice); older records are flagged here.
    trials_raw = record.get("trials", [])
    double_counted = bool(trials_raw and not trials_raw[0].get("kept") and profiling > 0
                          and (trials_raw[0].get("seconds") or 0.0) >= profiling
                          and search_recorded > float(search.get("fit_seconds") or math.inf))
    rejected = rejected_recorded
    search_seconds = search_recorded
    comp_ms = modes.get("comp", {}).get("throughput", {}).get("median_step_ms", math.nan)
    fp32_ms = modes.get("fp32", {}).get("throughput", {}).get("median_step_ms", math.nan)
    full_epoch_comp = sizes["train_batches_per_epoch"] * comp_ms / 1e3
    full_epoch_fp32 = sizes["train_batches_per_epoch"] * fp32_ms / 1e3
    search_full = profiling + rejected * scale
    run20 = REFERENCE_EPOCHS * full_epoch_comp
    warmup_epochs = int(search["search_kwargs"].get("warmup_epochs", 1))
    # What a user pays beyond training with the plan from step 0: the search's cost plus the FP32 warm-up epoch(s),
    # which run slower than the plan would.
    warmup_penalty = warmup_epochs * max(0.0, full_epoch_fp32 - full_epoch_comp)
    trials = [{k: t.get(k) for k in ("label", "verdict", "reason", "metric", "reference", "seconds", "median_step_ms",
                                     "kept", "low_operators")} for t in record.get("trials", [])]
    operators = record.get("operators", {})
    reasons: dict[str, int] = {}
    for info in operators.values():
        key = f"{info.get('decision')}: {str(info.get('reason', '')).split(' (')[0].split(':')[0]}"
        reasons[key] = reasons.get(key, 0) + 1
    return {
        "chosen_trial": record.get("chosen_trial"),
        "finish_reason": record.get("finish_reason"),
        "lowered_operators": record.get("lowered_operators", []),
        "num_operators": record.get("num_operators"),
        "decision_counts": reasons,
        "profile_step_ms": record.get("step_ms", {}),
        "trials": trials,
        "measured": {"profiling_seconds": profiling, "rejected_trial_seconds": rejected,
                     "search_seconds": search_seconds, "record_search_seconds": search_recorded,
                     "record_double_counts_profiling": double_counted,
                     "fit_seconds": search.get("fit_seconds"),
                     "wall_seconds_incl_process_start": search.get("wall_seconds"),
                     "search_train_batches": search["search_train_batches"],
                     "search_val_batches": search["search_val_batches"],
                     "share_of_this_fit": cost.get("share_of_fit")},
        "extrapolated": {"train_batches_per_full_epoch": sizes["train_batches_per_epoch"],
                         "scale": scale,
                         "search_seconds_full_epochs": search_full,
                         "comp_epoch_seconds_full": full_epoch_comp,
                         "fp32_epoch_seconds_full": full_epoch_fp32,
                         f"run_{REFERENCE_EPOCHS}_epochs_seconds": run20,
                         "share_of_20_epoch_run": search_full / run20 if run20 and math.isfinite(run20) else math.nan,
                         "fp32_warmup_penalty_seconds": warmup_penalty,
                         "share_incl_warmup_penalty": (search_full + warmup_penalty) / run20
                         if run20 and math.isfinite(run20) else math.nan},
        "real_run": _real_run(search),
        "search_run_final_metrics": search.get("final_metrics"),
        "default_example": spec.default_example,
    }


def _real_run(search: dict[str, Any]) -> dict[str, Any] | None:
    """The search run itself, when it trained ``REFERENCE_EPOCHS`` user epochs on full epochs: a measured share."""
    record = search.get("record") or {}
    cost = record.get("cost") or {}
    epochs = len(search.get("epoch_times") or [])
    full = search.get("search_train_batches") == (search.get("sizes") or {}).get("train_batches_per_epoch")
    if not full or epochs < REFERENCE_EPOCHS or not cost.get("fit_seconds"):
        return None
    return {"epochs_trained": epochs, "extension_epochs": record.get("extension_epochs"),
            "fit_seconds": cost["fit_seconds"], "search_seconds": cost.get("search_seconds"),
            "share_of_fit": cost.get("share_of_fit"),
            # the record also charges the FP32 warm-up epoch's lost time against the plan (measured batch times)
            "warmup_overhead_seconds": cost.get("warmup_overhead_seconds"),
            "total_seconds": cost.get("total_seconds", cost.get("search_seconds")),
            "total_share_of_fit": cost.get("total_share_of_fit", cost.get("share_of_fit")),
            "final_metrics": search.get("final_metrics")}


def evaluate_targets(models: dict[str, Any], tolerance: float) -> dict[str, Any]:
    checks: list[dict[str, Any]] = []

    def add(name: str, value: float, target: float, op: str, model: str | None = None, note: str = "") -> None:
        ok = (value >= target if op == ">=" else value <= target) if math.isfinite(value) else False
        checks.append({"target": name, "model": model, "value": value, "op": op, "threshold": target,
                       "met": bool(ok), "note": note})

    vs_amp = []
    for key, m in models.items():
        r = m.get("ratios", {})
        if "throughput_vs_bf16-mixed" in r:
            vs_amp.append(r["throughput_vs_bf16-mixed"]["median"])
            add("throughput CoMP/AMP", r["throughput_vs_bf16-mixed"]["median"], TARGET_PER_MODEL_VS_AMP, ">=", key)
        if "throughput_vs_fp32" in r:
            add("throughput CoMP/FP32", r["throughput_vs_fp32"]["median"], TARGET_PER_MODEL_VS_FP32, ">=", key)
        if "throughput_vs_bf16-true" in r:
            converges = m["modes"]["bf16-true"].get("converges_like_fp32", False)
            add("throughput CoMP/bf16-true", r["throughput_vs_bf16-true"]["median"], TARGET_VS_BF16_TRUE, ">=", key,
                note="" if converges else "bf16-true does not converge like FP32 here: target not applicable")
            if not converges:
                checks[-1]["met"] = None
        if key in MEMORY_TARGET_MODELS and "memory_step_peak_vs_bf16-mixed" in r:
            add("peak tensor memory of a training step CoMP/AMP", r["memory_step_peak_vs_bf16-mixed"],
                TARGET_MEMORY_VS_AMP, "<=", key,
                note=f"process RSS increment ratio {r['memory_increment_vs_bf16-mixed']:.2f}")
        comp = m["modes"].get("comp", {})
        fp32 = m["modes"].get("fp32", {})
        if "final_validation" in comp and "final_validation" in fp32:
            c = comp["final_validation"].get("val_loss", math.nan)
            f = fp32["final_validation"].get("val_loss", math.nan)
            add("val_loss CoMP/FP32", c / f if f else math.nan, 1 + tolerance, "<=", key,
                note=f"CoMP {c:.4f} vs FP32 {f:.4f}")
        s = m.get("search", {})
        if s.get("default_example") and s.get("real_run"):
            real = s["real_run"]
            add("search cost share of a 20-epoch run (default example)", real["total_share_of_fit"],
                TARGET_SEARCH_SHARE, "<=", key,
                note=f"measured: search {real['search_seconds']:.1f} s + FP32 warm-up over the plan"
                f" {real['warmup_overhead_seconds'] or 0.0:.1f} s = {real['total_seconds']:.1f} s of a"
                f" {real['fit_seconds']:.0f} s fit of {real['epochs_trained']} epochs (search alone"
                f" {real['share_of_fit']:.3f}); vs 20 epochs of training alone at the plan's benchmark step time:"
                f" {s['extrapolated']['share_incl_warmup_penalty']:.3f} with the warm-up")
        elif s.get("default_example") and "extrapolated" in s:
            add("search cost share of a 20-epoch run (default example)", s["extrapolated"]["share_of_20_epoch_run"],
                TARGET_SEARCH_SHARE, "<=", key,
                note="search measured on full epochs; 20-epoch run = 20 x full epoch at the plan's measured step time"
                if s["extrapolated"]["scale"] == 1 else "search cost extrapolated from shortened epochs")
    if vs_amp:
        add("throughput CoMP/AMP geomean over the suite", _geomean(vs_amp), TARGET_GEOMEAN_VS_AMP, ">=")
    return {"checks": checks, "geomean_vs_amp": _geomean(vs_amp) if vs_amp else math.nan}


# -------------------------------------------------------------------------------------------------- reporting
def machine_info() -> dict[str, Any]:
    import lightning
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
        "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Core(s) per socket", "Thread(s) per core", "Flags"):
                value = value.strip()
                if key.strip() == "Flags":
                    value = " ".join(f for f in value.split() if "amx" in f or "bf16" in f or "fp16" in f)
                info[f"lscpu {key.strip()}"] = value
    except (OSError, subprocess.SubprocessError):
        pass
    from lightning_comp.cpu_features import cpu_features
    from lightning_comp.devices import device_class

    features = cpu_features()
    for name in ("amx_tile", "avx512_bf16", "amx_fp16"):
        info[f"is_{name}_supported"] = name in features

    info["device_class"] = device_class("cuda" if torch.cuda.is_available() else "cpu").to_dict()
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda_capability"] = list(torch.cuda.get_device_capability())
    return info


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def modes_that_cannot_run(spec: ModelSpec, modes: list[str], device_type: str) -> dict[str, str]:
    """Lightning precisions that cannot run ``spec``'s model on this device, with why (CoMP always can).

    CPU autocast has no BF16 ``nn.LSTM`` kernel on CPUs without AVX512-BF16 (pytorch/pytorch#88136), so Lightning's
    ``bf16-mixed`` dies inside oneDNN there; what runs is decided by the package's own kernel probe.
    """
    if device_type != "cpu" or "bf16-mixed" not in modes:
        return {}
    import torch

    from lightning_comp import zoo
    from lightning_comp.devices import device_class
    from lightning_comp.dtypes import Precision
    from lightning_comp.operators import Lowering, lowering_for

    with torch.device("meta"):
        model = getattr(zoo, spec.model)(**spec.model_kwargs)
    lstms = [m for m in model.modules() if isinstance(m, torch.nn.LSTM)]
    if lstms and lowering_for(lstms[0], Precision.BF16, "cpu") is not Lowering.AUTOCAST:
        return {"bf16-mixed": f"skipped: CPU autocast has no BF16 nn.LSTM kernel on this CPU"
                              f" ({device_class('cpu').describe()}); Lightning's bf16-mixed would fail inside oneDNN"}
    return {}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lightning_comp.dtypes import Precision, device_supports_fast

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    modes = ["fp32", "bf16-mixed", "bf16-true"]
    skipped: dict[str, str] = {}
    if device_supports_fast(Precision.FP16, device_type):
        modes.append("16-mixed")
    else:
        skipped["16-mixed"] = (
            f"skipped: this {device_type} has no fast FP16 (no AMX-FP16): FP16 matmul"
            " runs at ~1x FP32, FP16 Conv2d backward uses oneDNN's reference kernel (~100x slower), nn.LSTM has no"
            " FP16 CPU kernel, and Lightning silently turns precision='16-mixed' into 'bf16-mixed' on CPU."
            if device_type == "cpu" else f"skipped: no fast FP16 on this {device_type}")
    modes.append("comp")
    if args.modes:
        modes = [m for m in modes if m in args.modes.split(",")]
    keys = DEFAULT_MODELS if args.models in (None, "default") else tuple(SUITE) if args.models == "all" \
        else tuple(args.models.split(","))
    specs = [smoke_spec(SUITE[k]) if args.smoke else SUITE[k] for k in keys]
    if args.steps_scale != 1.0:
        specs = [replace(s, steps=max(2 * s.segment, int(round(s.steps * args.steps_scale / s.segment)) * s.segment))
                 for s in specs]
    ctx = mp_context()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    search_kwargs = _search_kwargs({}, "")
    tolerance = float(search_kwargs.get("tolerance", 0.02))
    tolerance_mode = str(search_kwargs.get("tolerance_mode", "relative"))
    started = time.perf_counter()
    report: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "machine": machine_info(),
        "device": device_type,
        "load_average_start": _load(),
        "smoke": bool(args.smoke),
        "modes": modes,
        "skipped_modes": skipped,
        "search_settings": {k: v for k, v in search_kwargs.items() if k not in ("record_dir", "verbose")},
        "tolerance": tolerance, "tolerance_mode": tolerance_mode,
        "specs": {s.key: asdict(s) for s in specs},
        "models": {},
        "raw": {},
    }
    for spec in specs:
        t0 = time.perf_counter()
        print(f"[compare] {spec.key}: search ...", flush=True)
        search: dict[str, Any] = {"error": "CoMP not benchmarked"}
        plan = None
        if "comp" in modes:
            search = run_search(ctx, spec, args, out_dir / f"compare_search_{spec.key}")
            if "error" in search:
                print(f"[compare] {spec.key}: search failed:\n{search['error']}", flush=True)
            else:
                plan = search["plan"]
                rec = search.get("record") or {}
                print(f"[compare] {spec.key}: search chose {rec.get('chosen_trial')!r}, lowered"
                      f" {len(rec.get('lowered_operators', []))}/{rec.get('num_operators')} operators,"
                      f" cost {rec.get('cost', {}).get('search_seconds', math.nan):.1f} s", flush=True)
        run_modes = [m for m in modes if m != "comp" or plan is not None]
        cannot_run = modes_that_cannot_run(spec, run_modes, device_type)
        for mode, why in cannot_run.items():
            print(f"[compare] {spec.key}/{mode} {why}", flush=True)
        run_modes = [m for m in run_modes if m not in cannot_run]
        print(f"[compare] {spec.key}: interleaved training of {', '.join(run_modes)} ...", flush=True)
        runs, orders = run_interleaved(ctx, spec, run_modes, plan, args)
        for mode, result in runs.items():
            if "error" in result:
                print(f"[compare] {spec.key}/{mode} failed:\n{result['error']}", flush=True)
        raw = {"search": search, "runs": runs, "orders": orders, "seconds": time.perf_counter() - t0,
               "load_average_after": _load()}
        report["raw"][spec.key] = raw
        analysed = analyse_raw(spec, raw, tolerance, tolerance_mode)
        analysed["skipped_modes"] = cannot_run
        report["models"][spec.key] = analysed
        print(f"[compare] {spec.key}: done in {analysed['seconds']:.0f} s; load {analysed['load_average_after']}",
              flush=True)
        print(short_lines(spec.key, analysed), flush=True)
    report["targets"] = evaluate_targets(report["models"], tolerance)
    report["load_average_end"] = _load()
    report["total_seconds"] = time.perf_counter() - started
    return report


def analyse_raw(spec: ModelSpec, raw: dict[str, Any], tolerance: float, tolerance_mode: str) -> dict[str, Any]:
    analysed = analyse_model(spec, raw["search"], raw["runs"], tolerance, tolerance_mode)
    analysed.update(round_orders=raw["orders"], seconds=raw["seconds"], title=spec.title,
                    load_average_after=raw["load_average_after"])
    return analysed


def reanalyse(path: Path) -> dict[str, Any]:
    """Rebuild the report from a ``compare_raw.json`` (after a change to the analysis, without re-measuring)."""
    report = json.loads(path.read_text())
    report["models"] = {}
    for key, raw in report["raw"].items():
        spec = ModelSpec(**report["specs"][key])
        report["models"][key] = analyse_raw(spec, raw, report["tolerance"], report["tolerance_mode"])
    report["targets"] = evaluate_targets(report["models"], report["tolerance"])
    return report


def short_lines(key: str, m: dict[str, Any]) -> str:
    lines = []
    for mode, e in m["modes"].items():
        if "error" in e:
            lines.append(f"    {mode:<11} ERROR")
            continue
        t, mem, val = e["throughput"], e["memory"], e["final_validation"]
        lines.append(f"    {mode:<11} {t['samples_per_s']:9.1f} samples/s [{t['min']:.1f}-{t['max']:.1f}]"
                     f"  step peak {_step_peak(e) / 2**20:7.1f} MiB  RSS +{mem['increment_bytes'] / 2**20:7.1f} MiB"
                     f"  val_loss {val.get('val_loss', math.nan):.4f}")
    return "\n".join(lines)


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"# CoMP vs FP32 / AMP / BF16: results of `{report['command']}`",
        "",
        f"- date: {report['date']}; total {report['total_seconds']:.0f} s",
        f"- machine: {m.get('lscpu Model name', platform.processor())}, {m.get('lscpu CPU(s)', m['cpu_count'])} CPUs,"
        f" torch {m['torch']} ({m['torch_threads']} threads), lightning {m['lightning']}, device {report['device']}"
        + (f" ({m.get('cuda_device')})" if report["device"] == "cuda" else ""),
        f"- load average (1/5/15 min) at start {report['load_average_start']}, at end {report['load_average_end']}",
        f"- search settings (from `lightning_comp/conf/precision/comp.yaml`): tolerance {report['tolerance']}"
        f" ({report['tolerance_mode']}) on val_loss",
    ]
    for mode, why in report["skipped_modes"].items():
        lines.append(f"- `{mode}` {why}")
    for key, model in report["models"].items():
        for mode, why in model.get("skipped_modes", {}).items():
            lines.append(f"- {key} `{mode}` {why}")
    lines += ["", "| model | mode | samples/s (median) | spread (min-max over rounds) | vs FP32 | vs AMP |"
              " step peak tensor mem (MiB) | saved for bwd (MiB) | process RSS: peak / +over baseline (MiB) |"
              " val_loss | val metric | steps |", "|" + "---|" * 12]
    for key, model in report["models"].items():
        modes = model["modes"]
        fp32 = modes.get("fp32", {}).get("throughput")
        amp = modes.get("bf16-mixed", {}).get("throughput")
        for mode, e in modes.items():
            if "error" in e:
                lines.append(f"| {key} | {MODES[mode].label} | error | | | | | | | | | |")
                continue
            t = e["throughput"]
            vs32 = round_ratio(t, fp32)["median"] if fp32 else math.nan
            vsamp = round_ratio(t, amp)["median"] if amp else math.nan
            saved = e["saved_for_backward"] or {}
            val = e["final_validation"]
            metric = model["metric"]
            lines.append(
                f"| {key} | {MODES[mode].label} | {_fmt(t['samples_per_s'], '.1f')} |"
                f" {_fmt(t['min'], '.1f')}-{_fmt(t['max'], '.1f')} | {_fmt(vs32)} | {_fmt(vsamp)} |"
                f" {_fmt(_step_peak(e) / 2**20, '.1f')} |"
                f" {_fmt(saved.get('activation_bytes', math.nan) / 2**20, '.1f')} |"
                f" {_fmt(e['memory']['peak_bytes'] / 2**20, '.0f')} /"
                f" +{_fmt(e['memory']['increment_bytes'] / 2**20, '.0f')} |"
                f" {_fmt(val.get('val_loss'), '.4f')} | {metric} {_fmt(val.get(metric), '.4f')} | {e['steps']} |")
    lines += ["", "## CoMP search", "", "| model | chosen | lowered / operators | cost (s, measured) |"
              " cost at full epochs (s) | 20 epochs at the plan's step time (s) | share | measured 20-epoch fit |"
              " trials |", "|" + "---|" * 9]
    for key, model in report["models"].items():
        s = model["search"]
        if "error" in s:
            lines.append(f"| {key} | search failed | | | | | | | |")
            continue
        x = s["extrapolated"]
        trials = "; ".join(f"{t['label']}: {t['verdict']}" for t in s["trials"])
        lines.append(f"| {key}{' (default example)' if s['default_example'] else ''} | {s['chosen_trial']} |"
                     f" {len(s['lowered_operators'])} / {s['num_operators']} |"
                     f" {_fmt(s['measured']['search_seconds'], '.1f')}"
                     f" | {_fmt(x['search_seconds_full_epochs'], '.1f')} | {_fmt(x['run_20_epochs_seconds'], '.0f')} |"
                     f" {_fmt(100 * x['share_of_20_epoch_run'], '.1f')} % | {_real_cell(s.get('real_run'))} |"
                     f" {trials} |")
    lines += ["", "## Ratios and targets", "", "| target | model | value | threshold | met |", "|---|---|---|---|---|"]
    for c in report["targets"]["checks"]:
        met = "n/a" if c["met"] is None else "yes" if c["met"] else "**no**"
        note = f" ({c['note']})" if c["note"] else ""
        lines.append(f"| {c['target']}{note} | {c['model'] or 'suite'} | {_fmt(c['value'], '.3f')} |"
                     f" {c['op']} {c['threshold']} | {met} |")
    return "\n".join(lines) + "\n"


def _real_cell(real: dict[str, Any] | None) -> str:
    if not real:
        return "-"
    return (f"{real['total_seconds']:.1f} s (search {real['search_seconds']:.1f} s + FP32 warm-up over the plan"
            f" {real.get('warmup_overhead_seconds') or 0.0:.1f} s) of {real['fit_seconds']:.0f} s"
            f" ({real['epochs_trained']} epochs) = {100 * real['total_share_of_fit']:.1f} %")


CSV_FIELDS = ("model", "mode", "samples_per_s", "samples_per_s_min", "samples_per_s_max", "pooled_samples_per_s",
              "median_step_ms", "vs_fp32", "vs_amp", "step_peak_tensor_mib", "rss_increment_mib", "rss_peak_mib",
              "rss_steady_increment_mib", "saved_activations_mib",
              "saved_parameters_mib", "val_loss", "val_metric_name", "val_metric", "steps", "converges_like_fp32",
              "cast_ms_profiled_step", "forward_hooks")


def csv_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, model in report["models"].items():
        modes = model["modes"]
        fp32 = modes.get("fp32", {}).get("throughput")
        amp = modes.get("bf16-mixed", {}).get("throughput")
        for mode, e in modes.items():
            if "error" in e:
                rows.append({"model": key, "mode": mode})
                continue
            t, saved, val = e["throughput"], e["saved_for_backward"] or {}, e["final_validation"]
            rows.append({
                "model": key, "mode": mode, "samples_per_s": t["samples_per_s"], "samples_per_s_min": t["min"],
                "samples_per_s_max": t["max"], "pooled_samples_per_s": t["pooled_samples_per_s"],
                "median_step_ms": t["median_step_ms"],
                "vs_fp32": round_ratio(t, fp32)["median"] if fp32 else "",
                "vs_amp": round_ratio(t, amp)["median"] if amp else "",
                "step_peak_tensor_mib": _step_peak(e) / 2**20,
                "rss_increment_mib": e["memory"]["increment_bytes"] / 2**20,
                "rss_peak_mib": e["memory"]["peak_bytes"] / 2**20,
                "rss_steady_increment_mib": (e["memory"].get("steady_increment_bytes") or math.nan) / 2**20,
                "saved_activations_mib": saved.get("activation_bytes", 0) / 2**20,
                "saved_parameters_mib": saved.get("parameter_bytes", 0) / 2**20,
                "val_loss": val.get("val_loss"), "val_metric_name": model["metric"],
                "val_metric": val.get(model["metric"]),
                "steps": e["steps"], "converges_like_fp32": e.get("converges_like_fp32"),
                "cast_ms_profiled_step": (e.get("profile") or {}).get("cast_self_ms"),
                "forward_hooks": e.get("forward_hooks"),
            })
    return rows


def write_outputs(report: dict[str, Any], out_dir: Path, img_dir: Path, prefix: str, plots: bool) -> list[Path]:
    import csv

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    json_path = out_dir / f"{prefix}.json"
    raw_path = out_dir / f"{prefix}_raw.json"
    raw_path.write_text(json.dumps(report, default=_json_default) + "\n")
    json_path.write_text(json.dumps({k: v for k, v in report.items() if k != "raw"}, indent=1,
                                    default=_json_default) + "\n")
    paths.append(raw_path)
    csv_path = out_dir / f"{prefix}.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in csv_rows(report):
            writer.writerow({k: _csv_value(row.get(k)) for k in CSV_FIELDS})
    md_path = out_dir / f"{prefix}.md"
    md_path.write_text(markdown(report))
    paths += [json_path, csv_path, md_path]
    if plots:
        from compare_plots import plot_all

        img_dir.mkdir(parents=True, exist_ok=True)
        paths += plot_all(report, img_dir, prefix)
    return paths


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return "" if not math.isfinite(value) else f"{value:.6g}"
    return "" if value is None else value


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def print_ratios(report: dict[str, Any]) -> None:
    print("\nCoMP throughput ratios (median of per-round ratios; min-max over rounds):")
    for key, model in report["models"].items():
        r = model["ratios"]
        parts = []
        for other, label in (("bf16-mixed", "CoMP/AMP"), ("fp32", "CoMP/FP32"), ("bf16-true", "CoMP/bf16-true"),
                             ("16-mixed", "CoMP/16-mixed")):
            x = r.get(f"throughput_vs_{other}")
            if x:
                parts.append(f"{label} {x['median']:.3f} [{x['min']:.2f}-{x['max']:.2f}]")
        mem = r.get("memory_step_peak_vs_bf16-mixed")
        if mem is not None:
            parts.append(f"step-peak-mem CoMP/AMP {mem:.3f} (RSS increment {r['memory_increment_vs_bf16-mixed']:.3f})")
        print(f"  {key:<6} " + "  ".join(parts))
    print(f"  geomean CoMP/AMP over the suite: {report['targets']['geomean_vs_amp']:.3f}")
    print("\nTargets:")
    for c in report["targets"]["checks"]:
        met = "n/a" if c["met"] is None else "met" if c["met"] else "MISSED"
        print(f"  [{met:>6}] {c['target']:<55} {c['model'] or 'suite':<6} {_fmt(c['value'], '.3f')}"
              f" {c['op']} {c['threshold']}  {c['note']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None,
                        help=f"comma-separated keys of {sorted(SUITE)}, 'default' ({','.join(DEFAULT_MODELS)})"
                             " or 'all'")
    parser.add_argument("--modes", default=None,
                        help="comma-separated subset of fp32,bf16-mixed,bf16-true,16-mixed,comp")
    parser.add_argument("--smoke", action="store_true", help="tiny models and a few steps (seconds per model)")
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply every model's step count")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in every worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for any one worker answer")
    parser.add_argument("--out", default=None, help="directory of the JSON/CSV/Markdown (default benchmarks/results,"
                                                   " or benchmarks/results/compare_smoke with --smoke)")
    parser.add_argument("--img", default=None, help="directory of the PNG plots (default docs/img, or --out with"
                                                   " --smoke)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--reanalyse", default=None, metavar="RAW_JSON",
                        help="rebuild the outputs from a compare_raw.json instead of measuring")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler step per mode")
    parser.add_argument("--wait-quiet", type=float, default=0.0,
                        help="wait up to this many minutes for the 1-minute load average to fall below --quiet-load")
    parser.add_argument("--quiet-load", type=float, default=1.5)
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(RESULTS_DIR / "compare_smoke") if args.smoke else str(RESULTS_DIR)
    if args.img is None:
        args.img = args.out if args.smoke else str(IMG_DIR)
    return args


def wait_quiet(minutes: float, threshold: float) -> None:
    deadline = time.monotonic() + 60 * minutes
    while True:
        load = os.getloadavg()[0]
        if load < threshold or time.monotonic() >= deadline:
            print(f"[compare] 1-min load average {load:.2f} (threshold {threshold}); starting", flush=True)
            return
        print(f"[compare] 1-min load average {load:.2f} >= {threshold}; waiting ...", flush=True)
        time.sleep(min(60.0, max(1.0, deadline - time.monotonic())))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.wait_quiet > 0:
        wait_quiet(args.wait_quiet, args.quiet_load)
    report = reanalyse(Path(args.reanalyse)) if args.reanalyse else run_benchmark(args)
    paths = write_outputs(report, Path(args.out), Path(args.img), "compare", not args.no_plots)
    print("\n" + markdown(report))
    print_ratios(report)
    print("\nwrote:\n  " + "\n  ".join(str(p) for p in paths))
    failed = [f"{k}/{m}" for k, model in report["models"].items() for m, e in model["modes"].items() if "error" in e]
    failed += [f"{k}/search" for k, model in report["models"].items() if "error" in model["search"]]
    if failed:
        print(f"\nfailed runs: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
