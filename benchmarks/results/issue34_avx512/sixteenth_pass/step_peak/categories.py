"""Live tensor bytes by category (torch.profiler's memory profile) at the step's peak and at the forward's end."""
import json, sys, collections
import lightning.pytorch as pl
import torch
from torch.profiler import profile, ProfilerActivity
from lightning_comp import CoMPPrecision
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.zoo.language_models import CharGPT
from lightning_comp.zoo.text import CharTextDataModule
sys.path.insert(0, "benchmarks")
from compare_suite import SUITE

class CB(pl.Callback):
    def __init__(self): self.prof = None
    def on_train_batch_start(self, trainer, m, batch, i):
        if i == 4:
            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True)
            self.prof.__enter__()
    def on_train_batch_end(self, trainer, m, out, batch, i):
        if self.prof:
            self.prof.__exit__(None, None, None)
            mp = self.prof._memory_profile()
            from torch.profiler._memory_profiler import Category

            # timeline: list of (time, action, (key, version), size)
            live = collections.Counter(); cat_of = {}
            best = (0, None, None)
            snapshots = []
            for t, action, (key, version), size in mp.timeline:
                cat = mp._categories.get(key, version)
                name = cat.name if cat is not None else "UNKNOWN"
                if action.name in ("PREEXISTING", "CREATE", "INCREMENT_VERSION"):
                    if action.name == "INCREMENT_VERSION":
                        old = mp._categories.get(key, version - 1)
                        live[old.name if old is not None else "UNKNOWN"] -= size
                    live[name] += size
                elif action.name == "DESTROY":
                    live[name] -= size
                total = sum(live.values())
                if total > best[0]: best = (total, t, dict(live))
            print("peak MiB", round(best[0] / 2**20, 2), {k: round(v / 2**20, 2) for k, v in sorted(best[2].items()) if v})
            self.prof = None
            trainer.should_stop = True

def main(plan_path, precision):
    spec = SUITE[KEY]
    torch.manual_seed(0)
    import lightning_comp.zoo as zoo
    model = getattr(zoo, spec.model)(**spec.model_kwargs)
    dm = getattr(zoo, spec.data)(**spec.data_kwargs)
    plugins, kw = [], {}
    if plan_path != "-":
        plugins = [CoMPPrecision(PrecisionPlan.from_dict(json.load(open(plan_path))))]
    else:
        kw["precision"] = precision
    t = pl.Trainer(max_steps=6, plugins=plugins, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[CB()], **kw)
    t.fit(model, dm)

KEY = "gpt"
if __name__ == "__main__":
    if len(sys.argv) > 3: KEY = sys.argv[3]
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "bf16-mixed")
