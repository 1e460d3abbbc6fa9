"""CoMPSearch under 2-process DDP, FSDP2 or FSDP1 on a CPU (gloo), with pinned candidates; every rank writes what it
saw: the plan at each epoch start, whether each trial's start restored the search's snapshot bit for bit on that rank,
the final plan and its full parameters.

    python tests/scripts/sharded_search_run.py MODES OUT [--models mlp,gpt,litgpt] [--resume CKPT] [--kill-at-trial K]
        [--checkpoints DIR]

MODES (comma-separated, each fitting every model in turn, results in ``OUT/<mode>/<model>/``) are ``ddp``, ``fsdp2``
(``fully_shard`` per Linear and on the model, through ``ModelParallelStrategy``; the plugin keeps each unit's
``MixedPrecisionPolicy`` on the plan in force) or ``fsdp1`` (``CPUFSDPStrategy``, root-only). Several fits in one
launch re-create the process group on the same port, which now and then hangs in its first broadcast over gloo: the
tests launch one fit at a time. The models: a ``WideMLP`` whose ``l3`` fails
in bf16, searched with l2, l3 and l4 pinned as candidates; the zoo GPT and litgpt with their attention output and MLP
input projections pinned, the second block's MLP input projection failing in bf16. Nothing depends on how fast
anything is here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_comp import CoMPFSDPPrecision, CoMPPrecision, CoMPSearch  # noqa: E402
from lightning_comp.distributed import CPUFSDPStrategy  # noqa: E402
from lightning_comp.search.rewind.snapshot import TrainingSnapshot  # noqa: E402
from lightning_comp.zoo import CharGPT, CharTextDataModule, LitGPT  # noqa: E402
from tests.helpers.distributed import ReleaseProcessGroup, full_parameters  # noqa: E402
from tests.helpers.search_models import WideMLP, loaders  # noqa: E402


class ShardedWideMLP(WideMLP):
    """WideMLP whose validation loss is worse by 1.0 while ``l3`` computes in bf16 (a stand-in for a layer bf16
    hurts: what is tested is how the search's trials, rewinds and plan behave sharded, not a numerical failure); under
    FSDP2 each Linear is its own unit and the model the root one."""

    def __init__(self, fsdp2: bool) -> None:
        super().__init__(width=256, offset=False)
        self.fsdp2 = fsdp2

    def configure_model(self) -> None:
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            for module in self.children():
                if isinstance(module, nn.Linear):
                    fully_shard(module)
            fully_shard(self)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        plan = self.trainer.precision_plugin.plan
        if plan is not None and plan.of("compute", "l3", nn.Linear).is_low:
            loss = loss + 1.0
        self.log("val_loss", loss, sync_dist=True)


class _Penalised:
    """A language model whose validation loss is worse by 1.0 while ``BAD`` computes low (the stand-in of
    :class:`ShardedWideMLP`); under FSDP2 each transformer block is its own unit and the model the root one."""

    BAD = ""
    fsdp2 = False

    def shard_units(self) -> Any:
        raise NotImplementedError

    def configure_model(self) -> None:
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            for block in self.shard_units():
                fully_shard(block)
            fully_shard(self)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = self.loss(self(x), y)  # type: ignore[attr-defined]
        plan = self.trainer.precision_plugin.plan  # type: ignore[attr-defined]
        if plan is not None and plan.of("compute", self.BAD, nn.Linear).is_low:
            loss = loss + 1.0
        self.log("val_loss", loss, sync_dist=True, batch_size=len(x))  # type: ignore[attr-defined]


class ShardedGPT(_Penalised, CharGPT):
    BAD = "blocks.1.mlp.fc"

    def shard_units(self) -> Any:
        return self.blocks


class ShardedLitGPT(_Penalised, LitGPT):
    BAD = "gpt.transformer.h.1.mlp.fc_1"

    def shard_units(self) -> Any:
        return self.gpt.transformer.h


# per model: the search's pinned candidates and everything else excluded (no decision depends on a timing)
LANGUAGE_SEARCH = {
    "gpt": {"include": ["blocks.*.mlp.fc", "blocks.*.attn.proj"],
            "exclude": ["val_ppl", "tok_emb", "pos_emb", "drop", "*.ln1", "*.ln2", "*.qkv", "*.attn.attn", "*.drop",
                        "*.act", "*.mlp.proj", "ln_f", "head"]},
    "litgpt": {"include": ["gpt.transformer.h.*.mlp.fc_1", "gpt.transformer.h.*.attn.proj"],
               "exclude": ["val_ppl", "gpt.lm_head", "gpt.transformer.wte", "*norm*", "*.qkv", "*.fc_2", "*.mlp.proj",
                           "gpt.transformer.ln_f"]},
}


class Probe(pl.Callback):
    """Per epoch: the plan in force and whether a trial's start restored the snapshot exactly (on this rank)."""

    def __init__(self, search: CoMPSearch, out: Path, kill_at_trial: int | None) -> None:
        self.search, self.out, self.kill_at_trial = search, out, kill_at_trial
        self.epochs: list[Any] = []
        self.rewinds_exact: list[bool] = []
        self.digests: list[float] = []  # the full parameters' sum at each epoch end
        self.first_batches: list[float] = []
        self.starts: list[float] = []
        self._trials_seen = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = full_parameters(trainer, pl_module)
        self.starts.append(sum(float(p.double().sum()) for p in params.values()))
        plan = trainer.precision_plugin.plan
        self.epochs.append([trainer.current_epoch, {s: p.value for s, p in plan["compute"].entries}])
        state = self.search.state
        if len(state.trials) > self._trials_seen and len(state.trials) > 1 and state.snapshot is not None:
            self.rewinds_exact.append(TrainingSnapshot.from_state(state.snapshot).matches(trainer, pl_module))
        self._trials_seen = len(state.trials)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = full_parameters(trainer, pl_module)
        self.digests.append(sum(float(p.double().sum()) for p in params.values()))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if len(self.first_batches) < trainer.current_epoch + 1:
            params = full_parameters(trainer, pl_module)
            self.first_batches.append(sum(float(p.double().sum()) for p in params.values()))
        if self.kill_at_trial is not None and len(self.search.state.trials) == self.kill_at_trial + 1 \
                and self.search.state.searching:
            os.kill(os.getpid(), 9)  # mid-trial, every rank alike: what a lost machine does

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = full_parameters(trainer, pl_module)
        plugin = trainer.precision_plugin
        from lightning_comp.adapters.torch_internals import fsdp2_policy_of
        from lightning_comp.execution.fsdp2_policies import fsdp2_units

        policies = {name or "<root>": str(fsdp2_policy_of(unit).param_dtype) for name, unit in fsdp2_units(pl_module)}
        payload = {"epochs": self.epochs, "rewinds_exact": self.rewinds_exact, "policies": policies,
                   "digests": self.digests, "first_batches": self.first_batches,
                   "starts": self.starts,
                   "final": {s: p.value for s, p in plugin.plan["compute"].entries},
                   "trials": [[t.label, t.verdict.value if t.verdict else None] for t in self.search.state.trials],
                   "phase": self.search.phase, "world_size": trainer.world_size,
                   "cost": {k: v for k, v in (self.search.record or {}).get("cost", {}).items()
                            if k in ("snapshot_seconds", "rewind_seconds")},
                   "params": {n: float(p.double().sum()) for n, p in params.items()}}
        rank = trainer.global_rank
        torch.save(params, self.out / f"rank{rank}.pt")
        (self.out / f"rank{rank}.json").write_text(json.dumps(payload))


def _strategy(mode: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    if mode == "ddp":
        return DDPStrategy(timeout=timedelta(seconds=120))
    if mode == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=120))
    return CPUFSDPStrategy(timeout=timedelta(seconds=120))


