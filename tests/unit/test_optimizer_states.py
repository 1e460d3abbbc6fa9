"""Optimizer-state and master-weight precisions: formats, numerics against FP32 AdamW, conversions and loading."""

from __future__ import annotations

import copy
import inspect
import io
import math

import pytest
import torch
from torch import nn

from lightning_comp import PrecisionPlan
from lightning_comp.errors import PlanError, UnsupportedSetupError
from lightning_comp.execution.adam_step import AdamSettings, adam_step
from lightning_comp.execution.optimizer_states import OptimizerStates, state_bytes
from lightning_comp.execution.parameter_groups import parameter_owners
from lightning_comp.numerics import block_quant
from lightning_comp.numerics.precision import StatePrecision
from lightning_comp.numerics.stochastic_rounding import round_to_bf16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(128, 64)  # 8192 weights: quantised in 8 bits; its 64 biases stay fp32
        self.act = nn.GELU()
        self.head = nn.Linear(64, 4)
        self.pos = nn.Parameter(torch.zeros(4))  # held by no operator: the plan's defaults apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.big(x.to(self.big.weight.dtype)))  # a bf16 master computes in bf16 (as a plan has it)
        return self.head(hidden.to(self.head.weight.dtype)).float() + self.pos


def _train(plan: PrecisionPlan | None, steps: int = 30, optimizer: type = torch.optim.AdamW, seed: int = 0,
           **opt_kwargs: object) -> tuple[Net, torch.optim.Optimizer, list[float]]:
    torch.manual_seed(seed)
    model = Net()
    opt = optimizer(model.parameters(), lr=1e-2, **opt_kwargs)
    states = OptimizerStates()
    states.watch(opt)
    if plan is not None:
        states.assign(model, plan)
    data = torch.Generator().manual_seed(1)
    teacher = torch.randn(128, 4, generator=data) / 8
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 128, generator=data)
        y = x @ teacher
        loss = nn.functional.mse_loss(model(x.to(model.big.weight.dtype)).float(), y)
        loss.backward()
        states.step(opt, opt.step)
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return model, opt, losses


def test_parameters_are_owned_by_the_innermost_operator() -> None:
    owners = {o.name: o.owner for o in parameter_owners(Net())}
    assert owners == {"big.weight": "big", "big.bias": "big", "head.weight": "head", "head.bias": "head",
                      "pos": None}


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_low_precision_state_follows_fp32_adamw(state: str) -> None:
    reference, _, ref_losses = _train(None)
    model, opt, losses = _train(PrecisionPlan.from_dict({"big": {"state": state}}))
    stored = opt.state[model.big.weight]
    assert stored["exp_avg"].dtype == (torch.uint8 if state == "8bit" else torch.bfloat16)
    if state == "8bit":  # one packed tensor per moment, whatever dtype cast a load applies to it
        assert torch.equal(block_quant.unpack(stored["exp_avg"].float(), model.big.weight.shape, True).codes,
                           block_quant.unpack(stored["exp_avg"], model.big.weight.shape, True).codes)
    assert opt.state[model.big.bias]["exp_avg"].dtype == (torch.float32 if state == "8bit" else torch.bfloat16)
    assert opt.state[model.head.weight]["exp_avg"].dtype == torch.float32  # not named: the optimizer's own
    diff = (model.big.weight - reference.big.weight).abs().max() / reference.big.weight.abs().max()
    assert diff < 0.05
    assert losses[-1] < 0.9 * losses[0]
    assert abs(losses[-1] - ref_losses[-1]) < 0.1 * ref_losses[-1]


