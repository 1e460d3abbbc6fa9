"""Strong-scaling study of a small FRNN-like stacked LSTM with DDP over gloo on this CPU.

Measures, for 1 and 2 worker processes (one thread each, one process per core, the CPU analogue of one GPU per
process; optionally a 1-process/2-thread reference), the time per optimizer step with a fixed *global* batch, the share
of that time spent in gradient communication, and the all-reduce payload per step, each with fp32 gradients and
with bf16/fp16 gradient compression (``lightning_comp.distributed.grad_compression``). It then fits the paper's model
``T(N) = T(N0) * N0 / N * (1 + c ln N)`` with ``N0 = 1`` and extrapolates it to 8, 32 and 100 workers.

The model follows the FRNN of Svyatkovskiy et al. scaled down for 2 cores: 2 stacked LSTM layers over sequences of
128 steps with 14 input signals and a per-time-step logit (disruption-style binary target), on synthetic data.

Plain ``torch.nn.parallel.DistributedDataParallel`` is used (the module Lightning's ``DDPStrategy`` wraps the model
in) so that the Trainer's own per-step overhead does not blur a 2-point measurement; the hooks are the ones
``HalfPrecisionDDPStrategy`` registers.

Reproduce ``docs/scaling.md`` with::

    python benchmarks/scaling.py

(about 2.5 to 4 minutes on 2 shared cores; ``--quick`` for a smoke run).
"""

import argparse
import faulthandler
import math
import multiprocessing as mp
import socket
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import load_average, run_header, write_json  # noqa: E402

from lightning_comp.distributed.grad_compression import (  # noqa: E402
    CommStats,
    bf16_compress_hook_any_backend,
    counting_comm_hook,
)

ROOT = Path(__file__).resolve().parents[1]
MODES = ("builtin", "fp32", "bf16", "fp16")
"""``builtin``: DDP's C++ all-reduce, no hook; ``fp32``: the equivalent Python ``allreduce_hook`` (counted);
``bf16``/``fp16``: compression hooks (counted)."""
HOOKS = {
    "fp32": default_hooks.allreduce_hook,
    "bf16": bf16_compress_hook_any_backend,
    "fp16": default_hooks.fp16_compress_hook,
}


@dataclass(frozen=True)
class BenchConfig:
    """Model and measurement sizes."""

    features: int = 14
    hidden: int = 128
    layers: int = 2
    seq_len: int = 128
    global_batch: int = 32
    warmup: int = 2
    steps: int = 8
    rounds: int = 5


@dataclass(frozen=True)
class Setup:
    """Process layout of one measurement."""

    workers: int
    threads: int

    @property
    def label(self) -> str:
        """E.g. ``2w x 1t``."""
        return f"{self.workers}w x {self.threads}t"


