"""The compiled update path: its 8-bit codec and hashed rounding against their references, its steps against the
eager path's, its choice of path, and its fallback when compiling fails."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_comp import CoMPPrecision
from lightning_comp.errors import ConfigError, UnsupportedSetupError
from lightning_comp.execution import update_path as update_path_module
from lightning_comp.execution.optimizer_states import OptimizerStates, ParameterTreatment
from lightning_comp.execution.update_path import AUTO_MIN_ELEMENTS, CompiledUpdates, UpdatePath
from lightning_comp.numerics.dynamic_codec import decode, encode
from lightning_comp.numerics.precision import MasterPrecision, StatePrecision
from lightning_comp.numerics.stochastic_rounding import round_to_bf16_hashed, rounding_key

N = 64 * 128  # quantisable: 32 blocks of 256


def _scaled_values(signed: bool, n: int = 1 << 18) -> torch.Tensor:
    """Values in [-1, 1] ([0, 1] unsigned) spread over every decade of the map, the map's own values, and its ends."""
    from lightning_comp.numerics.block_quant import value_map

    torch.manual_seed(0)
    values = torch.rand(n) ** 8
    if signed:
        values = values * torch.where(torch.rand(n) < 0.5, -1.0, 1.0)
    ends = [0.0, 1.0, -1.0] if signed else [0.0, 1.0]
    return torch.cat([values, value_map(signed, torch.device("cpu")), torch.tensor(ends)])


@pytest.mark.parametrize("signed", [True, False])
def test_the_arithmetic_codes_are_torchaos_nearest_codes(signed: bool) -> None:
    from lightning_comp.adapters.torchao_quant import reference_quantise
    from lightning_comp.numerics.block_quant import value_map

    qmap = value_map(signed, torch.device("cpu"))
    values = _scaled_values(signed)
    ours, reference = encode(values, signed), reference_quantise(values, qmap)
    assert ours.dtype == torch.uint8
    assert torch.equal(ours[-qmap.numel() - 3:-3] if signed else ours[-qmap.numel() - 2:-2],
                       torch.arange(256, dtype=torch.uint8))  # every map value is its own code
    different = ours != reference
    assert int(different.sum()) <= values.numel() * 1e-4
    assert int((ours.int() - reference.int()).abs().max()) <= 1
    # where they differ, the value sits at the midpoint: both codes are as near, to float rounding
    ours_error = (qmap[ours.long()] - values).abs()
    reference_error = (qmap[reference.long()] - values).abs()
    assert torch.all(ours_error[different] <= reference_error[different] + 1e-6 * values[different].abs() + 1e-12)
    if signed:
        assert int(encode(torch.tensor([-1.0]), True)) == 0  # the map has no -1: its nearest value is the lowest code


@pytest.mark.parametrize("signed", [True, False])
def test_the_arithmetic_decode_gives_every_map_value_and_inverts_encode(signed: bool) -> None:
    from lightning_comp.numerics.block_quant import value_map

    qmap = value_map(signed, torch.device("cpu"))
    codes = torch.arange(256, dtype=torch.uint8)
    values = decode(codes, signed)
    assert values.dtype == torch.float32
    assert torch.all((values - qmap).abs() <= 2e-7 * qmap.abs())
    assert torch.equal(values == 0, qmap == 0) and float(values.max()) == 1.0  # zero and one are exact
    assert torch.equal(encode(values, signed), codes)  # each decoded value encodes back to its own code
    compiled = torch.compile(decode, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(codes.view(16, 16), signed).view(-1), values)