def test_eight_bit_state_takes_about_a_quarter_of_the_bytes() -> None:
    _, fp32, _ = _train(None, steps=1)
    _, low, _ = _train(PrecisionPlan.from_dict({"big": {"state": "8bit"}}), steps=1)
    big = 8192 * 8  # two fp32 moments of big.weight
    assert state_bytes(fp32) - state_bytes(low) == pytest.approx(big - 8192 * 2 - 2 * 4 * 8192 // 256, abs=8)


def test_unmanaged_parameters_are_stepped_by_the_optimizer_itself() -> None:
    """A first step from the same start has the same gradients: the parameters the plan leaves fp32 get the update
    of the optimizer's own AdamW, bit for bit, while the managed ones are stepped here."""
    reference, ref_opt, _ = _train(None, steps=1)
    model, opt, _ = _train(PrecisionPlan.from_dict({"head": {"state": "bf16"}}), steps=1)
    assert torch.equal(model.big.weight, reference.big.weight)
    assert torch.equal(opt.state[model.big.weight]["exp_avg"], ref_opt.state[reference.big.weight]["exp_avg"])
    assert opt.state[model.head.weight]["exp_avg"].dtype == torch.bfloat16
    assert torch.allclose(model.head.weight, reference.head.weight, atol=1e-4)


_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters
_KINDS = [
    pytest.param(torch.optim.Adam, {}, id="Adam"),
    pytest.param(torch.optim.AdamW, {}, id="AdamW"),
    pytest.param(torch.optim.Adam, {"decoupled_weight_decay": True}, id="Adam-decoupled",
                 marks=pytest.mark.skipif(not _HAS_DECOUPLED, reason="torch's Adam has no decoupled_weight_decay")),
]
_OPTIONS = [
    pytest.param({}, id="plain"),
    pytest.param({"weight_decay": 0.5}, id="decay"),
    pytest.param({"weight_decay": 0.5, "amsgrad": True}, id="decay-amsgrad"),
    pytest.param({"weight_decay": 0.5, "maximize": True}, id="decay-maximize"),
]


def _torch_and_managed(kind: type, options: dict[str, object], precision: StatePrecision, steps: int = 8
                       ) -> tuple[nn.Parameter, nn.Parameter, dict[str, object], dict[str, object]]:
    """The same start, the same gradients: ``steps`` steps of torch's optimizer, and of the managed step with the
    moments in ``precision`` (the settings read from an optimizer of the same class and options)."""
    torch.manual_seed(0)
    start = torch.randn(64, 96)  # 6144 elements
    reference, managed = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    optimizer = kind([reference], lr=1e-2, **options)
    settings = AdamSettings.of(optimizer, optimizer.param_groups[0])
    state: dict[str, object] = {}
    gradients = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grad = torch.randn(start.shape, generator=gradients)
        reference.grad = grad.clone()
        optimizer.step()
        with torch.no_grad():
            adam_step(managed, grad, state, settings, precision, None)
    return reference, managed, optimizer.state[reference], state


@pytest.mark.parametrize(("kind", "extra"), _KINDS)
@pytest.mark.parametrize("options", _OPTIONS)
def test_the_managed_fp32_step_equals_torch_adam(kind: type, extra: dict[str, object],
                                                 options: dict[str, object]) -> None:
    """FP32 moments and master: the managed arithmetic is torch's own (weight decay decoupled or L2 as the
    optimizer's class and group say, AMSGrad, maximize), step by step."""
    reference, managed, torch_state, state = _torch_and_managed(kind, {**extra, **options}, StatePrecision.FP32)
    torch.testing.assert_close(managed.detach(), reference.detach(), rtol=1e-6, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        if key in torch_state:
            torch.testing.assert_close(state[key], torch_state[key], rtol=1e-6, atol=1e-9)
    assert float(state["step"]) == float(torch_state["step"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "extra"), _KINDS)
@pytest.mark.parametrize("options", _OPTIONS)
def test_the_managed_bf16_state_step_follows_torch_adam(kind: type, extra: dict[str, object],
                                                        options: dict[str, object]) -> None:
    """BF16 moments round the moments only: the weights stay within a small fraction of a step of torch's (a
    wrong weight-decay kind would be off by about lr * decay * |w| per step: 5e-3 here)."""
    reference, managed, _, state = _torch_and_managed(kind, {**extra, **options}, StatePrecision.BF16)
    assert state["exp_avg"].dtype == torch.bfloat16  # type: ignore[attr-defined]
    torch.testing.assert_close(managed.detach(), reference.detach(), rtol=0, atol=5e-4)


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
def test_the_managed_path_through_the_manager_follows_torch_adam(kind: type) -> None:
    """Every parameter given bf16 state through a plan: the manager steps them all, close to torch's own."""
    reference, _, _ = _train(None, steps=10, optimizer=kind, weight_decay=0.1)
    model, _, _ = _train(PrecisionPlan.from_dict({}, default={"state": "bf16"}), steps=10, optimizer=kind,
                         weight_decay=0.1)
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=3e-3, rtol=0), kind


def test_adamw_decouples_weight_decay_whatever_its_group_says() -> None:
    """An AdamW decouples by its class (its groups have no ``decoupled_weight_decay`` key before torch 2.6); an
    Adam by its group's key (where torch has it)."""
    p = nn.Parameter(torch.zeros(3))
    adamw = torch.optim.AdamW([p], weight_decay=0.1)
    older_group = {k: v for k, v in adamw.param_groups[0].items() if k != "decoupled_weight_decay"}
    assert AdamSettings.of(adamw, older_group).decoupled
    adam = torch.optim.Adam([p], weight_decay=0.1)
    assert not AdamSettings.of(adam, adam.param_groups[0]).decoupled
    assert AdamSettings.of(adam, {**adam.param_groups[0], "decoupled_weight_decay": True}).decoupled


def test_bf16_master_with_stochastic_rounding_keeps_small_updates() -> None:
    weights = torch.full((20000,), 1.0)
    generator = torch.Generator().manual_seed(0)
    bf16 = weights.to(torch.bfloat16)
    for _ in range(50):
        bf16 = round_to_bf16(bf16.float() - 1e-4, generator)
    assert bf16.float().mean().item() == pytest.approx(1.0 - 50e-4, abs=2e-4)
    nearest = weights.to(torch.bfloat16)
    for _ in range(50):
        nearest = (nearest.float() - 1e-4).to(torch.bfloat16)
    assert nearest.float().mean().item() == 1.0  # round-to-nearest loses every update


@pytest.mark.slow
def test_bf16_master_trains_and_halves_weight_and_gradient_bytes() -> None:
    reference, _, ref_losses = _train(None)
    plan = PrecisionPlan.from_dict({"big": {"compute": "bf16", "master": "bf16", "state": "8bit"}})
    model, opt, losses = _train(plan)
    assert model.big.weight.dtype == torch.bfloat16 and model.head.weight.dtype == torch.float32
    assert abs(losses[-1] - ref_losses[-1]) < 0.15 * ref_losses[-1]
    model(torch.randn(2, 128)).sum().backward()
    assert model.big.weight.grad is not None and model.big.weight.grad.nbytes == reference.big.weight.nbytes // 2
    assert opt.state[model.big.weight]["exp_avg"].numel() == 8192 + 4 * 8192 // 256  # codes, then scale bytes


def test_changing_the_plan_converts_states_and_returns_master_dtypes() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = OptimizerStates()

    def step() -> None:
        model(torch.randn(4, 128)).sum().backward()
        manager.step(opt, opt.step)
        opt.zero_grad()

    step()  # fp32 moments, from the optimizer itself
    manager.assign(model, PrecisionPlan.from_dict({"big": {"state": "8bit", "compute": "bf16", "master": "bf16"}}))
    assert model.big.weight.dtype == torch.bfloat16
    step()  # the fp32 moments are quantised at this step
    assert opt.state[model.big.weight]["exp_avg"].dtype == torch.uint8
    assert float(opt.state[model.big.weight]["step"]) == 2.0
    manager.assign(model, PrecisionPlan())
    assert model.big.weight.dtype == torch.float32  # back to the dtype it had
    step()  # decoded for the optimizer's own step
    assert opt.state[model.big.weight]["exp_avg"].dtype == torch.float32
    assert opt.state[model.big.weight]["exp_avg"].shape == model.big.weight.shape
    untouched = Net().to(torch.bfloat16)  # bf16 of the user's own: a manager leaves it as it is
    OptimizerStates().assign(untouched, PrecisionPlan())
    assert untouched.big.weight.dtype == torch.bfloat16


def test_loading_keeps_the_saved_state_dtypes_bit_exactly() -> None:
    plan = PrecisionPlan.from_dict({"big": {"state": "8bit", "compute": "bf16", "master": "bf16"},
                                    "head": {"compute": "bf16", "master": "bf16"}})
    model, opt, _ = _train(plan, steps=4)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    torch.manual_seed(5)
    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    manager = OptimizerStates()
    manager.watch(fresh_opt)
    manager.assign(fresh, plan)  # master weights bf16 before the optimizer loads, as Lightning's resume does
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key, value in opt.state[p].items():
            assert value.dtype == fresh_opt.state[q][key].dtype and torch.equal(value, fresh_opt.state[q][key]), key


def test_optimizers_other_than_adam_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedSetupError, match="SGD steps parameter 'big.weight'"):
        _train(PrecisionPlan.from_dict({"big": {"state": "8bit"}}), steps=1, optimizer=torch.optim.SGD)


