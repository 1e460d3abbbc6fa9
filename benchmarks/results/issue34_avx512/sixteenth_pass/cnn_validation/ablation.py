"""Which lever of cnn's balanced plan moves its validation? One variant, one seed, 120 steps, then the whole
validation split (2000 images). Run from the repository root:

    python benchmarks/results/issue34_avx512/sixteenth_pass/cnn_validation/ablation.py PLAN_JSON VARIANT SEED

Variants: fp32 (no plugin), amp (bf16-mixed), full (the plan), compute (its compute entries only), state (compute +
its 8-bit state, FP32 masters), master (compute + its bf16 masters, FP32 state), state_master (compute + both),
bf16state_master (compute + bf16 state where the plan has 8-bit + its masters).
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_comp import CoMPPrecision
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.zoo.images import ShapesDataModule
from lightning_comp.zoo.models import ConvNetBN

STEPS = 120


def plan_of(doc: dict[str, Any], variant: str) -> dict[str, Any]:
    d = copy.deepcopy(doc)
    if variant == "full":
        return d
    d["saved"] = {}
    if variant == "compute":
        d["state"], d["master"] = {}, {}
    elif variant == "state":
        d["master"] = {}
    elif variant == "master":
        d["state"] = {}
    elif variant == "bf16state_master":
        d["state"] = {k: "bf16" for k in doc["state"]}
    return d


def main(plan_path: str, variant: str, seed: int) -> None:
    with open(plan_path) as f:
        doc = json.load(f)
    torch.manual_seed(seed)
    model = ConvNetBN(width=32, depth=3)
    dm = ShapesDataModule(num_samples=10000, batch_size=128)
    plugins: list[Any] = []
    kw: dict[str, Any] = {}
    if variant == "amp":
        kw["precision"] = "bf16-mixed"
    elif variant != "fp32":
        plugins = [CoMPPrecision(PrecisionPlan.from_dict(plan_of(doc, variant)))]
    pl.seed_everything(seed)
    trainer = pl.Trainer(max_steps=STEPS, plugins=plugins, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         check_val_every_n_epoch=1000, **kw)
    trainer.fit(model, dm)
    out = trainer.validate(model, dm, verbose=False)[0]
    print(f"RESULT variant={variant} seed={seed} val_loss={out['val_loss']:.4f} acc={out['val_acc']:.4f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
