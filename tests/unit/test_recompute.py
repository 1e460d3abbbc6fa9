"""Operators saving ``recompute``: their outputs are recomputed in backward instead of stored (no Trainer here).

Every test compares with the same plan without ``recompute``: losses, gradients, weights and buffers must be
bit-identical (CPU kernels are deterministic), and a probe of outer saved-tensor hooks shows what is still stored.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_comp import PrecisionPlan
from lightning_comp.adapters.torch_internals import top_saved_tensors_hooks
from lightning_comp.errors import CoMPError, PlanError, UsageError
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.execution.recompute import recompute_unsuitable
from lightning_comp.execution.recompute.recipe import FormKey, Recipe
from lightning_comp.operators.kinds import register_atomic
from lightning_comp.search.measurement.clocks import single_intra_op_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_intra_op_thread():
        yield


# -------------------------------------------------------------------------------------------------- helpers
@dataclass
class Probe:
    """Outer saved-tensor hooks: what reaches them (bytes per pack call, and the storages)."""

    nbytes: int = 0
    storages: set[int] = field(default_factory=set)
    dtypes: list[tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=list)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.nbytes += tensor.nbytes
            self.storages.add(tensor.untyped_storage().data_ptr())
            self.dtypes.append((tensor.dtype, tuple(tensor.shape)))
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


@dataclass
class Run:
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    model: nn.Module
    probes: list[Probe]
    executor: PlanExecutor


def train(make: Callable[[], nn.Module], plan: dict[str, Any], batch: Callable[[torch.Generator], tuple[Any, Any]],
          steps: int = 3, backward_in_step: bool = False, seed: int = 0, **executor: Any) -> Run:
    """``steps`` SGD steps of a fresh model under ``plan``, the forward in a training step (backward after it, as
    Lightning runs it, or inside it)."""
    torch.manual_seed(seed)
    model = make()
    ex = PlanExecutor(**executor)
    ex.apply(model, PrecisionPlan.from_dict(plan))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    run = Run([], [], model, [], ex)
    for _ in range(steps):
        x, y = batch(g)
        probe = Probe()
        opt.zero_grad()
        with probe.hooks():
            with ex.step(StepKind.TRAIN):
                out = model(x)
                loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
                if backward_in_step:
                    loss.backward()
            if not backward_in_step:
                with ex.recomputing():
                    loss.backward()
        run.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        run.losses.append(loss.item())
        run.probes.append(probe)
        opt.step()
    return run


def assert_same(a: Run, b: Run) -> None:
    assert a.losses == b.losses
    for ga, gb in zip(a.grads, b.grads):
        assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga), "gradients differ"
    for (na, ta), (nb, tb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert na == nb and torch.equal(ta, tb), f"{na} differs"


def flat_batch(d_in: int = 16, classes: int = 4, n: int = 32) -> Callable[[torch.Generator], tuple[Any, Any]]:
    def make(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g)

    return make


def mlp(act: Callable[[], nn.Module] = nn.GELU) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(nn.Linear(16, 64), act(), nn.Linear(64, 4))


class Counting(nn.Module):
    """Counts the forwards of the module it wraps' class: a subclass mixin."""

    calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        type(self).calls += 1
        return super().forward(*args, **kwargs)  # type: ignore[misc]


# ------------------------------------------------------------------------------------------ what is recomputed
@pytest.mark.parametrize("backward_in_step", [False, True])
def test_a_recomputed_gelu_gives_identical_training_and_stores_nothing_of_its_output(backward_in_step: bool) -> None:
    plain = train(mlp(), {}, flat_batch(), backward_in_step=backward_in_step)
    recomputed = train(mlp(), {"1": {"saved": "recompute"}}, flat_batch(), backward_in_step=backward_in_step)
    assert_same(plain, recomputed)
    gelu_output = 32 * 64 * 4
    for p, r in zip(plain.probes, recomputed.probes):
        assert p.nbytes - r.nbytes == gelu_output  # only fc2's input (the GELU output) is gone: 20740 -> 12548