def test_only_fp32_parameters_get_a_bf16_master() -> None:
    model = Net().half()
    with pytest.raises(PlanError, match="'big.weight' is torch.float16"):
        OptimizerStates().assign(model, PrecisionPlan.from_dict({"big": {"compute": "bf16", "master": "bf16"}}))


def test_block_quantisation_matches_torchao_codes() -> None:
    from lightning_comp.adapters.torchao_quant import block_scale, reference_quantise
    from lightning_comp.numerics.block_quant import _tables

    torch.manual_seed(0)
    for signed, values in ((True, torch.randn(1 << 16)), (False, torch.rand(1 << 16) ** 4)):
        quantised = block_quant.QuantisedMoment.quantise(values, signed)
        scaled, _ = block_scale(values, block_quant.BLOCK_SIZE)
        reference = reference_quantise(scaled, _tables(signed, values.device)[0])
        assert (quantised.codes == reference).float().mean() > 0.99
        assert (quantised.codes.int() - reference.int()).abs().max() <= 1
        blocks = values.view(-1, 256).abs().amax(1, keepdim=True)
        error = ((quantised.dequantise() - values).view(-1, 256).abs() / blocks).max()
        assert error < 0.04  # the dynamic map's coarsest step near 1, relative to the block's largest magnitude


