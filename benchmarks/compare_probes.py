"""What a training worker of ``benchmarks/compare.py`` measures inside its own process.

The ``Baton`` callback trains ``segment`` optimizer steps per turn and hands the turn back to the coordinator; it
times every batch from ``on_train_batch_start`` to ``on_train_batch_end`` (synchronised on CUDA), split into its
phases at ``on_before_backward`` and ``on_after_backward`` (forward, backward, and the rest: clipping and the optimizer
step), and records the validation points. Around one step it counts the bytes saved for backward (``_SavedBytes``, a
``saved_tensors_hooks`` pack hook), around another it runs ``torch.profiler`` for the cast time (``_profile_summary``)
and the step's peak tensor memory (``_static_bytes`` + ``_tensor_peak_delta``). ``_Memory`` follows the process's
peak memory (Linux ``VmHWM``, or the CUDA allocator's peak).
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any


def _device_of(module: Any) -> str:
    for p in module.parameters():
        return p.device.type
    return "cpu"


def _max_rss_bytes() -> int:
    import resource

    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


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


def _make_baton_callback(conn: Any, spec: dict[str, Any], probe_step: int, profile_step: int | None,
                         process_step: int | None = None) -> Any:
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_comp.search.measurement.process_memory import StepPeakRecorder

    class Baton(Callback):
        """Trains ``segment`` steps per turn; times batches; records validation, memory, saved bytes, a profile."""

        def __init__(self) -> None:
            self.segment = int(spec["segment"])
            self.batch_size = int(spec["data_kwargs"]["batch_size"])
            self.round = -1
            self.count = 0
            self.t0 = 0.0
            self.marks: list[float] = []  # the batch's phase boundaries: backward's start, its end
            self.batches: list[dict[str, Any]] = []
            self.vals: list[dict[str, Any]] = []
            self.memory: _Memory | None = None
            self.saved: _SavedBytes | None = None
            self._saved_ctx: Any = None
            self._prof: Any = None
            self.profile: dict[str, Any] | None = None
            self.static: dict[str, int] = {}
            self.step_peak: dict[str, Any] | None = None
            self.process_peak: dict[str, Any] | None = None  # the process's peak over one warm step
            self._process: Any = None
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
            if process_step is not None and step == process_step:
                # the heap's live peak (and RSS sampled per operator, leaving VmHWM to the RSS probe): what the
                # process needs for a step, which tensor accounting leaves out (the allocator, temporaries)
                self._process = StepPeakRecorder("cuda" if self.cuda else None, reset_hwm=False).__enter__()
            if self.round >= 1 and not self._steady_reset and not self.cuda:
                self._steady_reset = True
                if self.memory is not None and self.memory.can_reset():
                    self.warmup_peak = self.memory.peak()
                    self.steady_reset_ok = self.memory.reset_peak()
            self._sync()
            self.marks = []
            self.t0 = time.perf_counter()

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            self._sync()
            self.marks.append(time.perf_counter())

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            self._sync()
            self.marks.append(time.perf_counter())

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self._sync()
            end = time.perf_counter()
            ms = (end - self.t0) * 1e3
            phases = None
            if len(self.marks) == 2:  # one backward (automatic optimization): forward, backward, the update and rest
                bounds = [self.t0, *self.marks, end]
                phases = {name: (b - a) * 1e3 for name, a, b in zip(("forward", "backward", "update"), bounds,
                                                                    bounds[1:])}
            step = trainer.global_step - 1
            special = ""
            if self._saved_ctx is not None:
                self._saved_ctx.__exit__(None, None, None)
                self._saved_ctx = None
                special = "saved_bytes_probe"
            if self._process is not None:
                self._process.__exit__(None, None, None)
                peak = self._process.peak
                self.process_peak = {"live_bytes": peak.live_bytes, "os_bytes": peak.os_bytes,
                                     "reserved_bytes": peak.reserved_bytes, "allocated_bytes": peak.allocated_bytes,
                                     "how": peak.how, "step": step}
                self._process = None
                special = "process_peak"
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
                                 "loss": loss_value, "phases": phases})
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