def test_the_recomputed_output_is_freed_after_forward_and_its_input_shared_with_the_operator() -> None:
    torch.manual_seed(0)
    model = mlp()()
    ex = PlanExecutor()
    ex.apply(model, PrecisionPlan.from_dict({"1": {"saved": "recompute"}}))
    outputs: list[weakref.ref[torch.Tensor]] = []
    model[1].register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    probe = Probe()
    with probe.hooks(), ex.step(StepKind.TRAIN):
        loss = model(torch.randn(8, 16)).sum()
    assert outputs and outputs[0]() is None  # nothing keeps the GELU output alive between forward and backward
    loss.backward()
    assert len(outputs) == 2  # recomputed once in backward
    assert all(p.grad is not None for p in model.parameters())


def test_a_layer_norm_read_by_three_projections_is_recomputed_once_per_backward() -> None:
    class CountingNorm(Counting, nn.LayerNorm):
        calls = 0

    class ThreeHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = CountingNorm(32)
            self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
            self.out = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            return self.out(torch.tanh(self.q(h)) * self.k(h) + self.v(h))

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:  # 3-D: the Linears save views of h
        return torch.randn(4, 8, 32, generator=g), torch.randint(0, 4, (4, 8), generator=g)

    plain = train(ThreeHeads, {}, batch)
    CountingNorm.calls = 0
    recomputed = train(ThreeHeads, {"norm": {"saved": "recompute"}}, batch)
    assert CountingNorm.calls == 3 * 2  # per step: the forward and one recomputation for three consumers
    assert_same(plain, recomputed)
    norm_output = 4 * 8 * 32 * 4
    # without: q, k and v each save h (as a 2-D view); with: none of them stores it
    assert plain.probes[0].nbytes - recomputed.probes[0].nbytes == 3 * norm_output


@pytest.mark.parametrize("act", [nn.Tanh, nn.Sigmoid, nn.ReLU, lambda: nn.Softmax(dim=-1)])
def test_an_operator_saving_its_own_output_stores_a_recipe_for_it_too(act: Callable[[], nn.Module]) -> None:
    plain = train(mlp(act), {}, flat_batch())
    recomputed = train(mlp(act), {"1": {"saved": "recompute"}}, flat_batch())
    assert_same(plain, recomputed)
    output = 32 * 64 * 4  # saved twice without recompute: by the activation itself and by the next Linear
    assert plain.probes[0].nbytes - recomputed.probes[0].nbytes == 2 * output


def _conv_bn_relu() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1),
                         nn.Flatten(), nn.Linear(4 * 8 * 8, 4))