def test_states_survive_a_deep_copy() -> None:
    model, opt, _ = _train(PrecisionPlan.from_dict({"big": {"state": "8bit"}}), steps=2)
    copied = copy.deepcopy(opt.state_dict())
    index = [id(p) for p in model.parameters()].index(id(model.big.weight))
    assert copied["state"][index]["exp_avg"].dtype == torch.uint8
    assert torch.equal(copied["state"][index]["exp_avg"], opt.state[model.big.weight]["exp_avg"])


def _second_moment(step: object, steps: int = 2000, n: int = 4096) -> float:
    """The bias-corrected second moment's mean after ``steps`` Adam steps of unit-variance gradients, each applied by
    ``step(p, grad, state, t)`` (the learning rate 0: only the moments move)."""
    torch.manual_seed(0)
    p, state = torch.zeros(n), {}
    for t in range(1, steps + 1):
        step(p, torch.randn(n), state, t)  # type: ignore[operator]
    return float(state["exp_avg_sq"].float().mean()) / (1 - 0.999**steps)


def test_bf16_moments_follow_the_squared_gradients_not_their_high_water_mark() -> None:
    # rounded to nearest, a BF16 second moment changes only where the squared gradient is 3x it or more (beta2 =
    # 0.999): it rises on spikes and never decays (1.30 over 3000 steps); rounded stochastically it follows FP32's
    settings = AdamSettings(lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=True)
    generator = torch.Generator().manual_seed(0)

    def eager(precision: StatePrecision, rounding: torch.Generator | None) -> object:
        return lambda p, g, state, t: adam_step(p, g, state, settings, precision, None, rounding)

    fp32 = _second_moment(eager(StatePrecision.FP32, None))
    assert fp32 == pytest.approx(1.0, abs=0.03)
    assert _second_moment(eager(StatePrecision.BF16, generator)) == pytest.approx(fp32, rel=0.01)
    assert _second_moment(eager(StatePrecision.BF16, None)) > 1.15 * fp32  # what rounding to nearest did

    # the compiled path's function, run as plain torch: hashed bits of its own stream per moment
    from lightning_comp.execution.fused_adam import step_bf16_moments
    from lightning_comp.numerics.stochastic_rounding import rounding_key

    def fused(p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], t: int) -> None:
        if not state:
            state.update(exp_avg=torch.zeros_like(p, dtype=torch.bfloat16),
                         exp_avg_sq=torch.zeros_like(p, dtype=torch.bfloat16))
        hyper = torch.tensor([1.0, 0.0, 1.0, 0.1, 0.999, 0.001, 0.0, math.sqrt(1 - 0.999**t), 1e-8])
        step_bf16_moments(p, g, state["exp_avg"], state["exp_avg_sq"], hyper, False, rounding_key(0, "w", t))

    assert _second_moment(fused) == pytest.approx(fp32, rel=0.01)