def test_hashed_rounding_is_unbiased_deterministic_and_keyed() -> None:
    values = torch.full((1 << 16,), 1.0 + 2.0**-10)  # a quarter of the way from 1 to the next bf16 value (2^-8 up)
    key = rounding_key(7, "l1.weight", 3)
    rounded = round_to_bf16_hashed(values, key)
    assert rounded.dtype == torch.bfloat16
    assert set(rounded.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert float(rounded.float().mean()) == pytest.approx(1.0 + 2.0**-10, abs=2.0**-7 * 0.02)  # unbiased
    assert torch.equal(round_to_bf16_hashed(values, key), rounded)  # a pure function of its arguments
    assert len({rounding_key(7, "l1.weight", 3), rounding_key(7, "l1.weight", 4), rounding_key(7, "l2.weight", 3),
                rounding_key(8, "l1.weight", 3)}) == 4
    assert not torch.equal(round_to_bf16_hashed(values, rounding_key(7, "l1.weight", 4)), rounded)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    out = round_to_bf16_hashed(special, key).float()
    assert out[0].isnan() and out[1] == float("inf") and out[2] == -float("inf") and out[3] == 0.0


def _unbuildable() -> Any:
    from lightning_comp.errors import NativeBuildError

    raise NativeBuildError("no C compiler")


@pytest.mark.filterwarnings("ignore:The native optimizer step could not be built")
def test_without_the_native_step_auto_compiles_every_rounded_format_on_a_cpu_and_leaves_fp32_moments_eager(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU the compiled step measured faster than the eager one with 8-bit moments (1.5x in training), bf16
    masters (2.7x) and bf16 moments (their stochastic rounding: random bits hashed in the kernel, where the eager step
    draws them from a generator): where the native step cannot be built (it takes them all where it can:
    ``test_native_adam.py``), ``"auto"`` compiles those there; FP32 moments (too small to quantise) stay eager."""
    monkeypatch.setattr(update_path_module, "AUTO_MIN_ELEMENTS", 1)
    monkeypatch.setattr(update_path_module, "native_adam", _unbuildable)
    calls: list[StatePrecision] = []

    def recording_kernel(state: StatePrecision) -> Any:
        def kernel(*args: Any) -> None:
            calls.append(state)

        return kernel

    monkeypatch.setattr(update_path_module, "_kernel", recording_kernel)
    _, _, moments = _run("auto", StatePrecision.BF16, MasterPrecision.FP32, steps=3)
    assert moments.updates.compiled_steps == 2 and calls == [StatePrecision.BF16] * 2
    calls.clear()
    _, _, small = _run("auto", StatePrecision.INT8, MasterPrecision.FP32, steps=3, size=1024)
    assert small.updates.compiled_steps == 0 and not calls  # too small to quantise: FP32 moments, eager
    _, _, codes = _run("auto", StatePrecision.INT8, MasterPrecision.FP32, steps=3)
    assert codes.updates.compiled_steps == 2 and calls == [StatePrecision.INT8] * 2  # the first step creates state
    calls.clear()
    _, _, masters = _run("auto", StatePrecision.FP32, MasterPrecision.BF16, steps=3)
    assert masters.updates.compiled_steps == 2 and calls == [StatePrecision.FP32] * 2
    _, _, forced = _run("compiled", StatePrecision.BF16, MasterPrecision.FP32, steps=3)
    assert forced.updates.compiled_steps == 2


def test_auto_compiles_where_a_step_is_worth_a_compilation() -> None:
    updates = CompiledUpdates("auto")
    assert not updates.begin(AUTO_MIN_ELEMENTS - 1, torch.device("cpu"))
    assert updates.begin(AUTO_MIN_ELEMENTS, torch.device("cpu"))
    assert updates.begin(10, torch.device("cuda"))
    assert not CompiledUpdates("eager").begin(1 << 30, torch.device("cuda"))
    assert CompiledUpdates(UpdatePath.COMPILED).begin(1, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"'fused'.*'eager'.*'compiled'.*'native'.*'auto'"):
        CompiledUpdates("fused")
    with pytest.raises(ConfigError, match="'fused'"):
        CoMPPrecision(update_path="fused")


def _run(path: str, state: StatePrecision, master: MasterPrecision, steps: int = 6, amsgrad: bool = False,
         maximize: bool = False, weight_decay: float = 0.1, optimizer: type = torch.optim.AdamW, size: int = N
         ) -> tuple[torch.Tensor, dict[str, Any], OptimizerStates]:
    """``steps`` steps of one parameter of ``size`` elements (:data:`N`), the LR changing every step."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(size) * 0.1)
    opt = optimizer([p], lr=1e-2, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
    states = OptimizerStates(path)
    if master is MasterPrecision.BF16:
        p.data = p.data.bfloat16()
    states._treatments = {id(p): ParameterTreatment(state, master)}
    states._names = {id(p): "w"}
    gradients = torch.Generator().manual_seed(1)
    for i in range(steps):
        p.grad = torch.randn(size, generator=gradients).to(p.dtype)
        opt.param_groups[0]["lr"] = 1e-2 / (i + 1)
        states.step(opt, opt.step)
    return p.detach().float().clone(), opt.state[p], states


CASES = [(StatePrecision.BF16, MasterPrecision.FP32), (StatePrecision.INT8, MasterPrecision.FP32),
         (StatePrecision.FP32, MasterPrecision.BF16), (StatePrecision.INT8, MasterPrecision.BF16),
         (StatePrecision.BF16, MasterPrecision.BF16)]


@pytest.mark.slow
@pytest.mark.parametrize(("state", "master"), CASES, ids=[f"{s.value}-{m.value}" for s, m in CASES])
def test_the_compiled_step_follows_the_eager_one(state: StatePrecision, master: MasterPrecision) -> None:
    eager, eager_state, _ = _run("eager", state, master)
    compiled, compiled_state, states = _run("compiled", state, master)
    assert states.updates.compiled_steps == 5  # the first step creates the state eagerly
    for key in ("exp_avg", "exp_avg_sq"):
        assert compiled_state[key].dtype == eager_state[key].dtype and compiled_state[key].shape == \
            eager_state[key].shape
    assert float(compiled_state["step"]) == float(eager_state["step"]) == 6
    difference = (compiled - eager).abs()
    if master is MasterPrecision.BF16:
        # each path rounds stochastically from its own random bits: against an FP32 master, as near and unbiased
        exact, _, _ = _run("eager", state, MasterPrecision.FP32)
        eager_error, compiled_error = eager - exact, compiled - exact
        assert float(compiled_error.abs().mean()) <= 1.2 * float(eager_error.abs().mean())
        spacing = float((exact.abs() * 2.0**-8).mean())  # about a bf16 spacing
        assert abs(float(compiled_error.mean())) < 0.05 * spacing and abs(float(eager_error.mean())) < 0.05 * spacing
        assert float(difference.max()) < 1e-2 + 8 * spacing
    elif state is StatePrecision.INT8:
        # the eager table's codes differ from the nearest ones within 2^-11 of a midpoint, the arithmetic codes only
        # at float rounding of it: against FP32 moments, the compiled step is as near as the eager one
        exact, _, _ = _run("eager", StatePrecision.FP32, MasterPrecision.FP32)  # unmanaged: torch's own step
        eager_error, compiled_error = (eager - exact).abs(), (compiled - exact).abs()
        assert float(compiled_error.mean()) <= 1.05 * float(eager_error.mean())
        assert float(compiled_error.max()) <= 1.5 * float(eager_error.max())
        assert float(difference.max()) < 1e-2  # the steps' size: no weight goes its own way
    elif state is StatePrecision.BF16:
        # BF16 moments are rounded stochastically, each path from its own random bits: against FP32 moments, as near
        exact, _, _ = _run("eager", StatePrecision.FP32, MasterPrecision.FP32)  # unmanaged: torch's own step
        eager_error, compiled_error = eager - exact, compiled - exact
        assert float(compiled_error.abs().mean()) <= 1.2 * float(eager_error.abs().mean())
        assert float(difference.max()) < 1e-3  # a few 1e-5 here: a tenth of the smallest step's size
    else:
        assert float(difference.max()) < 1e-6


@pytest.mark.slow
def test_the_compiled_arithmetic_is_torch_adamws() -> None:
    """8-bit and (too small to quantise) FP32 moments, compiled, against torch's FP32 AdamW."""
    torch.manual_seed(0)
    reference = nn.Parameter(torch.randn(N) * 0.1)
    ours = nn.Parameter(reference.detach().clone())
    torch_opt = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW([ours], lr=1e-2, weight_decay=0.1)
    states = OptimizerStates("compiled")
    states._treatments = {id(ours): ParameterTreatment(StatePrecision.INT8, MasterPrecision.FP32)}
    states._names = {id(ours): "w"}
    small = nn.Parameter(torch.randn(100))  # too small to quantise: FP32 moments, the fp32 kernel
    small_reference = nn.Parameter(small.detach().clone())
    opt.add_param_group({"params": [small]})
    torch_opt.add_param_group({"params": [small_reference]})
    states._treatments[id(small)] = ParameterTreatment(StatePrecision.INT8, MasterPrecision.FP32)
    states._names[id(small)] = "b"
    gradients = torch.Generator().manual_seed(1)
    for _ in range(5):
        grad, small_grad = torch.randn(N, generator=gradients), torch.randn(100, generator=gradients)
        reference.grad, ours.grad = grad.clone(), grad.clone()
        small_reference.grad, small.grad = small_grad.clone(), small_grad.clone()
        torch_opt.step()
        states.step(opt, opt.step)
    assert states.updates.compiled_steps == 8
    torch.testing.assert_close(small.detach(), small_reference.detach(), rtol=1e-5, atol=1e-6)
    # 8-bit moments: within the map's quantisation of the update (lr 1e-2 per step at most)
    assert float((ours - reference).abs().max()) < 5 * 1e-2 * 0.1


def _step_shapes(shapes: list[tuple[int, ...]], state: StatePrecision, steps: int = 3) -> OptimizerStates:
    """``steps`` compiled steps of FP32 parameters of ``shapes`` (a new learning rate each step)."""
    params = [nn.Parameter(torch.randn(*shape)) for shape in shapes]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    states = OptimizerStates("compiled")
    states._treatments = {id(p): ParameterTreatment(state, MasterPrecision.FP32) for p in params}
    states._names = {id(p): f"p{i}" for i, p in enumerate(params)}
    for step in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.param_groups[0]["lr"] = 1e-3 / (step + 1)
        states.step(optimizer, optimizer.step)
    return states


@pytest.mark.slow
@pytest.mark.parametrize("state", [StatePrecision.BF16, StatePrecision.INT8])
def test_a_new_learning_rate_or_shape_does_not_recompile(state: StatePrecision) -> None:
    from torch._dynamo.utils import counters

    _step_shapes([(64, 128)], state, steps=2)  # compiled (once per process)
    before = counters["stats"]["unique_graphs"]
    # square and not, matrices and vectors, convolution kernels: Dynamo would guard on each kind of shape
    states = _step_shapes([(128, 128), (256, 64), (8192,), (32, 16, 4, 4), (4096, 3)], state)
    assert states.updates.compiled_steps == 5 * 2
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.slow
def test_amsgrad_and_maximize() -> None:
    eager, _, _ = _run("eager", StatePrecision.BF16, MasterPrecision.FP32, maximize=True, optimizer=torch.optim.Adam)
    compiled, _, states = _run("compiled", StatePrecision.BF16, MasterPrecision.FP32, maximize=True,
                               optimizer=torch.optim.Adam)
    assert states.updates.compiled_steps == 5
    # the two round the BF16 moments from their own random bits (a few 1e-5 apart); not maximising moves 5e-2 away
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-3)
    minimised, _, _ = _run("eager", StatePrecision.BF16, MasterPrecision.FP32, optimizer=torch.optim.Adam)
    assert float((minimised - eager).abs().max()) > 1e-2
    _, _, states = _run("compiled", StatePrecision.BF16, MasterPrecision.FP32, amsgrad=True)
    assert states.updates.compiled_steps == 0  # AMSGrad is stepped eagerly


def _failing_kernel(state: StatePrecision) -> Any:
    def kernel(*args: Any) -> None:
        raise RuntimeError("no C++ compiler found\nmore detail")

    return kernel


@pytest.mark.filterwarnings("ignore:The native optimizer step could not be built")
def test_auto_falls_back_to_eager_with_a_warning_when_compiling_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(update_path_module, "AUTO_MIN_ELEMENTS", 1)
    monkeypatch.setattr(update_path_module, "native_adam", _unbuildable)  # else "auto" steps it natively
    monkeypatch.setattr(update_path_module, "_kernel", _failing_kernel)
    eager, eager_state, _ = _run("eager", StatePrecision.BF16, MasterPrecision.BF16, steps=3)
    with pytest.warns(UserWarning, match=r"could not be compiled \(RuntimeError: no C\+\+ compiler found\)"):
        fallen, state, states = _run("auto", StatePrecision.BF16, MasterPrecision.BF16, steps=3)
    assert states.updates.failure is not None and states.updates.compiled_steps == 0
    assert torch.equal(fallen, eager) and float(state["step"]) == 3  # no step counted twice
    assert torch.equal(state["exp_avg"], eager_state["exp_avg"])


def test_compiled_raises_naming_the_cause_when_compiling_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(update_path_module, "_kernel", _failing_kernel)
    with pytest.raises(UnsupportedSetupError, match=r"update_path='compiled'.*no C\+\+ compiler found.*'auto'"):
        _run("compiled", StatePrecision.BF16, MasterPrecision.FP32, steps=2)
