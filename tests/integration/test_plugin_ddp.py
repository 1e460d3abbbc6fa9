"""CoMPPrecision under 2-process DDP on CPU (gloo): the plan is hooked on every rank, computes in bf16, keeps FP32
masters (and, under ``ddp``, one layer's Adam moments in bf16), and the ranks end with identical parameters.

``strategy="ddp"`` relaunches ``sys.argv`` for rank 1, so each run executes a small script in a fresh interpreter
(never pytest itself); ``ddp_spawn`` goes through the same script for symmetry. Each rank writes what it observed
and its final parameters to a file; the test compares them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

_SCRIPT = textwrap.dedent(
    '''
    import json, os, sys, warnings
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_comp import CoMPPrecision
    from lightning_comp.execution import StepKind

    warnings.filterwarnings("ignore")


    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            if VARIANT == "state":  # optimizer-state precisions apply to Adam/AdamW
                return torch.optim.AdamW(self.parameters(), lr=1e-3)
            return torch.optim.SGD(self.parameters(), lr=0.05)


    class Probe(pl.Callback):
        def __init__(self, out):
            self.out, self.info = out, {"out_dtypes": [], "param_dtypes": set(), "grad_dtypes": set()}

        def on_train_start(self, trainer, pl_module):
            self.info["hooks"] = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in pl_module.modules())
            self.info["backend"] = torch.distributed.get_backend()
            self.info["world_size"] = trainer.world_size
            self.info["wrapped"] = type(trainer.strategy.model).__name__
            pl_module.net[0].register_forward_hook(lambda m, a, o: self.info["out_dtypes"].append(str(o.dtype)))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            for p in pl_module.parameters():
                self.info["param_dtypes"].add(str(p.dtype))
                self.info["grad_dtypes"].add(str(p.grad.dtype))

        def on_train_end(self, trainer, pl_module):
            state = trainer.optimizers[0].state.get(pl_module.net[2].weight, {})
            self.info["state_dtype"] = str(state["exp_avg"].dtype) if "exp_avg" in state else None
            plugin = trainer.precision_plugin
            self.info["chained"] = sorted(plugin.executor.chained_operators(StepKind.TRAIN))
            self.info["plan"] = plugin.plan.to_dict()
            self.info["steps"] = trainer.global_step
            self.info = {k: sorted(v) if isinstance(v, set) else v for k, v in self.info.items()}
            rank = trainer.global_rank
            torch.save(pl_module.state_dict(), os.path.join(self.out, f"rank{rank}.pt"))
            with open(os.path.join(self.out, f"rank{rank}.json"), "w") as f:
                json.dump(self.info, f)


    class ReleaseProcessGroup(pl.Callback):
        """Lightning destroys only NCCL groups at exit; a gloo group left to interpreter shutdown can abort a finished
        rank. Under ddp_spawn the ranks are the spawned workers, so this runs in each rank at the end of the fit."""

        def teardown(self, trainer, pl_module, stage):
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


    VARIANT = sys.argv[3] if len(sys.argv) > 3 else "plain"

    if __name__ == "__main__":
        strategy, out = sys.argv[1], sys.argv[2]
        torch.manual_seed(0)
        model = Net()
        torch.save(model.state_dict(), os.path.join(out, "init.pt"))
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 8, generator=g)
        loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)
        plan = {"type:Linear": "bf16", "type:ReLU": "bf16"}
        if VARIANT == "state":  # net.2 (32x32 = 1024 weights) in bf16 moments, the others the optimizer's own
            plan = {**plan, "net.2": {"compute": "bf16", "state": "bf16"}}
        plugin = CoMPPrecision(plan)
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, plugins=[plugin],
            callbacks=[Probe(out), ReleaseProcessGroup()], logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False,
        )
        trainer.fit(model, loader)
    '''
)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_two_process_ddp_bf16_plan(tmp_path: Path, strategy: str) -> None:
    script = tmp_path / "ddp_script.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    variant = "state" if strategy == "ddp" else "plain"  # ddp also keeps one layer's Adam moments in bf16
    proc = subprocess.run(
        [sys.executable, str(script), strategy, str(tmp_path), variant],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    states = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    init = torch.load(tmp_path / "init.pt", weights_only=True)
    for info in infos:
        assert info["backend"] == "gloo" and info["world_size"] == 2
        assert info["wrapped"] == "DistributedDataParallel"
        assert info["hooks"] == 2 * 5  # the plan is hooked on each rank, once
        assert info["steps"] == 4  # 64 samples / 2 ranks / batch 8
        assert info["chained"] == ["net.0", "net.1"]  # Linear -> ReLU -> Linear stays bf16 between them
        assert info["out_dtypes"][0] == "torch.float32"  # calibration step
        assert set(info["out_dtypes"][1:]) == {"torch.bfloat16"}  # then net.0 hands bf16 to net.1
        assert info["param_dtypes"] == info["grad_dtypes"] == ["torch.float32"]
        expected = {"type:Linear": "bf16", "type:ReLU": "bf16"}
        if variant == "state":  # the plugin steps net.2 itself, from the all-reduced gradients, in bf16 moments
            expected["net.2"] = "bf16"
            assert info["state_dtype"] == "torch.bfloat16" and info["plan"]["state"] == {"net.2": "bf16"}
        assert info["plan"]["entries"] == expected
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), f"{name} differs across ranks"
    assert any(not torch.equal(init[n], states[0][n]) for n in init)  # training did move the weights