def _images(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def test_a_recomputed_chain_keeps_only_the_first_input_and_updates_running_stats_once() -> None:
    plan = {"1": {"saved": "recompute"}, "2": {"saved": "recompute"}}
    plain = train(_conv_bn_relu, {}, _images)
    recomputed = train(_conv_bn_relu, plan, _images)
    assert_same(plain, recomputed)  # weights, running_mean/var and num_batches_tracked included
    assert int(recomputed.model[1].num_batches_tracked) == 3

    # what reaches the outer hooks: the BatchNorm's input, never its output or the ReLU's
    torch.manual_seed(0)
    model = _conv_bn_relu()
    ex = PlanExecutor()
    ex.apply(model, PrecisionPlan.from_dict(plan))
    seen: dict[str, torch.Tensor] = {}  # (kept alive, so that no later tensor reuses their memory)

    def remember(name: str) -> Callable[[nn.Module, Any, torch.Tensor], None]:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            seen.setdefault(name, out)

        return hook

    for i in (0, 1, 2):
        model[i].register_forward_hook(remember(str(i)))
    probe = Probe()
    x, y = _images(torch.Generator().manual_seed(1))
    with probe.hooks(), ex.step(StepKind.TRAIN):
        loss = F.cross_entropy(model(x), y)
    storage = {name: out.untyped_storage().data_ptr() for name, out in seen.items()}
    assert storage["0"] in probe.storages  # the BatchNorm's input (the first convolution's output)
    assert storage["1"] not in probe.storages and storage["2"] not in probe.storages
    activation = 4 * 8 * 8 * 8 * 4
    assert probe.nbytes == plain.probes[0].nbytes - 2 * activation  # the ReLU output, saved by ReLU and conv 2
    loss.backward()


def test_a_recomputed_container_with_dropout_draws_the_same_masks() -> None:
    @register_atomic
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.drop = nn.Linear(16, 64), nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(F.gelu(self.fc(x)))

    def make() -> nn.Module:
        return nn.Sequential(Block(), nn.Linear(64, 4))

    plain = train(make, {}, flat_batch())
    recomputed = train(make, {"0": {"saved": "recompute"}}, flat_batch())
    assert_same(plain, recomputed)
    assert torch.equal(torch.get_rng_state(), torch.get_rng_state())  # (sanity)

    # a Dropout alone: its output is recomputed with its mask; the RNG after the step is as without recompute
    def dropout_mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.3), nn.Linear(64, 4))

    plain = train(dropout_mlp, {}, flat_batch())
    after_plain = torch.get_rng_state()
    recomputed = train(dropout_mlp, {"1": {"saved": "recompute"}}, flat_batch())
    assert_same(plain, recomputed)
    assert torch.equal(after_plain, torch.get_rng_state())
    assert plain.probes[0].nbytes - recomputed.probes[0].nbytes == 32 * 64 * 4


@pytest.mark.parametrize("backward_in_step", [False, True])
def test_an_operator_computing_in_bf16_recomputes_in_bf16(backward_in_step: bool) -> None:
    plan: dict[str, Any] = {"*": "bf16"}
    plain = train(mlp(), plan, flat_batch(), steps=4, backward_in_step=backward_in_step)
    recomputed = train(mlp(), {"*": "bf16", "1": {"compute": "bf16", "saved": "recompute"}}, flat_batch(), steps=4,
                       backward_in_step=backward_in_step)
    assert_same(plain, recomputed)
    # the same cast boundaries (a recomputation inside a calibrating step does not disturb its tracer)
    assert recomputed.executor.chained_operators(StepKind.TRAIN) == plain.executor.chained_operators(StepKind.TRAIN)
    assert "1" in plain.executor.chained_operators(StepKind.TRAIN)
    # once calibrated, GELU's bf16 output goes straight to fc2, which saved it: no longer stored
    assert plain.probes[-1].nbytes - recomputed.probes[-1].nbytes == 32 * 64 * 2


