"""Train any LightningModule with CoMP from Lightning's own command line (``LightningCLI``).

Nothing CoMP-specific is needed: ``CoMPPrecision`` goes in ``trainer.plugins`` and ``CoMPSearch`` in
``trainer.callbacks``, as ``class_path``/``init_args`` in a YAML file or on the command line::

    pip install -e ".[cli]"
    python examples/cli.py fit --config examples/cli.yaml
    python examples/cli.py fit --config examples/cli.yaml --trainer.callbacks.objective=balanced
    python examples/cli.py fit --model lightning_comp.zoo.NarrowMLP --data lightning_comp.zoo.MNIST1DDataModule \\
        --trainer.plugins=lightning_comp.CoMPPrecision --trainer.callbacks+=lightning_comp.CoMPSearch \\
        --trainer.callbacks.low_precision=bf16
    python examples/cli.py fit --config examples/cli.yaml --ckpt_path <run>/checkpoints/<name>.ckpt  # resume

A resumed run restores the plan (and the search's state) from the checkpoint.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Build the CLI (``args=None`` reads ``sys.argv``); any LightningModule/LightningDataModule by class path."""
    return LightningCLI(args=args, run=run, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
