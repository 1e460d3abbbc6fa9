"""The zoo's character GPT trained sharded under a CoMP plan: FSDP2 (``ModelParallelStrategy``), FSDP1
(``FSDPStrategy``) or DDP, on embedded text (nothing is downloaded).

    python examples/sharded.py --strategy fsdp2 --devices 2            # fully_shard per block, plan-derived policies
    python examples/sharded.py --strategy fsdp1 --devices 2            # every TransformerBlock its own FSDP unit
    python examples/sharded.py --strategy fsdp2 --plan outputs/.../plan.json   # a plan a search saved (one device/DDP)

On a machine without a GPU it runs on the CPU over gloo (FSDP1 through ``CPUFSDPStrategy``); with GPUs, on them.
The search is not run here, to keep the example short: ``CoMPSearch()`` among the Trainer's callbacks searches under
these strategies as under DDP (the plugin keeps FSDP2 units' policies on each plan it puts in force).
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lightning_comp import CoMPFSDPPrecision, CoMPPrecision, PrecisionPlan
from lightning_comp.distributed import CPUFSDPStrategy, fsdp2_policy
from lightning_comp.zoo import CharGPT, CharTextDataModule
from lightning_comp.zoo.layers import TransformerBlock


class ShardedCharGPT(CharGPT):
    """The zoo's CharGPT, with each transformer block sharded by FSDP2 (``fully_shard`` in ``configure_model``)."""

    def __init__(self, plan: dict[str, Any] | str | None = None, fsdp2: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plan, self.fsdp2 = plan, fsdp2

    def configure_model(self) -> None:
        if not self.fsdp2:
            return
        from torch.distributed.fsdp import fully_shard

        for index, block in enumerate(self.blocks):  # each block all-gathered in the precision its plan implies
            fully_shard(block, mp_policy=fsdp2_policy(self.plan or {}, block, f"blocks.{index}"))
        fully_shard(self)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["fsdp2", "fsdp1", "ddp"], default="fsdp2")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--plan", default=None, help="a plan file (default: every Linear and the attention in bf16)")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    plan = args.plan or {"type:Linear": "bf16", "type:ScaledDotProductAttention": "bf16"}
    torch.manual_seed(0)
    model = ShardedCharGPT(plan=plan, fsdp2=args.strategy == "fsdp2", width=64, depth=2, heads=2, block_size=64)
    if args.strategy == "fsdp2":
        strategy: Any = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
        plugin: CoMPPrecision = CoMPPrecision(plan)
    elif args.strategy == "fsdp1":
        kwargs = {"auto_wrap_policy": {TransformerBlock}}
        strategy = FSDPStrategy(**kwargs) if gpu else CPUFSDPStrategy(**kwargs)
        plugin = CoMPFSDPPrecision(plan)
    else:
        strategy, plugin = "ddp", CoMPPrecision(plan)
    trainer = pl.Trainer(accelerator="gpu" if gpu else "cpu", devices=args.devices, strategy=strategy,
                         plugins=[plugin], max_epochs=1, limit_train_batches=args.steps, limit_val_batches=2,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, datamodule=CharTextDataModule(seq_len=64, num_samples=256, batch_size=8))
    if trainer.global_rank == 0:
        lowered = sorted(n for n, p in plugin.executor.precisions().items() if p.is_low)
        print(f"{args.strategy}: {len(lowered)} operators lowered: {', '.join(lowered)}")
        print(f"val_loss {float(trainer.callback_metrics['val_loss']):.4f}")
        assert isinstance(plugin.plan, PrecisionPlan)
    if torch.distributed.is_initialized():  # Lightning destroys only NCCL groups at exit
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