def fit(mode: str, model_name: str, out: Path, args: argparse.Namespace) -> None:
    """One search (or, with ``--no-search``, one fixed plan) of ``model_name`` under ``mode``; results into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0)
    pinned: dict[str, Any] = LANGUAGE_SEARCH.get(model_name, {"include": ["l2", "l3", "l4"],
                                                              "exclude": ["l1", "head", "a?"]})
    search = CoMPSearch(low_precision="bf16", **pinned, tolerance=0.05, verbose=False,
                        measurement={"profile_steps": 2, "profile_warmup": 1, "speed_margin": 0.9})
    callbacks: list[Any] = [search, Probe(search, out, args.kill_at_trial), ReleaseProcessGroup()]
    if args.no_search:
        callbacks.pop(0)
    if args.checkpoints:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoints, save_last=True, save_top_k=0))
    plan = {"l2": "bf16", "l4": "bf16"} if args.no_search else None
    plugin = CoMPFSDPPrecision(plan) if mode == "fsdp1" else CoMPPrecision(plan)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=_strategy(mode), max_epochs=3, plugins=[plugin],
                         callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(args.checkpoints), default_root_dir=str(out),
                         num_sanity_val_steps=0)
    if model_name == "mlp":
        train, val = loaders(n_train=512, n_val=128, batch_size=64)
        trainer.fit(ShardedWideMLP(fsdp2=mode == "fsdp2"), train, val, ckpt_path=args.resume)
        return
    size = {"width": 64, "depth": 2, "block_size": 32}
    model: Any = (ShardedGPT(heads=2, **size) if model_name == "gpt"
                  else ShardedLitGPT(heads=4, query_groups=2, **size))
    model.fsdp2 = mode == "fsdp2"
    trainer.fit(model, datamodule=CharTextDataModule(seq_len=32, num_samples=640, batch_size=32),
                ckpt_path=args.resume)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("modes", help="comma-separated: ddp, fsdp2, fsdp1 (each fits every model, in turn)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", default="mlp", help="comma-separated, each fitted in turn: mlp, gpt, litgpt")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--kill-at-trial", type=int, default=None)
    parser.add_argument("--checkpoints", default=None, help="save last.ckpt into this folder at every epoch end")
    parser.add_argument("--no-search", action="store_true", help="train the plan l2, l4 bf16 without a search")
    args = parser.parse_args()
    modes, models = args.modes.split(","), args.models.split(",")
    one = len(models) == len(modes) == 1 or not (args.resume or args.checkpoints)
    known = all(m in ("mlp", "gpt", "litgpt") for m in models) and all(m in ("ddp", "fsdp2", "fsdp1") for m in modes)
    if not known or not one:
        raise SystemExit(f"{args.modes!r} --models {args.models!r}: modes ddp, fsdp2, fsdp1; models mlp, gpt, litgpt;"
                         " one of each with --resume/--checkpoints")
    for mode in modes:  # several fits in one launch: rank 1 runs this script too, fit for fit
        for model_name in models:
            fit(mode, model_name, args.out / mode / model_name, args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