def test_a_tuple_output_is_recomputed_position_by_position() -> None:
    class SinCos(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.sin(), x.cos()

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.pair, self.a, self.b = nn.Linear(16, 32), SinCos(), nn.Linear(32, 4), nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s, c = self.pair(self.fc(x))
            return self.a(s) + self.b(c)

    plain = train(Model, {}, flat_batch())
    recomputed = train(Model, {"pair": {"saved": "recompute"}}, flat_batch())
    assert_same(plain, recomputed)
    assert plain.probes[0].nbytes - recomputed.probes[0].nbytes == 2 * 32 * 32 * 4


def test_a_tuple_output_with_values_that_hold_no_tensor_is_recomputed_by_its_tensors() -> None:
    """x-transformers' ``RotaryEmbedding`` returns ``(freqs, 1.0)``: the number is returned as it is, the tensor is
    recomputed (the memory search of ``model=x_transformer`` raised a PlanError on it). A tensor nested deeper is
    still refused, naming the operator."""
    class Scaled(nn.Module):
        def __init__(self, nested: bool = False) -> None:
            super().__init__()
            self.nested = nested

        def forward(self, x: torch.Tensor) -> Any:
            return (x.sin(), (x.cos(),)) if self.nested else (x.sin(), 1.0, None)

    class Model(nn.Module):
        def __init__(self, nested: bool = False) -> None:
            super().__init__()
            self.fc, self.pair, self.a = nn.Linear(16, 32), Scaled(nested), nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.pair(self.fc(x))
            return self.a(out[0]) * (out[1] if isinstance(out[1], float) else 1.0)

    plain = train(Model, {}, flat_batch())
    recomputed = train(Model, {"pair": {"saved": "recompute"}}, flat_batch())
    assert_same(plain, recomputed)
    assert plain.probes[0].nbytes - recomputed.probes[0].nbytes == 32 * 32 * 4
    with pytest.raises(PlanError, match=r"'pair' \(Scaled\) saves 'recompute', but its forward returns tuple"):
        train(lambda: Model(nested=True), {"pair": {"saved": "recompute"}}, flat_batch())


# -------------------------------------------------------------------------------------------- chaining hooks
def test_a_compressing_consumer_leaves_a_recomputed_output_to_its_recipe() -> None:
    plan = {"1": {"saved": "recompute"}, "2": {"saved": "fp8"}}
    plain = train(mlp(), {}, flat_batch(), min_saved_bytes=0)
    mixed = train(mlp(), plan, flat_batch(), min_saved_bytes=0)
    assert_same(plain, mixed)  # fc2's input is the recomputed GELU output, not an fp8 copy of it
    assert mixed.executor.saved_tensors.compressed_bytes == 0
    assert not any(dtype == torch.float8_e4m3fn for probe in mixed.probes for dtype, _ in probe.dtypes)


# --------------------------------------------------------------------------------- casts made by consumers
class CastSquare(nn.Module):
    """A consumer casting its input itself: ``mul`` saves the cast (twice: as both operands)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.bfloat16)
        return (h * h).float()


def _square_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), CastSquare(), nn.Linear(64, 4))


def _flatten_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Flatten(), nn.Linear(4 * 16, 4))


def _grouped_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(32, 4, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def _sequence_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8, 16, generator=g), torch.randint(0, 4, (4, 8), generator=g)


@pytest.mark.parametrize(("make", "plan", "batch", "cast_bytes"), [
    # a bf16 Linear's autocast region casts the fp32 GELU output down, and addmm saves the cast
    (mlp(), {"2": "bf16"}, flat_batch(), 32 * 64 * 2),
    # ... of a 3-D output: the matmul saves a 2-D view of the cast
    (mlp(), {"2": "bf16"}, _sequence_batch, 4 * 8 * 64 * 2),
    # ... through Flatten: the cast is of a reshape of the output
    (_flatten_mlp, {"3": "bf16"}, _grouped_batch, 32 * 4 * 16 * 2),
    # an explicit .to(torch.bfloat16) in the model's own code, saved twice by mul
    (_square_mlp, {}, flat_batch(), 2 * 32 * 64 * 2),
], ids=["autocast", "view-of-cast", "cast-of-reshape", "explicit-cast"])
def test_a_consumers_cast_of_a_recomputed_output_is_recomputed_and_cast_again(
        make: Callable[[], nn.Module], plan: dict[str, Any], batch: Callable[[torch.Generator], tuple[Any, Any]],
        cast_bytes: int) -> None:
    plain = train(make, plan, batch)
    recomputed = train(make, {**plan, "1": {"saved": "recompute"}}, batch)
    assert_same(plain, recomputed)
    for p, r in zip(plain.probes, recomputed.probes):  # the first, calibrating, step too
        assert p.nbytes - r.nbytes == cast_bytes
        assert (torch.bfloat16, (32, 64)) not in r.dtypes and (torch.bfloat16, (4, 8, 64)) not in r.dtypes


def test_a_recomputation_holds_only_the_forms_backward_still_asks_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GELU's FP32 output is recomputed to make the BF16 Linear's cast of it; only the cast is held after that
    (the FP32 output used to be held until the Linear's backward ended), and it is freed with the Linear's node."""
    held: list[dict[Any, tuple[torch.dtype, tuple[int, ...]]]] = []
    recipes: list[Recipe] = []
    original = Recipe.form

    def watched(self: Recipe, key: FormKey) -> torch.Tensor:
        made = original(self, key)
        held.append({k: (t.dtype, tuple(t.shape)) for k, t in self.forms.items()})
        recipes.append(self)
        return made

    monkeypatch.setattr(Recipe, "form", watched)
    plain = train(mlp(), {"2": "bf16"}, flat_batch())
    recomputed = train(mlp(), {"2": "bf16", "1": {"saved": "recompute"}}, flat_batch())
    assert_same(plain, recomputed)
    assert held, "nothing was recomputed"
    for forms in held:
        assert list(forms.values()) == [(torch.bfloat16, (32, 64))]
    assert not any(recipe.forms or recipe.wanted for recipe in recipes)  # nothing held once backward is done


def test_a_recompute_operators_input_cast_from_another_ones_output_is_recomputed_from_it() -> None:
    def make() -> nn.Module:  # the bf16 GELU casts the fp32 LayerNorm's output down as its input
        return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))

    plan: dict[str, Any] = {"2": "bf16"}
    plain = train(make, plan, flat_batch())
    recomputed = train(make, {**plan, "1": {"saved": "recompute"}, "2": {"compute": "bf16", "saved": "recompute"}},
                       flat_batch())
    assert_same(plain, recomputed)
    # gone: GELU's bf16 input (the cast, saved by GELU) and its fp32 output (saved by fc2)
    for p, r in zip(plain.probes, recomputed.probes):
        assert p.nbytes - r.nbytes == 32 * 64 * 2 + 32 * 64 * 4