def test_the_plugin_rounds_bf16_moments_stochastically() -> None:
    # through the manager: a plan's state="bf16" draws its moments' rounding from the checkpointed generator
    net = nn.Sequential(nn.Linear(64, 64, bias=False))
    weight = net[0].weight
    opt = torch.optim.AdamW(net.parameters(), lr=0.0)
    states = OptimizerStates("eager")
    states.watch(opt)
    states.assign(net, PrecisionPlan.from_dict({"0": {"state": "bf16"}}))
    torch.manual_seed(0)
    for _ in range(2000):
        weight.grad = torch.randn(64, 64)
        states.step(opt, opt.step)
    v = opt.state[weight]["exp_avg_sq"]
    assert v.dtype == torch.bfloat16
    assert float(v.float().mean()) / (1 - 0.999**2000) == pytest.approx(1.0, abs=0.03)
    assert states.rounding_state()  # the generator's state goes into the checkpoint


@pytest.mark.slow
def test_bf16_moments_of_fsdp2_shards_stay_dtensors() -> None:
    # FSDP2's parameters and moments are DTensors: each rank rounds its own shard (a plain tensor of random bits
    # against a DTensor raised "mixed torch.Tensor and DTensor" at the first step)
    import sys

    from tests.helpers.warm_launch import run_warm

    script = """
import os, socket, torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from lightning_comp.execution.adam_step import AdamSettings, adam_step
from lightning_comp.numerics.precision import StatePrecision
mesh = init_device_mesh("cpu", (1,))
p = distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])
settings = AdamSettings(lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=True)
state, generator = {}, torch.Generator().manual_seed(0)
torch.manual_seed(0)
for _ in range(300):
    adam_step(p, distribute_tensor(torch.randn(64, 8), mesh, [Shard(0)]), state, settings, StatePrecision.BF16, None,
              generator)
v = state["exp_avg_sq"]
assert isinstance(v, DTensor) and v.dtype == torch.bfloat16 and v.placements == (Shard(0),), v
mean = float(v.to_local().float().mean()) / (1 - 0.999 ** 300)
assert 0.8 < mean < 1.2, mean
dist.destroy_process_group()
print("ok")
"""
    proc = run_warm([sys.executable, "-c", script], timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-2000:]
