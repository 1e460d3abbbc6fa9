"""One training run of a small model under a CoMP plan, sharded or not: what ``tests/integration/test_sharded.py``
compares.

    python tests/scripts/sharded_run.py MODE PLAN OUT [--overflow-step K] [--save CKPT] [--resume CKPT] [--no-plan]

MODE is ``reference`` (one process, each global batch as the two ranks' half-batches with their gradients
averaged), ``ddp``, ``fsdp1`` (root-only), ``fsdp1_wrap`` (every Linear its own unit), ``fsdp1_wrap_ac`` (and
activation checkpointing), ``fsdp2`` (``fully_shard`` per Linear and on the body, through
``ModelParallelStrategy``), ``fsdp2_policy`` (the same, each unit with the ``MixedPrecisionPolicy`` the plan
implies). Two epochs of four steps; ``--save`` checkpoints at the end of the first, ``--resume`` goes on from one
(``--no-plan``: with a plugin given no plan, so that the checkpoint's must come back).
PLAN is ``bf16`` or ``fp16`` (Linears and ReLUs lowered). Each rank writes
``rank{r}.json`` (what it saw) and ``rank{r}.pt`` (the full parameters at the end) into OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_comp import CoMPFSDPPrecision, CoMPPrecision  # noqa: E402
from lightning_comp.distributed import CPUFSDPStrategy, fsdp2_policy  # noqa: E402
from tests.helpers.distributed import ReleaseProcessGroup, full_parameters  # noqa: E402

warnings.filterwarnings("ignore")
HALF, STEPS = 8, 4


class Net(pl.LightningModule):
    def __init__(self, manual: bool = False, fsdp2: bool = False, policy_plan: dict[str, str] | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1))
        self.automatic_optimization = not manual
        self.fsdp2 = fsdp2
        self.policy_plan = policy_plan
        self.overflow_step: int | None = None  # rank 1's loss becomes inf at this step (its backward overflows)

    def configure_model(self) -> None:
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            def policy(module: nn.Module, name: str) -> dict[str, Any]:
                return {} if self.policy_plan is None else {"mp_policy": fsdp2_policy(self.policy_plan, module, name)}

            for index, module in enumerate(self.net):
                if isinstance(module, nn.Linear):
                    fully_shard(module, **policy(module, f"net.{index}"))
            fully_shard(self.net, **policy(self.net, "net"))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if self.automatic_optimization:
            loss = nn.functional.mse_loss(self.net(x), y)
            if self.trainer.global_step == self.overflow_step and self.trainer.global_rank == 1:
                loss = loss * float("inf")
            return loss
        optimizer = self.optimizers()
        grads = []
        for half in (slice(0, HALF), slice(HALF, 2 * HALF)):  # each rank's half-batch, as that rank computes it
            optimizer.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.net(x[half]), y[half]))
            grads.append([p.grad.clone() for p in self.parameters()])
        for p, g0, g1 in zip(self.parameters(), *grads, strict=True):  # what the ranks' all-reduce averages
            p.grad = (g0 + g1) / 2
        optimizer.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)  # (FSDP1 cannot load an empty state)

    def train_dataloader(self) -> DataLoader:
        return _data(not self.automatic_optimization, self.trainer.global_rank)


GATHERED = [0]  # bytes FSDP2 all-gathered on this rank


def _count_all_gathers() -> None:
    """Count the bytes of every FSDP2 all-gather (``torch.distributed.all_gather_single``, which it calls)."""
    import torch.distributed as dist

    original = dist.all_gather_single

    def counted(output_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        GATHERED[0] += output_tensor.nbytes
        return original(output_tensor, *args, **kwargs)

    dist.all_gather_single = counted


class Matmuls(TorchDispatchMode):
    """The dtypes of every matmul's floating operands (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in ("mm", "addmm"):
            self.dtypes.add(",".join(sorted({str(a.dtype) for a in args if isinstance(a, torch.Tensor)
                                             and a.is_floating_point()})))
        return func(*args, **(kwargs or {}))


