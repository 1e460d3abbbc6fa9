"""Where a training step's live-heap peak is, and what runs there: CharGPT (the default example) under a plan."""
import json, sys
import lightning.pytorch as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from lightning_comp import CoMPPrecision
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.measurement.process_memory import heap_in_use, set_malloc_thresholds
from lightning_comp.zoo.language_models import CharGPT
from lightning_comp.zoo.text import CharTextDataModule
sys.path.insert(0, "benchmarks")
from compare_suite import SUITE

STACK = []
NAMES = {}
def _pre(m, a):
    STACK.append(NAMES.get(id(m), type(m).__name__))
def _post(m, a, o):
    if STACK: STACK.pop()
torch.nn.modules.module.register_module_forward_pre_hook(_pre)
torch.nn.modules.module.register_module_forward_hook(_post)

class Probe(TorchDispatchMode):
    def __init__(self): super().__init__(); self.samples = []; self.phase = "fwd"
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        self.samples.append((heap_in_use(), self.phase, name + "@" + (STACK[-1] if STACK else "-")))
        return out

class CB(pl.Callback):
    def __init__(self): self.probe = None; self.result = None
    def on_train_batch_start(self, trainer, m, batch, i):
        if i == 4:
            self.probe = Probe(); self.base = heap_in_use(); self.probe.__enter__()
    def on_before_backward(self, trainer, m, loss):
        if self.probe: self.probe.phase = "bwd"
    def on_before_optimizer_step(self, trainer, m, opt):
        if self.probe: self.probe.phase = "opt"
    def on_train_batch_end(self, trainer, m, out, batch, i):
        if self.probe:
            self.probe.__exit__(None, None, None)
            s = self.probe.samples; self.probe = None
            peak = max(range(len(s)), key=lambda k: s[k][0])
            fwd_end = max((k for k in range(len(s)) if s[k][1] == "fwd"), default=0)
            mib = lambda b: round((b - self.base) / 2**20, 2)
            print("ops", len(s), "peak at op", peak, s[peak][1], s[peak][2], "rise MiB", mib(s[peak][0]),
                  "| at forward end", mib(s[fwd_end][0]), "| max in bwd", mib(max(x[0] for x in s if x[1]=="bwd")))
            # the rise along the step at 20 points
            step = max(1, len(s) // 30)
            print(" ".join(f"{s[k][1][0]}{mib(s[k][0]):.0f}" for k in range(0, len(s), step)))
            jumps = [(k, s[k][2], round((s[k][0] - s[k-1][0]) / 2**20, 2), mib(s[k][0])) for k in range(1, peak + 1) if abs(s[k][0] - s[k-1][0]) > 0.4 * 2**20]
            print("jumps to the peak:", jumps[-25:])
            print("around the peak:", [(k, s[k][1], s[k][2], mib(s[k][0])) for k in range(max(0, peak - 6), min(len(s), peak + 3))])
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
    NAMES.update({id(mod): n for n, mod in model.named_modules()})
    t.fit(model, dm)

KEY = "gpt"
if __name__ == "__main__":
    if len(sys.argv) > 3: KEY = sys.argv[3]
    set_malloc_thresholds()
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "bf16-mixed")
