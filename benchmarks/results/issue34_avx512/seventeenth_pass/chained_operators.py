"""Which low operators' outputs stay low (the executor's chained set) under an all-bf16 plan, per suite model.

Run from the repository root at two commits to see what a change of the cast boundaries changes:
``python benchmarks/results/issue34_avx512/seventeenth_pass/chained_operators.py gpt cnn litgpt``.
Two training steps: the first traces the modules' own work, the second calibrates the cast boundaries.
"""

from __future__ import annotations

import sys

import torch

import lightning_comp.zoo as zoo
from lightning_comp import PrecisionPlan
from lightning_comp.execution import PlanExecutor, StepKind

sys.path.insert(0, "benchmarks")
from compare_suite import SUITE  # noqa: E402

for key in sys.argv[1:]:
    spec = SUITE[key]
    torch.manual_seed(0)
    model = getattr(zoo, spec.model)(**spec.model_kwargs)
    data = getattr(zoo, spec.data)(**spec.data_kwargs)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict({}, default="bf16"), "cpu")
    for _ in range(2):
        with executor.step(StepKind.TRAIN):
            loss = model.training_step(batch, 0)
        (loss["loss"] if isinstance(loss, dict) else loss).backward()
    print(key, sorted(executor.chained_operators(StepKind.TRAIN)))