class Probe(pl.Callback):
    def __init__(self, out: Path, overflow_step: int | None, save: str | None = None) -> None:
        self.out, self.overflow_step, self.save = out, overflow_step, save
        self.info: dict[str, Any] = {"matmuls": [], "sharded_between_steps": [], "changed": []}
        self._mode: Matmuls | None = None
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._gathered = GATHERED[0]
        self._mode = Matmuls()
        self._mode.__enter__()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if type(trainer.strategy.model).__name__ == "DistributedDataParallel":
            pl_module.overflow_step = self.overflow_step  # replicated gradients: overflow before the all-reduce

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # between forward and backward: FSDP2 modules must hold their DTensor shards again (not freed full tensors)
        self.info.setdefault("sharded_before_backward", []).append(
            sorted({type(m.weight).__name__ for m in pl_module.modules() if isinstance(m, nn.Linear)}))

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sharded = type(trainer.strategy.model).__name__ != "DistributedDataParallel"
        if sharded and trainer.global_step == self.overflow_step and trainer.global_rank == 1:
            grad = next(p for p in pl_module.parameters() if p.grad is not None).grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("inf")  # an overflow in one rank's gradient shard only
        self._before = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                        for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        self.info["matmuls"].append(sorted(self._mode.dtypes))
        self.info.setdefault("gathered_bytes", []).append(GATHERED[0] - self._gathered)
        self.info["sharded_between_steps"].append(
            sorted({type(m.weight).__name__ for m in pl_module.modules() if isinstance(m, nn.Linear)}))
        after = [(p.to_local() if hasattr(p, "to_local") else p) for p in pl_module.parameters()]
        self.info["changed"].append(any(not torch.equal(a, b) for a, b in zip(self._before, after, strict=True)))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save and trainer.current_epoch == 0:
            trainer.save_checkpoint(self.save)  # a sharded checkpoint under FSDP (a folder), a file under DDP

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        params = full_parameters(trainer, pl_module)
        self.info.update(
            plugin=type(plugin).__name__, wrapped=type(trainer.strategy.model).__name__,
            precisions={n: p.value for n, p in plugin.executor.precisions().items()},
            plan=plugin.plan.to_dict()["entries"], saved=plugin.plan.to_dict()["saved"], steps=trainer.global_step,
            skipped=plugin.skipped_steps,
            scaler=None if plugin.scaler is None else type(plugin.scaler).__name__,
            param_dtypes=sorted({str(p.dtype) for p in params.values()}),
        )
        rank = trainer.global_rank
        self.info["global_step"] = trainer.global_step
        torch.save(params, self.out / f"rank{rank}.pt")
        (self.out / f"rank{rank}.json").write_text(json.dumps(self.info))


def _data(reference: bool, rank: int) -> DataLoader:
    """Rank ``rank``'s half of every global batch (samples r, r + 2, ...), or, for the reference, each global batch
    as the two halves one after the other. (Lightning's distributed sampler is off: this is the split.)"""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * HALF * STEPS, 8, generator=g)
    y = x.sum(1, keepdim=True).sin()
    if not reference:
        return DataLoader(TensorDataset(x[rank::2], y[rank::2]), batch_size=HALF)
    order = [2 * (HALF * k + i) + r for k in range(STEPS) for r in (0, 1) for i in range(HALF)]
    return DataLoader(TensorDataset(x[order], y[order]), batch_size=2 * HALF)


def _strategy(mode: str) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    if mode == "ddp":
        return "ddp"
    if mode.startswith("fsdp2"):
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    kwargs: dict[str, Any] = {}
    if mode in ("fsdp1_wrap", "fsdp1_wrap_ac"):
        kwargs["auto_wrap_policy"] = {nn.Linear}
    if mode == "fsdp1_wrap_ac":
        kwargs["activation_checkpointing_policy"] = {nn.Linear}
    return CPUFSDPStrategy(**kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("plan", choices=["bf16", "fp16"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--overflow-step", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save", default=None, help="save a checkpoint there at the end of the first epoch")
    parser.add_argument("--resume", default=None, help="resume from this checkpoint")
    parser.add_argument("--no-plan", action="store_true", help="give the plugin no plan (a checkpoint's comes back)")
    parser.add_argument("--saved", default=None, help="the Linears save for backward in this precision")
    args = parser.parse_args()
    torch.manual_seed(0)
    plan: dict[str, Any] = {"type:Linear": args.plan, "type:ReLU": args.plan}
    if args.saved:
        plan["type:Linear"] = {"compute": args.plan, "saved": args.saved}
    model = Net(manual=args.mode == "reference", fsdp2=args.mode.startswith("fsdp2"),
                policy_plan=plan if args.mode == "fsdp2_policy" else None)
    if args.mode.startswith("fsdp2"):
        _count_all_gathers()
    plugin_type = CoMPFSDPPrecision if args.mode.startswith("fsdp1") else CoMPPrecision
    plugin = plugin_type(None if args.no_plan else plan, allow_slow_fp16=True)
    distributed = args.mode != "reference"
    trainer = pl.Trainer(
        accelerator="cpu", devices=2 if distributed else 1, strategy=_strategy(args.mode) if distributed else "auto",
        max_epochs=args.epochs, plugins=[plugin], callbacks=[Probe(args.out, args.overflow_step, args.save),
                                                            ReleaseProcessGroup()],
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, use_distributed_sampler=False,
    )
    trainer.fit(model, ckpt_path=args.resume)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # Every result is on disk and the process group is destroyed. Leave without the interpreter's shutdown: in about
    # one CPU FSDP1 run of 20, a worker thread torch leaves joinable aborts it there ("terminate called without an
    # active exception", exit -6) after a correct run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
