"""CoMP on models compiled with ``torch.compile``: the plan is traced into the graph, every operator in its dtype.

Most tests compile with a recording backend: it reads each traced node's dtype and the module it belongs to, and runs
the captured FX graph as it is (seconds, no Inductor). One test compiles with Inductor end to end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_node_safe

from lightning_comp import CoMPPrecision, PlanError, PrecisionPlan, SearchConfigError
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.operators import discover_operators
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.search.state import Phase
from tests.helpers.compile import graph_breaks
from tests.helpers.search_models import WideMLP, fixed_search, loaders, search_trainer

# the node of each operator type whose output dtype is the operator's compute dtype
_MAIN_OPS = {"linear", "conv1d", "batch_norm", "layer_norm", "gelu"}


class GraphRecorder:
    """A ``torch.compile`` backend that records ``{operator: dtype}`` of every traced graph and runs it eagerly."""

    def __init__(self, model: nn.Module, phase: Any = None) -> None:
        self.model = model
        self.phase = phase  # called at each compilation (e.g. the search's phase)
        self.graphs: list[dict[str, torch.dtype]] = []
        self.phases: list[Any] = []
        self.uncacheable: list[str] = []  # why AOTAutograd's cache would bypass a graph (its own check, per node)
        self.autocast_nodes = 0  # the regions' state setters traced into the graphs

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        names = {str(id(module)): name for name, module in iter_operators(self.model)}
        dtypes = {}
        for node in gm.graph.nodes:
            if node.op == "call_function":
                self.autocast_nodes += "autocast" in getattr(node.target, "__name__", "")
                try:
                    check_node_safe(node)
                except BypassAOTAutogradCache as why:
                    self.uncacheable.append(str(why))
            stack = node.meta.get("nn_module_stack")
            if node.op != "call_function" or not stack or getattr(node.target, "__name__", "") not in _MAIN_OPS:
                continue
            owner = names.get(list(stack)[-1])
            if owner is not None:
                dtypes[owner] = node.meta["example_value"].dtype
        self.graphs.append(dtypes)
        self.phases.append(None if self.phase is None else self.phase())
        return gm.forward


class Net(pl.LightningModule):
    """Conv1d, BatchNorm1d, ReLU, Linear, LayerNorm, GELU and a head: autocast and input-cast lowerings together.

    It logs only in ``validation_step``: Lightning 2.6 with PyTorch 2.12/2.13 cannot compile a ``training_step`` that
    calls ``self.log`` (Lightning-AI/pytorch-lightning#21836, with or without CoMP).
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.act = nn.ReLU()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(8 * 16, 32)
        self.ln = nn.LayerNorm(32)
        self.gelu = nn.GELU()
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.flat(self.act(self.bn(self.conv(x))))
        return self.head(self.gelu(self.ln(self.fc(h))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class InnerCompiled(Net):
    """Compiles its layers in ``configure_model``, as Lightning documents (names gain ``_orig_mod``)."""

    def __init__(self, backend: Any = "inductor") -> None:
        super().__init__()
        self.backend = backend

    def configure_model(self) -> None:
        self.body = torch.compile(nn.Sequential(self.conv, self.bn, self.act, self.flat, self.fc, self.ln, self.gelu,
                                                self.head), backend=self.backend)
        del self.conv, self.bn, self.act, self.flat, self.fc, self.ln, self.gelu, self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


PLAN = {"conv": "bf16", "bn": "bf16", "fc": "bf16", "ln": "bf16"}
INNER_PLAN = {"body.0": "bf16", "body.1": "bf16", "body.4": "bf16", "body.5": "bf16"}


def _data(n: int = 64) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, 16, generator=g), torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _fit(tmp_path: Path, model: pl.LightningModule, plan: Any, steps: int = 4) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=1, val_check_interval=2,
                         plugins=[CoMPPrecision(plan)], logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=str(tmp_path))
    trainer.fit(model, _data(), _data(16))
    return trainer


def _compiled(route: str, backend: Any) -> tuple[pl.LightningModule, Any, nn.Module]:
    """The model to hand to ``fit`` compiled by ``route``, its plan, and the module whose operators the graph holds."""
    torch.manual_seed(0)
    if route == "configure_model":
        model: Any = InnerCompiled(backend)
        return model, INNER_PLAN, model
    model = Net()
    if route == "forward":
        model.forward = torch.compile(model.forward, backend=backend)
        return model, PLAN, model
    return torch.compile(model, backend=backend), PLAN, model  # "fit": Lightning unwraps it, compiles the steps


@pytest.mark.slow
@pytest.mark.parametrize("route", ["fit", "forward", "configure_model"])
def test_every_operator_computes_in_its_planned_dtype_inside_one_compiled_graph(tmp_path: Path, route: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    recorder = GraphRecorder(nn.Module())
    fitted, plan, model = _compiled(route, recorder)
    recorder.model = model  # the backend runs at the first compiled call, once the model exists
    trainer = _fit(tmp_path, fitted, plan)
    assert trainer.precision_plugin.compiled
    # the "fit" route compiles validation_step too, where Lightning's self.log breaks the graph on purpose
    ours = [reason for reason in counters["graph_break"] if "_ResultCollection" not in reason]
    assert not ours, ours
    train_graph = recorder.graphs[0]
    names = {name for name, _ in iter_operators(model)}
    assert names == ({"conv", "bn", "act", "flat", "fc", "ln", "gelu", "head"} if route != "configure_model"
                     else {f"body.{i}" for i in range(8)})  # no '_orig_mod' in any name
    expected = {name: (torch.bfloat16 if name in plan else torch.float32) for name in train_graph}
    assert train_graph == expected
    assert len(train_graph) == 6  # conv, bn, fc, ln, gelu, head: every operator with arithmetic was traced
    # The regions are traced as autocast's state setters, which AOTAutograd's cache accepts: a new process loads the
    # compiled graphs from the cache instead of compiling again (a `with torch.autocast` inside the compiled code
    # would put `_enter_autocast` in the graph, which makes the cache bypass).
    assert recorder.autocast_nodes > 0 and recorder.uncacheable == []
    control = GraphRecorder(nn.Module())  # the check sees the bypass where it is

    def with_region(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            return x @ x

    torch.compile(with_region, backend=control)(torch.randn(4, 4))
    assert any("_enter_autocast" in why for why in control.uncacheable), control.uncacheable


@pytest.mark.slow
def test_compiled_training_follows_the_eager_plan_step_for_step(tmp_path: Path) -> None:
    """Same plan, same data: the compiled model (recorded graph run as traced) ends where the eager one does."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = Net()
    _fit(tmp_path, eager, PLAN)
    torch.manual_seed(0)
    model = Net()
    model.forward = torch.compile(model.forward, backend="eager")  # the traced graph, run as traced
    assert _fit(tmp_path, model, PLAN).precision_plugin.compiled
    for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5), name


@pytest.mark.slow
def test_inductor_compiles_the_plan_without_a_graph_break(tmp_path: Path) -> None:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = Net()
    _fit(tmp_path, eager, PLAN, steps=3)
    torch.manual_seed(0)
    model = Net()
    model.forward = torch.compile(model.forward)  # Inductor
    trainer = _fit(tmp_path, model, PLAN, steps=3)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] >= 1
    assert {n: p.value for n, p in trainer.precision_plugin.executor.precisions().items()} == {
        n: PLAN.get(n, "fp32") for n, _ in iter_operators(model)}
    for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values()):
        # Inductor fuses the casts with their neighbours: bf16 rounding may differ in the last bit
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-3), name


@pytest.mark.slow
def test_a_new_plan_is_traced_anew_and_hooks_are_guarded_only_while_fitting(tmp_path: Path) -> None:
    """Dynamo skips guards on module hooks by default: without the plugin turning them on, the graph traced without
    hooks (an all-fp32 plan, the search's warm-up) would go on running under the next plan."""
    torch._dynamo.reset()
    model = Net()
    recorder = GraphRecorder(model)
    model.forward = torch.compile(model.forward, backend=recorder)
    plugin = CoMPPrecision()
    for plan in ({}, {"fc": "bf16"}, {"head": "bf16"}):  # an all-fp32 plan has no hook a guard could notice
        plugin.set_plan(plan)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, plugins=[plugin],
                             logger=False, enable_progress_bar=False, enable_checkpointing=False,
                             enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(model, _data())
        lowered = {n for n, d in recorder.graphs[-1].items() if d == torch.bfloat16}
        assert lowered == set(plan)
        assert torch._dynamo.config.skip_nnmodule_hook_guards  # PyTorch's default is back after the fit


@pytest.mark.slow
def test_graph_breaks_counts_what_dynamo_splits() -> None:
    def split(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        print("", end="")  # a graph break
        return y + 1

    graphs, breaks, reasons = graph_breaks(split, torch.ones(2))
    assert (graphs, breaks) == (2, 1) and len(reasons) == 1
    model = Net()
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict(PLAN), "cpu", compiled=True)
    with executor.step(StepKind.TRAIN):  # calibrates eagerly
        model(torch.randn(2, 4, 16))
    with executor.step(StepKind.TRAIN):
        assert graph_breaks(model, torch.randn(2, 4, 16))[:2] == (1, 0)


def test_operator_names_leave_out_the_compile_wrapper() -> None:
    plain = InnerCompiled(backend="eager")
    compiled = InnerCompiled(backend="eager")
    plain.configure_model()
    compiled.configure_model()
    plain.body = plain.body._orig_mod  # type: ignore[assignment]
    assert [i.name for i in discover_operators(compiled)] == [i.name for i in discover_operators(plain)]
    assert PrecisionPlan.from_dict(INNER_PLAN).resolve(compiled) == PrecisionPlan.from_dict(INNER_PLAN).resolve(plain)


def test_saved_precision_is_refused_on_a_compiled_model(tmp_path: Path) -> None:
    refused = (r"saves tensors for backward other than as computed \(fc: in a lower precision, or recomputed\)"
               r".*torch.compile")
    for saved in ("fp8", "recompute"):
        with pytest.raises(PlanError, match=refused):
            PlanExecutor().apply(Net(), PrecisionPlan.from_dict({"fc": {"compute": "bf16", "saved": saved}}), "cpu",
                                 compiled=True)
    model = WideMLP()
    model.forward = torch.compile(model.forward, backend="eager")
    search = fixed_search(objective="memory", precisions={"saved": "fp8"})
    train, val = loaders(n_train=256, n_val=64, batch_size=64)
    with pytest.raises(SearchConfigError,
                       match=r"precisions=\{'saved': 'fp8'\}.*compiled with torch.compile.*'auto'\} or 'off'"):
        search_trainer(tmp_path, [search], 2, CoMPPrecision()).fit(model, train, val)


@pytest.mark.slow
def test_the_search_measures_a_compiled_model_eagerly_and_trains_its_choice_compiled(tmp_path: Path) -> None:
    """No graph is traced while the search measures and trials (every plan would be a compilation); the chosen plan
    is traced once the search is done, and it is the plan an uncompiled run chooses: l3 stays fp32."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = WideMLP()
    search = fixed_search()
    recorder = GraphRecorder(model, phase=lambda: search.phase)
    model.forward = torch.compile(model.forward, backend=recorder)
    train, val = loaders()
    trainer = search_trainer(tmp_path, [search], 6, CoMPPrecision())
    trainer.fit(model, train, val)
    assert search.phase == Phase.DONE
    chosen = {n: p.value for n, p in search.chosen_plan["compute"].entries}
    assert chosen == {"l2": "bf16", "l4": "bf16"}
    assert Phase.MEASURING not in recorder.phases and Phase.SEARCHING not in recorder.phases
    assert recorder.phases[0] == Phase.PENDING and recorder.phases[-1] == Phase.DONE
    trained = [g for g, phase in zip(recorder.graphs, recorder.phases) if phase == Phase.DONE]
    assert {n for n, d in trained[0].items() if d == torch.bfloat16} == {"l2", "l4"}


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x * 1.0)
        return self.head(h)


@pytest.mark.slow
def test_an_operator_dynamo_cannot_trace_still_computes_in_its_planned_dtype() -> None:
    """Dynamo breaks the graph at nn.LSTM: a region entered in the graph is not in force in the eager call after the
    break, so compiled steps ran the bf16-planned LSTM in fp32. It now runs outside the graph, hooks included."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Recurrent(), torch.randn(2, 5, 8)
    fp32 = model(x).detach()
    plan = PrecisionPlan.from_dict({"lstm": "bf16"})
    eager = PlanExecutor()
    eager.apply(model, plan, "cpu")
    with eager.step(StepKind.TRAIN):
        planned = model(x).detach()
    eager.remove()
    assert not torch.equal(planned, fp32)
    executor = PlanExecutor()
    executor.apply(model, plan, "cpu", compiled=True)
    compiled = torch.compile(model)  # Inductor: graph state does not leak into the eager LSTM call
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        for _ in range(3):  # calibration (eager), then compiled steps
            with executor.step(StepKind.TRAIN):
                out = compiled(x).detach()
            assert torch.allclose(out, planned, rtol=1e-5, atol=1e-6)
    executor.remove()
    assert "forward" not in model.lstm.__dict__  # its own forward is back


@pytest.mark.slow
def test_a_compiled_forward_dynamo_gives_up_on_still_runs_the_plan(tmp_path: Path) -> None:
    """The graph break at the LSTM makes Dynamo give up on the whole ``forward`` frame and compile the functions it
    calls as frames of their own. Compiled alone, the hooks' helpers lost their regions (and ``compiling()`` answered
    True for ever after): the bf16 head then met a bf16 input with fp32 weights outside any region and raised."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Recurrent(), torch.randn(2, 5, 8)
    plan = PrecisionPlan.from_dict({"lstm": "bf16", "head": "bf16"})
    eager = PlanExecutor()
    eager.apply(model, plan, "cpu")
    with eager.step(StepKind.TRAIN):
        model(x)  # calibrates: the lstm's output stays bf16 into the head
    with eager.step(StepKind.TRAIN):
        planned = model(x).detach()
    eager.remove()
    executor = PlanExecutor()
    executor.apply(model, plan, "cpu", compiled=True)
    model.forward = torch.compile(model.forward)  # type: ignore[method-assign]
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        for _ in range(3):
            with executor.step(StepKind.TRAIN):
                out = model(x).detach()
            assert torch.equal(out, out.bfloat16().float())  # the head computed in bf16: every value a bf16 one
            assert torch.allclose(out, planned, rtol=2e-2, atol=4e-3)  # Inductor's bf16 matmul rounds its own way
    assert executor.chained_operators(StepKind.TRAIN) == frozenset({"lstm"})