def test_the_calibrating_step_recomputes_what_a_compressing_consumer_saves_as_calibrated_steps_do() -> None:
    """The first step of a plan hands every lowered output on in fp32 (its cast boundaries are being traced) and the
    next bf16 operator casts it down again; a resumed run takes such a step where the uninterrupted one took a
    calibrated step, so the two must give the same gradients: the fp8 consumer compresses the cast in neither."""
    plan = {"0": "bf16", "1": {"compute": "bf16", "saved": "recompute"}, "2": {"compute": "bf16", "saved": "fp8"}}
    torch.manual_seed(0)
    model = mlp()()
    ex = PlanExecutor(min_saved_bytes=0)
    ex.apply(model, PrecisionPlan.from_dict(plan))
    x, y = flat_batch()(torch.Generator().manual_seed(1))

    def step() -> tuple[dict[str, torch.Tensor], Probe]:
        model.zero_grad(set_to_none=True)
        probe = Probe()
        with probe.hooks():
            with ex.step(StepKind.TRAIN):
                loss = F.cross_entropy(model(x), y)
            with ex.recomputing():
                loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, probe

    calibrating, probe_calibrating = step()
    assert {"0", "1"} <= ex.chained_operators(StepKind.TRAIN)  # later steps hand bf16 on from l1 to GELU to l2
    calibrated, probe_calibrated = step()
    assert calibrating.keys() == calibrated.keys()
    assert all(torch.equal(calibrating[k], calibrated[k]) for k in calibrating), "gradients differ"
    assert ex.saved_tensors.compressed_bytes == 0
    for probe in (probe_calibrating, probe_calibrated):
        assert not any(dtype == torch.float8_e4m3fn for dtype, _ in probe.dtypes)
        # GELU's input (l1's output) is stored; l2's input (GELU's output, or its cast) is a recipe in both steps
        assert probe.dtypes.count((torch.bfloat16, (32, 64))) == 1


def test_a_cast_of_an_output_modified_in_place_is_stored_as_it_is() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.act(self.fc1(x))
            with torch.no_grad():
                h.mul_(1.0)  # (same values, but the output is no longer as recorded)
            return self.fc2(h.to(torch.bfloat16).float())

    plain = train(Scaled, {}, flat_batch())
    recomputed = train(Scaled, {"act": {"saved": "recompute"}}, flat_batch())
    assert_same(plain, recomputed)
    assert all(p.nbytes == r.nbytes for p, r in zip(plain.probes, recomputed.probes))