class FRNNLike(nn.Module):
    """Stacked LSTM with a per-time-step logit, as in the FRNN disruption predictor."""

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__()
        self.lstm = nn.LSTM(cfg.features, cfg.hidden, num_layers=cfg.layers, batch_first=True)
        self.head = nn.Linear(cfg.hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out).squeeze(-1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time_steps(
    model: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    sync: bool,
) -> tuple[list[float], list[float]]:
    """Wall and process CPU time of ``steps`` full optimizer steps (forward, backward incl. all-reduce, update).

    CPU time (all threads of the process, gloo's included) does not grow when other jobs take the core away, so it
    is the contention-robust view of the work per step; it misses pure waiting on the network or on a peer.
    """
    times, cpu_times = [], []
    loss_fn = nn.BCEWithLogitsLoss()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        dist.barrier()  # start every step together so the slowest rank defines it
        start, cpu_start = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        if sync:
            loss_fn(model(x), y).backward()
        else:
            with model.no_sync():  # identical compute, no gradient communication
                loss_fn(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return times, cpu_times


def _worker(rank: int, setup: Setup, cfg: BenchConfig, port: int, queue: Any, timeout_s: float) -> None:
    faulthandler.dump_traceback_later(timeout_s, exit=True)  # a hung worker prints its stack and exits
    torch.set_num_threads(setup.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=setup.workers
    )  # fmt: skip
    try:
        local_batch = cfg.global_batch // setup.workers
        gen = torch.Generator().manual_seed(1234 + rank)
        batches = [
            (
                torch.randn(local_batch, cfg.seq_len, cfg.features, generator=gen),
                torch.bernoulli(torch.full((local_batch, cfg.seq_len), 0.1), generator=gen),
            )
            for _ in range(4)
        ]
        runs: dict[str, tuple[DistributedDataParallel, torch.optim.Optimizer, CommStats]] = {}
        for mode in MODES:
            torch.manual_seed(0)
            ddp = DistributedDataParallel(FRNNLike(cfg))
            stats = CommStats()
            if mode in HOOKS:
                ddp.register_comm_hook(None, counting_comm_hook(HOOKS[mode], stats))
            runs[mode] = (ddp, torch.optim.Adam(ddp.parameters(), lr=1e-3), stats)
        wall: dict[tuple[str, bool], list[float]] = {(m, sync): [] for m in MODES for sync in (True, False)}
        cpu: dict[tuple[str, bool], list[float]] = {(m, sync): [] for m in MODES for sync in (True, False)}
        for _ in range(cfg.rounds):  # interleave modes so that machine noise hits all of them alike
            for mode, (ddp, opt, stats) in runs.items():
                _time_steps(ddp, opt, batches, cfg.warmup, sync=True)
                stats.reset()
                for sync in (True, False):
                    w, c = _time_steps(ddp, opt, batches, cfg.steps, sync=sync)
                    wall[mode, sync] += w
                    cpu[mode, sync] += c
        result: dict[str, Any] = {}
        for mode, (ddp, _, stats) in runs.items():
            both = torch.tensor(
                [wall[mode, True], wall[mode, False], cpu[mode, True], cpu[mode, False]], dtype=torch.float64
            )
            dist.all_reduce(both, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            comm = torch.tensor([stats.comm_seconds, stats.hook_seconds, float(stats.steps)], dtype=torch.float64)
            dist.all_reduce(comm, op=dist.ReduceOp.MAX)
            sync, nosync, cpu_sync, cpu_nosync = (row.tolist() for row in both)
            steps = max(comm[2].item(), 1.0)
            result[mode] = {
                "step_s_median": statistics.median(sync),
                "step_s_min": min(sync),
                "compute_only_step_s_median": statistics.median(nosync),
                "compute_only_step_s_min": min(nosync),
                "cpu_step_s_median": statistics.median(cpu_sync),
                "cpu_compute_only_step_s_median": statistics.median(cpu_nosync),
                "hook_comm_s_per_step": comm[0].item() / steps if mode in HOOKS else math.nan,
                "hook_call_s_per_step": comm[1].item() / steps if mode in HOOKS else math.nan,
                "bytes_per_step": stats.bytes_per_step if mode in HOOKS else math.nan,
                "grad_bytes_per_step": stats.grad_bytes / steps if mode in HOOKS else math.nan,
                "sent_dtypes": sorted(stats.sent_dtypes),
                "params": sum(p.numel() for p in ddp.parameters()),
            }
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def run_setup(setup: Setup, cfg: BenchConfig, timeout_s: float = 600.0) -> dict[str, Any]:
    """Spawn ``setup.workers`` gloo processes and return rank 0's measurements."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, setup, cfg, port, queue, timeout_s), daemon=True)
        for r in range(setup.workers)
    ]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if bad:
        raise RuntimeError(f"{setup.label}: worker exit codes {bad}")
    return result


def fit_c(times: Mapping[int, float]) -> float:
    """Least-squares ``c`` of ``T(N) = T(N0) * N0 / N * (1 + c ln(N / N0))``, ``N0`` the smallest ``N`` measured.

    With ``N0 = 1`` this is exactly the paper's ``T(N0) N0 / N (1 + c ln N)``; for ``N0 > 1`` the paper's literal form
    does not pass through its own reference point, so ``ln(N / N0)`` is used. Rearranged,
    ``y = N T(N) / (N0 T(N0)) - 1 = c x`` with ``x = ln(N / N0)``, a line through the origin, so
    ``c = sum(x y) / sum(x ** 2)``. With the two points measured here (N = 1, 2) this is an exact solve with no
    degrees of freedom left; use more points from a real cluster for a real fit.

    Args:
        times: Time per epoch (or per step at a fixed global batch) for each worker count; at least 2 entries.

    Raises:
        ValueError: With fewer than 2 worker counts, or a worker count < 1.
    """
    if len(times) < 2 or min(times) < 1:
        raise ValueError(f"Need times for >= 2 worker counts, all >= 1; got {sorted(times)}.")
    n0 = min(times)
    points = [(math.log(n / n0), n * t / (n0 * times[n0]) - 1.0) for n, t in times.items() if n != n0]
    return sum(x * y for x, y in points) / sum(x * x for x, _ in points)


def extrapolate(c: float, ns: Sequence[int]) -> dict[int, dict[str, float]]:
    """Predicted ``T(N)/T(1)``, speed-up and parallel efficiency under the fitted model."""
    out = {}
    for n in ns:
        rel = (1.0 + c * math.log(n)) / n
        out[n] = {"time_rel": rel, "speedup": 1.0 / rel, "efficiency": 1.0 / (rel * n)}
    return out


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = list(summary["measured"])
    width = 0.2
    panels = [("step_s_min", "wall time per step, ms (min)"), ("cpu_step_s_median", "CPU time per step, ms (median)")]
    for ax, (key, ylabel) in zip(axes[:2], panels, strict=True):
        for i, mode in enumerate(MODES):
            vals = [1000 * summary["measured"][lab][mode][key] for lab in labels]
            ax.bar([x + (i - 1.5) * width for x in range(len(labels))], vals, width, label=mode)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel(ylabel)
        ax.set_title(f"global batch {summary['config']['global_batch']}, 2-core shared VM")
        ax.legend(title="gradient all-reduce", fontsize=8)
    ax = axes[2]
    ns = [1, 2, 4, 8, 16, 32, 64, 100]
    for mode, color in (("fp32", "tab:orange"), ("bf16", "tab:green"), ("fp16", "tab:red")):
        for key, style, what in (("cpu_c_total", "-", "CPU"), ("c_total", ":", "wall")):
            c = summary["fit"][mode][key]
            ys = [n / (1 + c * math.log(n)) for n in ns]
            ax.plot(ns, ys, style, marker="o", ms=3, color=color, label=f"{mode} ({what}): c = {c:.2f}")
    ax.plot(ns, ns, "k--", lw=0.8, label="linear")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("speed-up T(1)/T(N)")
    ax.set_title("paper's model through N = 1, 2 (extrapolation!)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = BenchConfig()
    for name, value in asdict(defaults).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    p.add_argument("--quick", action="store_true", help="smoke run: hidden 32, 1 round of 3 steps")
    p.add_argument(
        "--reference-2-threads",
        action="store_true",
        help="also time 1 process with 2 threads (meaningless when other jobs load the cores: OpenMP spin-waits)",
    )
    p.add_argument("--out-json", type=Path, default=ROOT / "benchmarks/results/scaling.json")
    p.add_argument("--out-png", type=Path, default=ROOT / "docs/img/scaling.png")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.rounds, args.steps, args.warmup = 32, 1, 3, 1
    if args.global_batch % 2:
        p.error(f"--global-batch must be even to split over 2 workers, got {args.global_batch}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Measure the three setups, fit ``c``, write JSON and plot, print a summary."""
    args = _parse(argv)
    cfg = BenchConfig(**{k: getattr(args, k) for k in asdict(BenchConfig())})
    setups = [Setup(1, 1), Setup(2, 1)] + ([Setup(1, 2)] if args.reference_2_threads else [])
    measured: dict[str, Any] = {}
    load: dict[str, Any] = {}
    for setup in setups:
        start = time.perf_counter()
        before = load_average()
        measured[setup.label] = run_setup(setup, cfg)
        after = load_average()
        load[setup.label] = {"loadavg_before": before, "loadavg_after": after}
        print(f"{setup.label}: {time.perf_counter() - start:.0f} s, load {before[:1]} -> {after[:1]}")
    one, two = measured[setups[0].label], measured[setups[1].label]
    fit: dict[str, Any] = {}
    for mode in MODES:
        # Minimum over all timed steps: the least-disturbed estimate on a shared, noisy VM.
        t1, t2 = one[mode]["step_s_min"], two[mode]["step_s_min"]
        compute2 = two[mode]["compute_only_step_s_min"]
        c_total = fit_c({1: t1, 2: t2})
        fit[mode] = {
            "throughput_1w_samples_s": cfg.global_batch / t1,
            "throughput_2w_samples_s": cfg.global_batch / t2,
            "speedup_2w": t1 / t2,
            "comm_share_2w_exposed": (t2 - compute2) / t2,
            "comm_share_2w_hook": two[mode]["hook_comm_s_per_step"] / t2,
            "c_total": c_total,
            "c_comm_only": (t2 / compute2 - 1.0) / math.log(2),
            "extrapolated": extrapolate(c_total, [8, 32, 100]),
            "cpu_speedup_2w": one[mode]["cpu_step_s_median"] / two[mode]["cpu_step_s_median"],
            "cpu_c_total": fit_c({1: one[mode]["cpu_step_s_median"], 2: two[mode]["cpu_step_s_median"]}),
            "cpu_comm_share_2w": 1.0 - two[mode]["cpu_compute_only_step_s_median"] / two[mode]["cpu_step_s_median"],
        }
    summary = {
        **run_header("scaling.py", argv),
        "config": asdict(cfg),
        "backend": "gloo",
        "measured": measured,
        "load": load,
        "fit": fit,
    }
    write_json(args.out_json, summary)
    _plot(summary, args.out_png)
    print(f"params {one['fp32']['params']}, fp32 grads {one['fp32']['grad_bytes_per_step'] / 1e6:.3f} MB/step")
    for mode in MODES:
        f = fit[mode]
        ms1, ms2 = 1000 * one[mode]["step_s_min"], 1000 * two[mode]["step_s_min"]
        print(
            f"{mode:8s} min step 1w {ms1:6.1f} ms 2w {ms2:6.1f} ms"
            f"  speed-up {f['speedup_2w']:.2f}  comm share exposed {100 * f['comm_share_2w_exposed']:5.1f}%"
            f" hook {100 * f['comm_share_2w_hook']:5.1f}%  bytes/step {two[mode]['bytes_per_step']:.0f}"
            f"  c {f['c_total']:.3f} (comm only {f['c_comm_only']:.3f})"
            f"  | CPU time: speed-up {f['cpu_speedup_2w']:.2f}, c {f['cpu_c_total']:.3f},"
            f" comm share {100 * f['cpu_comm_share_2w']:.1f}%"
        )
    print(f"wrote {args.out_json} and {args.out_png}")


if __name__ == "__main__":
    main()
