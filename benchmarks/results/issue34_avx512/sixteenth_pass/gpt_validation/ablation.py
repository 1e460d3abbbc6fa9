"""gpt (the compare's spec), 120 steps under one variant of a plan, then the whole validation split.

Run from the repository root: ``python benchmarks/results/issue34_avx512/sixteenth_pass/gpt_validation/ablation.py
PLAN_JSON VARIANT SEED`` (variants: fp32, amp, full, emb_fp32, emb_fp32_all, compute, no_emb_levers).
"""
from __future__ import annotations

import copy
import json
import sys
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_comp.zoo as zoo
from lightning_comp import CoMPPrecision
from lightning_comp.plan.plan import PrecisionPlan

sys.path.insert(0, "benchmarks")
from compare_suite import SUITE  # noqa: E402


def variant_of(doc: dict[str, Any], variant: str) -> dict[str, Any]:
    d = copy.deepcopy(doc)
    emb = ("tok_emb", "pos_emb")
    if variant == "emb_fp32":
        d["entries"] = {k: v for k, v in d["entries"].items() if k not in emb}
    elif variant == "emb_fp32_all":
        d["entries"] = {k: v for k, v in d["entries"].items() if k not in emb}
        for dim in ("state", "master"):
            d[dim] = {k: v for k, v in d[dim].items() if k not in emb}
    elif variant == "compute":
        d["saved"], d["state"], d["master"] = {}, {}, {}
    elif variant == "no_emb_levers":
        for dim in ("state", "master"):
            d[dim] = {k: v for k, v in d[dim].items() if k not in emb}
    return d


def main(plan_path: str, variant: str, seed: int) -> None:
    spec = SUITE["gpt"]
    torch.manual_seed(seed)
    model = getattr(zoo, spec.model)(**spec.model_kwargs)
    data = getattr(zoo, spec.data)(**spec.data_kwargs)
    kw: dict[str, Any] = {}
    plugins: list[Any] = []
    if variant == "amp":
        kw["precision"] = "bf16-mixed"
    elif variant != "fp32":
        with open(plan_path) as f:
            plugins = [CoMPPrecision(PrecisionPlan.from_dict(variant_of(json.load(f), variant)))]
    pl.seed_everything(seed)
    trainer = pl.Trainer(max_steps=120, plugins=plugins, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         check_val_every_n_epoch=1000, gradient_clip_val=1.0, **kw)
    trainer.fit(model, data)
    out = trainer.validate(model, data, verbose=False)[0]
    print(f"RESULT variant={variant} seed={seed} val_loss={out['val_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