def test_everything_else_is_handed_on_to_the_hooks_in_force_such_as_save_on_cpu() -> None:
    on_cpu = torch.autograd.graph.save_on_cpu()
    handed: list[tuple[int, ...]] = []
    pack = on_cpu.pack_hook
    on_cpu.pack_hook = lambda tensor: handed.append(tuple(tensor.shape)) or pack(tensor)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 4))
    reference = copy.deepcopy(model)
    ex = PlanExecutor()
    ex.apply(model, PrecisionPlan.from_dict({"1": {"saved": "recompute"}}))
    x = torch.randn(32, 16)
    with on_cpu, ex.step(StepKind.TRAIN):
        model(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert (32, 64) in handed  # the LayerNorm's input, saved by it (and held by reference by its recipe)
    assert handed.count((32, 64)) == 1  # its output (fc2's input) is not among them
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))


def test_inside_torch_checkpoint_the_checkpoint_decides_and_says_so() -> None:
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.act, self.b = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.utils.checkpoint.checkpoint(lambda t: self.act(self.a(t)), x, use_reentrant=False))

    plain = train(Checkpointed, {}, flat_batch())
    with pytest.warns(UserWarning, match=r"'act' \(GELU\) saves 'recompute', but it ran inside saved-tensor hooks"):
        recomputed = train(Checkpointed, {"act": {"saved": "recompute"}}, flat_batch())
    assert_same(plain, recomputed)


# --------------------------------------------------------------------------------------------- where it applies
def test_recipes_are_made_only_in_training_steps_that_record_autograd() -> None:
    torch.manual_seed(0)
    model = mlp()()
    ex = PlanExecutor()
    ex.apply(model, PrecisionPlan.from_dict({"1": {"saved": "recompute"}}))
    x = torch.randn(32, 16)
    for kind in (StepKind.VALIDATION, StepKind.TEST, StepKind.PREDICT):
        with ex.step(kind):
            assert top_saved_tensors_hooks() is None
            model(x)
    with torch.no_grad(), ex.step(StepKind.TRAIN):
        assert top_saved_tensors_hooks() is None
        model(x)
    with ex.step(StepKind.TRAIN):
        assert top_saved_tensors_hooks() is not None
        model(x).sum().backward()
    # a validation step with autograd on (a gradient penalty, say) stores the output as computed
    probe = Probe()
    with probe.hooks(), ex.step(StepKind.VALIDATION):
        model(x).sum().backward()
    assert probe.nbytes == (32 * 16 + 2 * 32 * 64 + 64 * 4) * 4  # x, GELU's input and output, fc2's weight


def test_plans_without_recompute_run_without_its_hooks() -> None:
    torch.manual_seed(0)
    model = mlp()()
    ex = PlanExecutor()
    ex.apply(model, PrecisionPlan.from_dict({"*": "bf16", "2": {"compute": "bf16", "saved": "fp8"}}))
    with ex.step(StepKind.TRAIN):
        top = top_saved_tensors_hooks()  # the only step-wide hooks: those storing FP32 copies as their bf16 sources
        assert top is not None and top[0].__qualname__.startswith("UpcastSaver.")
        model(torch.randn(4, 16)).sum().backward()
    assert ex.saved_tensors._defers is None  # compressing operators consult nothing
    hooked = {m: (m._forward_pre_hooks, m._forward_hooks) for m in model}
    assert all("wrap" not in h.__qualname__ for pre, post in hooked.values() for h in (*pre.values(),
                                                                                        *post.values()))


def test_recompute_is_refused_for_a_compiled_model() -> None:
    model = mlp()()
    with pytest.raises(PlanError, match=r"other than as computed \(1: in a lower precision, or recomputed\)"):
        PlanExecutor().apply(model, PrecisionPlan.from_dict({"1": {"saved": "recompute"}}), compiled=True)


