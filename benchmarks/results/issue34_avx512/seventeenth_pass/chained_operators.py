import sys, torch
sys.path.insert(0, "benchmarks")
from compare_suite import SUITE
from lightning_comp import PrecisionPlan
from lightning_comp.execution import PlanExecutor, StepKind
for key in sys.argv[1:]:
    spec = SUITE[key]
    torch.manual_seed(0)
    import lightning_comp.zoo as zoo
    model = getattr(zoo, spec.model)(**spec.model_kwargs)
    dm = getattr(zoo, spec.data)(**spec.data_kwargs)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    ex = PlanExecutor(); ex.apply(model, PrecisionPlan.from_dict({}, default="bf16"), "cpu")
    for _ in range(2):
        with ex.step(StepKind.TRAIN):
            loss = model.training_step(batch, 0)
            loss = loss["loss"] if isinstance(loss, dict) else loss
        loss.backward()
    print(key, sorted(ex.chained_operators(StepKind.TRAIN)))
