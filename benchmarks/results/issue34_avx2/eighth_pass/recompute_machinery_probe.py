"""Where the recompute machinery's time goes on the default example's CharGPT (batch 32 x 128)."""
import time, statistics, sys, torch, torch.nn.functional as F
from lightning_comp import PrecisionPlan
from lightning_comp.zoo import CharGPT
from lightning_comp.execution.executor import PlanExecutor, StepKind
import lightning_comp.execution.recompute.recomputer as R
import lightning_comp.execution.recompute.recipe as RP
acc = {"pack": 0.0, "recompute": 0.0, "pre": 0.0, "post": 0.0, "npack": 0}
_pack = R.Recomputer._pack
def pack(self, t):
    s = time.perf_counter(); r = _pack(self, t); acc["pack"] += time.perf_counter() - s; acc["npack"] += 1; return r
R.Recomputer._pack = pack
_rc = RP.Recipe._recompute
def rc(self):
    s = time.perf_counter(); r = _rc(self); acc["recompute"] += time.perf_counter() - s; return r
RP.Recipe._recompute = rc
_wrap = R.Recomputer.wrap
def wrap(self, op, pre_hook, post_hook):
    pre, post = _wrap(self, op, pre_hook, post_hook)
    def p1(*a):
        s = time.perf_counter(); r = pre(*a); acc["pre"] += time.perf_counter() - s; return r
    def p2(*a):
        s = time.perf_counter(); r = post(*a); acc["post"] += time.perf_counter() - s; return r
    return p1, p2
R.Recomputer.wrap = wrap
plans = {"none": {}, "ln": {"blocks.*.ln1": {"saved": "recompute"}, "blocks.*.ln2": {"saved": "recompute"}, "ln_f": {"saved": "recompute"}},
         "act": {"blocks.*.mlp.act": {"saved": "recompute"}}}
runs = {}
for k, p in plans.items():
    torch.manual_seed(0); m = CharGPT(); ex = PlanExecutor(); ex.apply(m, PrecisionPlan.from_dict(p)); runs[k] = (m, ex)
g = torch.Generator().manual_seed(0)
x = torch.randint(0, 256, (32, 128), generator=g); y = torch.randint(0, 256, (32, 128), generator=g)
def step(k):
    m, ex = runs[k]
    with ex.step(StepKind.TRAIN):
        out = m(x); loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    with ex.recomputing():
        loss.backward()
    m.zero_grad(set_to_none=True)
ln = torch.nn.LayerNorm(256); z = torch.randn(32, 128, 256); h = torch.randn(32, 128, 1024)
def lnf():
    with torch.no_grad():
        for _ in range(9): ln(z)
def actf():
    with torch.no_grad():
        for _ in range(4): F.gelu(h)
fns = {**{k: (lambda k=k: step(k)) for k in plans}, "9 ln fwd": lnf, "4 gelu fwd": actf}
times = {k: [] for k in fns}; mach = {k: [] for k in plans}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 30):
    for k, f in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
        for a in acc: acc[a] = 0
        t = time.perf_counter(); f(); times[k].append(time.perf_counter() - t)
        if k in mach: mach[k].append(dict(acc))
W = 3
print("median ms", {k: round(statistics.median(v[W:]) * 1e3, 2) for k, v in times.items()})
print("min ms", {k: round(min(v[W:]) * 1e3, 2) for k, v in times.items()})
for k in ("ln", "act"):
    d = [a - b for a, b in zip(times[k][W:], times["none"][W:])]
    print(k, "paired extra median", round(statistics.median(d) * 1e3, 2), "ms")
for k, v in mach.items():
    print(k, {a: round(statistics.median([m[a] for m in v[W:]]) * (1 if a == "npack" else 1e3), 3) for a in acc})