# ----------------------------------------------------------------------------------------------------- refusals
def test_an_input_modified_in_place_after_forward_fails_backward_naming_the_operator() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc1(x)
            out = self.fc2(self.act(h))
            h.mul_(2)  # after GELU's forward: its input is not what it was
            return out

    model = Model()
    ex = PlanExecutor()
    ex.apply(model, PrecisionPlan.from_dict({"act": {"saved": "recompute"}}))
    with ex.step(StepKind.TRAIN):
        loss = model(torch.randn(8, 16)).sum()
    with pytest.raises(UsageError, match=r"'act' \(GELU\) saves 'recompute'.*modified in place.*version 0 -> 1"
                                             r".*saved precision as computed \('fp32'\)") as error:
        loss.backward()
    assert isinstance(error.value, CoMPError)


def test_an_operator_returning_no_tensor_fails_at_its_first_step() -> None:
    class Dict(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"out": x.tanh()}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act = nn.Linear(4, 4), Dict()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x))["out"]

    model = Model()
    ex = PlanExecutor()
    ex.apply(model, PrecisionPlan.from_dict({"act": {"saved": "recompute"}}))
    with pytest.raises(PlanError, match=r"'act' \(Dict\) saves 'recompute', but its forward returns dict"), \
            ex.step(StepKind.TRAIN):
        model(torch.randn(2, 4))
    with ex.step(StepKind.VALIDATION):  # elsewhere it runs as usual
        model(torch.randn(2, 4))


def test_an_operator_working_in_place_fails_at_its_first_step() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4))
    ex = PlanExecutor()
    ex.apply(model, PrecisionPlan.from_dict({"1": {"saved": "recompute"}}))
    with pytest.raises(PlanError, match=r"'1' \(ReLU\) saves 'recompute', but its forward modifies its input in"
                                        r" place"), ex.step(StepKind.TRAIN):
        model(torch.randn(2, 4))


class _WithTable(nn.Module):
    """An elementwise operator reading a large constant table."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(1 << 19))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table[: x.shape[-1]]


def test_the_search_is_told_which_operators_not_to_offer_recompute() -> None:
    for module in (nn.GELU(), nn.LayerNorm(4), nn.BatchNorm2d(3), nn.Dropout(), nn.Softmax(-1), nn.Embedding(4, 2),
                   nn.MaxPool2d(2)):
        assert recompute_unsuitable(module) is None, module
    for module, why in ((nn.Linear(2, 2), "matmul"), (nn.Conv2d(1, 1, 1), "matmul"), (nn.LSTM(2, 2), "recurrent"),
                        (nn.Flatten(), "only reshapes"), (nn.ReLU(inplace=True), "in place"),
                        (_WithTable(), "bytes of buffers")):
        reason = recompute_unsuitable(module)
        assert reason is not None and why in reason, (module, reason)


def test_the_executor_pickles_with_its_recomputer() -> None:
    import pickle

    ex = PlanExecutor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clone = pickle.loads(pickle.dumps(ex))
    model = mlp()()
    clone.apply(model, PrecisionPlan.from_dict({"1": {"saved": "recompute"}}))
    with clone.step(StepKind.TRAIN):
        model(torch.randn(2, 16)).sum().backward()


def test_a_leaf_a_trace_found_running_attention_is_not_offered_recompute() -> None:
    """A parameter-free leaf wrapping scaled_dot_product_attention classifies as elementwise; the first step's trace
    finds it running attention work, and recomputing that costs a whole attention forward."""
    from lightning_comp import CoMPPrecision
    from lightning_comp.execution.recompute import recompute_unsuitable
    from lightning_comp.zoo.layers import ScaledDotProductAttention

    attention = ScaledDotProductAttention()
    assert recompute_unsuitable(attention) is None  # untraced: it looks like a cheap elementwise leaf

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attention

        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return self.attn(q, q, q)

    plugin = CoMPPrecision()
    net = Net()
    plugin.convert_module(net)
    plugin.connect(net, [], [])
    with plugin.train_step_context():
        net(torch.randn(2, 2, 8, 4, requires_grad=True)).sum().backward()
    why = recompute_unsuitable(attention)
    assert why is not None and "matmul/convolution/attention" in why
