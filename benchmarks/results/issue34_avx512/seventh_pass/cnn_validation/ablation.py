"""Which lever of cnn's seed-0 memory plan moves its validation? One variant, one training seed, 120 steps, then the
whole validation split (2000 images; the compare's reads 4 batches). Run from the repository root:

    python benchmarks/results/issue34_avx512/seventh_pass/cnn_validation/ablation.py PLAN_JSON VARIANT SEED

Variants: ``fp32`` (no plugin), ``amp`` (``bf16-mixed``), ``full`` (the plan), ``compute`` (its compute entries
only), ``no_saved`` (without its saved entries), ``only_fp8`` (without its recompute entries), ``no_state`` (without
its 8-bit state), ``only_recompute`` (without its fp8 saved entry), ``all8`` (FP32 compute, 8-bit state on every
Conv2d and Linear), ``ao8`` (FP32, torchao's ``AdamW8bit`` over every parameter), ``c_all8`` / ``c_ao8`` (the plan's
compute, with those), ``st_bf16`` (the plan's compute, bf16 state where the plan has 8-bit).
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
    if variant == "no_saved":
        d["saved"] = {}
    elif variant == "no_state":
        d["state"] = {}
    elif variant == "only_fp8":
        d["saved"] = {k: x for k, x in d["saved"].items() if x == "fp8"}
    elif variant == "only_recompute":
        d["saved"] = {k: x for k, x in d["saved"].items() if x == "recompute"}
    elif variant == "compute":
        d["saved"], d["state"], d["master"] = {}, {}, {}
    return d


def main(plan_path: str, variant: str, seed: int) -> None:
    with open(plan_path) as f:
        doc = json.load(f)
    torch.manual_seed(seed)
    model = ConvNetBN(width=32, depth=3)
    dm = ShapesDataModule(num_samples=10000, batch_size=128)
    plugins: list[Any] = []
    kw: dict[str, Any] = {}
    adamw8 = variant in ("ao8", "c_ao8")
    if adamw8:
        import torchao.optim

        def eight_bit() -> torch.optim.Optimizer:
            return torchao.optim.AdamW8bit(model.parameters(), lr=model.lr, weight_decay=model.weight_decay)

        model.configure_optimizers = eight_bit  # type: ignore[method-assign]
    if variant == "amp":
        kw["precision"] = "bf16-mixed"
    elif variant == "all8":
        plugins = [CoMPPrecision(PrecisionPlan.from_dict({"type:Conv2d": {"state": "8bit"},
                                                          "type:Linear": {"state": "8bit"}}))]
    elif variant in ("c_all8", "st_bf16"):
        d = plan_of(doc, "compute")
        if variant == "c_all8":
            d["state"] = {k: "8bit" for k in d["entries"] if k.endswith(".0") or k == "head"}
        else:
            d["state"] = {k: "bf16" for k in doc["state"]}
        plugins = [CoMPPrecision(PrecisionPlan.from_dict(d))]
    elif variant not in ("fp32", "ao8"):
        plugins = [CoMPPrecision(PrecisionPlan.from_dict(plan_of(doc, "compute" if variant == "c_ao8" else variant)))]
    pl.seed_everything(seed)
    trainer = pl.Trainer(max_steps=STEPS, plugins=plugins, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         check_val_every_n_epoch=1000, **kw)
    trainer.fit(model, dm)
    out = trainer.validate(model, dm, verbose=False)[0]
    print(f"RESULT variant={variant} seed={seed} val_loss={out['val_loss']:.4f} acc={out['val_acc']:.4f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
