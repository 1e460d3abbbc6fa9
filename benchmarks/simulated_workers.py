"""Convergence at many data-parallel workers, simulated on one CPU with MNIST-1D.

Synchronous data-parallel SGD over ``N`` workers, each with a per-worker batch ``b``, averages ``N`` per-worker mean
gradients: exactly the mean gradient of one batch of ``N * b`` samples (all per-worker batches have the same size).
So ``N`` workers are simulated by one process training with a global batch ``N * b``; the script checks that
identity numerically before training (``equivalence_max_abs_diff`` in the JSON).

The number of samples seen is fixed (``--epochs`` over the same training set for every ``N``), so larger ``N`` means
proportionally fewer optimizer steps, which is the honest strong-scaling comparison. Three learning-rate rules share
the same single-worker rate ``lr0`` and the same per-epoch decay ``gamma``:

* ``constant``: ``lr0 * gamma**epoch`` (no scaling with N);
* ``linear``: ``lr0 * N * gamma**epoch`` (Goyal et al. linear scaling, no cap);
* ``worker``: :func:`lightning_comp.distributed.lr_schedule.worker_scaled_lr`, the paper's
  ``min(lr_max, lr0 * N / (1 + N / n_half)) * gamma**epoch`` with ``lr_max = 0.1``;
* ``worker_nocap``: the same saturating rule without the ``lr_max`` cap, to separate the two ingredients.

Reproduce the numbers in ``docs/scaling.md`` with::

    python benchmarks/simulated_workers.py

(5.5 CPU-minutes: about 3 minutes on 2 idle cores, 12 minutes measured on a VM shared with other jobs;
``--quick`` for a 30-second smoke run).
"""

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import run_header, write_json  # noqa: E402

from lightning_comp.distributed.lr_schedule import worker_scaled_lr  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Schedule(str, Enum):
    """Learning-rate rule as a function of the simulated worker count."""

    CONSTANT = "constant"
    LINEAR = "linear"
    WORKER = "worker"
    WORKER_NOCAP = "worker_nocap"


class OptimizerKind(str, Enum):
    """Optimizers compared (SGD is where linear scaling is motivated; the paper used Adam)."""

    SGD = "sgd"
    ADAM = "adam"


@dataclass(frozen=True)
class RunConfig:
    """One training run."""

    workers: int
    schedule: Schedule
    optimizer: OptimizerKind
    lr0: float
    seed: int
    epochs: int
    per_worker_batch: int
    gamma: float
    lr_max: float
    n_half: float

    def lr(self, epoch: int) -> float:
        """Learning rate of ``epoch`` under this run's rule."""
        if self.schedule is Schedule.CONSTANT:
            return self.lr0 * self.gamma**epoch
        if self.schedule is Schedule.LINEAR:
            return self.lr0 * self.workers * self.gamma**epoch
        lr_max = math.inf if self.schedule is Schedule.WORKER_NOCAP else self.lr_max
        return worker_scaled_lr(self.lr0, self.workers, epoch, lr_max, self.n_half, self.gamma)


@dataclass(frozen=True)
class Data:
    """MNIST-1D tensors."""

    x: torch.Tensor
    y: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor


