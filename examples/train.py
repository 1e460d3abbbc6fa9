"""Train a zoo model under a chosen precision, with Hydra.

    python examples/train.py                                  # default: char_gpt on text, precision=comp
    python examples/train.py precision=bf16-mixed model=char_lstm
    python examples/train.py -m precision=fp32,bf16-mixed,comp  # one run per precision, summary.txt in the sweep dir
    python examples/train.py ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt trainer.max_epochs=6
    python examples/train.py trainer.devices=2 trainer.strategy=ddp

The configuration is ``conf/config.yaml``, which layers the tree shipped in ``lightning_comp/conf`` (see its
``train.yaml``). Everything a run produces goes to Hydra's output directory: ``checkpoints/`` (best and ``last.ckpt``),
``logs/``, ``results.json``, and with ``precision=comp`` also ``plan.json`` and ``search_record.json``.
"""

from __future__ import annotations

import math

import hydra
import torch.distributed as dist
from omegaconf import DictConfig

from lightning_comp.zoo.runner import run


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Run one training job; return the final ``val_loss`` (an objective for Hydra sweepers)."""
    result = run(cfg)
    if dist.is_available() and dist.is_initialized():
        # Lightning destroys only NCCL groups at exit; a gloo group left to interpreter shutdown can abort the
        # process ("terminate called without an active exception") after a successful run.
        dist.destroy_process_group()
    return float(result["metrics"].get("val_loss", math.nan))


if __name__ == "__main__":
    main()