def load_mnist1d(num_samples: int, seed: int = 42) -> Data:
    """Generate MNIST-1D locally (no download); 80/20 train/validation split."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    raw = make_dataset(args)
    return Data(
        x=torch.tensor(raw["x"], dtype=torch.float32),
        y=torch.tensor(raw["y"], dtype=torch.long),
        x_val=torch.tensor(raw["x_test"], dtype=torch.float32),
        y_val=torch.tensor(raw["y_test"], dtype=torch.long),
    )


def make_model(seed: int) -> nn.Module:
    """A 2-hidden-layer MLP (about 78k parameters)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(40, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def make_optimizer(kind: OptimizerKind, params: Any, lr: float) -> torch.optim.Optimizer:
    """SGD with momentum 0.9, or Adam with default betas."""
    if kind is OptimizerKind.SGD:
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


def check_equivalence(data: Data, workers: int = 8, per_worker_batch: int = 8) -> float:
    """Max |difference| between the mean of N per-worker gradients and the gradient of one N*b batch."""
    model = make_model(0)
    params = list(model.parameters())
    x, y = data.x[: workers * per_worker_batch], data.y[: workers * per_worker_batch]
    big = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), params)
    averaged = [torch.zeros_like(g) for g in big]
    for w in range(workers):
        sl = slice(w * per_worker_batch, (w + 1) * per_worker_batch)
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(x[sl]), y[sl]), params)
        for acc, g in zip(averaged, grads, strict=True):
            acc += g / workers
    return max(float((a - b).abs().max()) for a, b in zip(averaged, big, strict=True))


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean cross-entropy and accuracy; ``(nan, nan)`` if the output is not finite."""
    out = model(x)
    if not torch.isfinite(out).all():
        return math.nan, math.nan
    return float(nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


_DATA: Data | None = None


def _init_worker(num_samples: int) -> None:
    global _DATA
    torch.set_num_threads(1)
    _DATA = load_mnist1d(num_samples)


def train(cfg: RunConfig) -> dict[str, Any]:
    """Train one configuration; returns per-epoch curves and final metrics."""
    assert _DATA is not None
    data = _DATA
    model = make_model(cfg.seed)
    optimizer = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr0)
    batch = cfg.workers * cfg.per_worker_batch
    steps_per_epoch = len(data.x) // batch  # drop_last: every update averages exactly N per-worker batches
    generator = torch.Generator().manual_seed(cfg.seed)
    curves: dict[str, list[float]] = {"lr": [], "train_loss": [], "val_loss": [], "val_acc": []}
    diverged = False
    start = time.perf_counter()
    for epoch in range(cfg.epochs):
        lr = cfg.lr(epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr
        perm = torch.randperm(len(data.x), generator=generator)
        for step in range(steps_per_epoch):
            idx = perm[step * batch : (step + 1) * batch]
            loss = nn.functional.cross_entropy(model(data.x[idx]), data.y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        train_loss, _ = evaluate(model, data.x, data.y)
        val_loss, val_acc = evaluate(model, data.x_val, data.y_val)
        for key, value in zip(curves, (lr, train_loss, val_loss, val_acc), strict=True):
            curves[key].append(value)
        if math.isnan(train_loss):
            diverged = True
            break
    return {
        "config": {k: (v.value if isinstance(v, Enum) else v) for k, v in asdict(cfg).items()},
        "steps": steps_per_epoch * cfg.epochs,
        "global_batch": batch,
        "diverged": diverged,
        "final_train_loss": curves["train_loss"][-1],
        "final_val_loss": curves["val_loss"][-1],
        "final_val_acc": curves["val_acc"][-1],
        "best_val_acc": max((a for a in curves["val_acc"] if not math.isnan(a)), default=math.nan),
        "curves": curves,
        "seconds": time.perf_counter() - start,
    }


def _summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and standard deviation over seeds per (optimizer, N, schedule)."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for run in runs:
        c = run["config"]
        groups.setdefault((c["optimizer"], c["workers"], c["schedule"]), []).append(run)
    rows = []
    order = {s.value: i for i, s in enumerate(Schedule)}
    for (opt, n, sched), members in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], order[kv[0][2]])):

        def stat(key: str, members: list[dict[str, Any]] = members) -> tuple[float, float]:
            values = np.array([m[key] for m in members], dtype=float)
            return float(np.mean(values)), float(np.std(values))

        twin = members[0].get("same_run_as", sched)

        rows.append(
            {
                "optimizer": opt,
                "workers": n,
                "schedule": sched,
                "lr_epoch0": members[0]["curves"]["lr"][0],
                "steps": members[0]["steps"],
                "diverged": sum(m["diverged"] for m in members),
                "seeds": len(members),
                "same_run_as": twin if twin != sched else None,
                "val_acc": stat("final_val_acc"),
                "val_loss": stat("final_val_loss"),
                "train_loss": stat("final_train_loss"),
            }
        )
    return rows


def _markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| optimizer | N | schedule | lr (epoch 0) | steps | final val acc | final val loss | final train loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        div = f" ({r['diverged']}/{r['seeds']} diverged)" if r["diverged"] else ""
        same = f" (= {r['same_run_as']})" if r["same_run_as"] else ""
        lines.append(
            f"| {r['optimizer']} | {r['workers']} | {r['schedule']}{same}{div} | {r['lr_epoch0']:.4g} | {r['steps']} | "
            f"{r['val_acc'][0]:.3f} ± {r['val_acc'][1]:.3f} | {r['val_loss'][0]:.3f} ± {r['val_loss'][1]:.3f} | "
            f"{r['train_loss'][0]:.3f} ± {r['train_loss'][1]:.3f} |"
        )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    optimizers = sorted({r["optimizer"] for r in rows})
    fig, axes = plt.subplots(2, len(optimizers), figsize=(5.5 * len(optimizers), 7.5), squeeze=False)
    colors = {"constant": "tab:gray", "linear": "tab:red", "worker": "tab:blue", "worker_nocap": "tab:cyan"}
    for col, opt in enumerate(optimizers):
        ax = axes[0][col]
        for sched, color in colors.items():
            sel = [r for r in rows if r["optimizer"] == opt and r["schedule"] == sched]
            ns = [r["workers"] for r in sel]
            mean = [r["val_acc"][0] for r in sel]
            std = [r["val_acc"][1] for r in sel]
            ax.errorbar(ns, mean, yerr=std, marker="o", capsize=3, color=color, label=sched)
        ax.set_xscale("log")
        ax.set_xlabel("simulated workers N (global batch = 8 N)")
        ax.set_ylabel("final validation accuracy")
        ax.set_title(f"{opt}: same samples seen for every N")
        ax.legend()
        ax = axes[1][col]
        n_max = max(r["workers"] for r in rows)
        for sched, color in colors.items():
            for run in runs:
                c = run["config"]
                if c["optimizer"] == opt and c["schedule"] == sched and c["workers"] == n_max:
                    ax.plot(run["curves"]["val_loss"], color=color, alpha=0.7, label=sched if c["seed"] == 0 else None)
        ax.set_yscale("log")
        ax.set_xlabel("epoch")
        ax.set_ylabel(f"validation loss at N={n_max}")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 8, 32, 100])
    p.add_argument("--optimizers", nargs="+", default=["sgd", "adam"], choices=[o.value for o in OptimizerKind])
    p.add_argument("--lr0-sgd", type=float, default=0.01, help="single-worker rate for SGD (momentum 0.9)")
    p.add_argument("--lr0-adam", type=float, default=1e-3, help="single-worker rate for Adam")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--per-worker-batch", type=int, default=8)
    p.add_argument("--num-samples", type=int, default=10_000, help="MNIST-1D samples (80%% train)")
    p.add_argument("--gamma", type=float, default=0.95, help="per-epoch decay, applied to all schedules")
    p.add_argument("--lr-max", type=float, default=0.1)
    p.add_argument("--n-half", type=float, default=100.0)
    p.add_argument("--jobs", type=int, default=2, help="parallel processes (1 thread each)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 3 epochs, 4000 samples")
    p.add_argument("--out-json", type=Path, default=ROOT / "benchmarks/results/simulated_workers.json")
    p.add_argument("--out-png", type=Path, default=ROOT / "docs/img/simulated_workers.png")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.num_samples = 1, 3, 4000
    if any(n < 1 for n in args.workers):
        p.error(f"--workers must all be >= 1, got {args.workers}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Run every (optimizer, N, schedule, seed) and write the JSON, the plot and a markdown table."""
    args = _parse(argv)
    torch.set_num_threads(1)
    _init_worker(args.num_samples)
    assert _DATA is not None
    equivalence = check_equivalence(_DATA)
    print(f"max |mean of 8 worker grads - grad of 8x batch| = {equivalence:.2e}", flush=True)
    lr0 = {OptimizerKind.SGD: args.lr0_sgd, OptimizerKind.ADAM: args.lr0_adam}
    configs = [
        RunConfig(
            n, sched, opt, lr0[opt], seed, args.epochs, args.per_worker_batch, args.gamma, args.lr_max, args.n_half
        )
        for opt in (OptimizerKind(o) for o in args.optimizers)
        for n in args.workers
        for sched in Schedule
        for seed in range(args.seeds)
    ]
    # Rules that give the same learning rates (all rules at N = 1 but the worker ones; worker_nocap when the cap
    # never binds) are the same deterministic run: train once, copy the result.
    unique: dict[tuple[Any, ...], RunConfig] = {}
    for cfg in configs:
        unique.setdefault((cfg.optimizer, cfg.workers, cfg.seed, tuple(cfg.lr(e) for e in range(cfg.epochs))), cfg)
    todo = sorted(unique.values(), key=lambda c: c.workers)  # longest runs (small N) first
    print(f"{len(configs)} configurations, {len(todo)} distinct runs", flush=True)
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs, initializer=_init_worker, initargs=(args.num_samples,)) as pool:
        done = dict(zip(todo, pool.map(train, todo), strict=True))
    runs = []
    for cfg in configs:
        key = (cfg.optimizer, cfg.workers, cfg.seed, tuple(cfg.lr(e) for e in range(cfg.epochs)))
        run = json.loads(json.dumps(done[unique[key]]))
        run["config"]["schedule"] = cfg.schedule.value
        run["same_run_as"] = unique[key].schedule.value
        runs.append(run)
    rows = _summarise(runs)
    table = _markdown(rows)
    print(table)
    elapsed = time.perf_counter() - start
    print(f"total training time {elapsed:.0f} s with {args.jobs} processes")
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {
        **run_header("simulated_workers.py", argv),
        "args": meta,
        "equivalence_max_abs_diff": equivalence,
        "elapsed_seconds": elapsed,
        "summary": rows,
        "table_markdown": table,
        "runs": runs,
    }
    write_json(args.out_json, result)
    _plot(rows, runs, args.out_png)
    print(f"wrote {args.out_json} and {args.out_png}")


if __name__ == "__main__":
    main()
