"""The native 8-bit update: its arithmetic against the compiled step's (run eagerly as plain torch), its rounding of
BF16 masters, NaN, its place among the update paths, and its build (cache, failures)."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_comp.devices.cpu_features import cpu_features
from lightning_comp.errors import ConfigError, NativeBuildError, UnsupportedSetupError
from lightning_comp.execution import fused_adam, native_build
from lightning_comp.execution import update_path as update_path_module
from lightning_comp.execution.native_adam import native_adam
from lightning_comp.execution.native_build import load_library
from lightning_comp.execution.update_path import _block_aliases
from lightning_comp.numerics import block_quant, dynamic_codec
from lightning_comp.numerics.precision import MasterPrecision, StatePrecision
from lightning_comp.numerics.stochastic_rounding import rounding_key

N = 1 << 14
HYPER = (1.0, 0.0, 1.0 - 1e-4, 0.1, 0.999, 1e-3, 3e-3, 0.05, 1e-8)  # fused_adam.HYPER_PARAMETERS' order


def _native_step(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 hyper: tuple[float, ...], stochastic: bool, key: int) -> None:
    """One parameter's native step (packed 8-bit or dense moments alike)."""
    from lightning_comp.execution.native_adam import NativeStep

    native_adam().step([NativeStep(p, grad, exp_avg, exp_avg_sq, hyper, stochastic, key)])


def _state(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Weights and gradient of ``dtype``, and two packed 8-bit moments, of :data:`N` elements."""
    torch.manual_seed(seed)
    p, g = (torch.randn(N) * 0.1).to(dtype), (torch.randn(N) * 1e-2).to(dtype)
    m = block_quant.pack(block_quant.QuantisedMoment.quantise(torch.randn(N) * 1e-3, True))
    v = block_quant.pack(block_quant.QuantisedMoment.quantise(torch.rand(N) * 1e-5, False))
    return p, g, m, v


@pytest.mark.parametrize(("dtype", "stochastic"), [(torch.float32, False), (torch.bfloat16, True),
                                                   (torch.bfloat16, False)], ids=["fp32", "bf16-sr", "bf16-nearest"])
def test_the_native_step_is_the_compiled_steps_arithmetic(dtype: torch.dtype, stochastic: bool) -> None:
    """One step from the same state: the function the compiled path traces, run as plain torch, against the C loop.
    They differ only where the compiled decode's arithmetic (to a relative 2e-7) meets the map's exact values."""
    ours, theirs = _state(dtype), _state(dtype)
    key = rounding_key(7, "w", 3)
    fused_adam.step_8bit_moments(*_block_aliases(*theirs), torch.tensor(HYPER), stochastic, key)
    _native_step(*ours, HYPER, stochastic, key)
    weights, reference = ours[0].float(), theirs[0].float()
    if dtype == torch.bfloat16:
        # the same random bits (the same hash of key and index): the same BF16 weights but where an FP32 update
        # differs in its last bits right at a rounding boundary
        assert int((weights != reference).sum()) <= N * 1e-3
        assert torch.allclose(weights, reference, rtol=2.0**-7, atol=0.0)  # at most a BF16 spacing apart
    else:
        assert float((weights - reference).abs().max()) <= 2e-8  # an FP32 spacing or two at 0.1; 1e-5 of the step
    assert not torch.equal(weights, _state(dtype)[0].float())  # it stepped
    for packed, reference_packed in ((ours[2], theirs[2]), (ours[3], theirs[3])):
        codes, reference_codes = packed[:N].int(), reference_packed[:N].int()
        assert int((codes != reference_codes).sum()) <= N * 1e-3  # midpoints between two codes only
        assert int((codes - reference_codes).abs().max()) <= 1
        scales, reference_scales = packed[N:].view(torch.float32), reference_packed[N:].view(torch.float32)
        assert torch.allclose(scales, reference_scales, rtol=1e-6, atol=0.0)


def test_the_native_step_rounds_bf16_masters_without_bias() -> None:
    """Updates a quarter of a BF16 spacing: rounded to nearest they vanish; rounded stochastically they count."""
    p = torch.full((N,), 1.0, dtype=torch.bfloat16)
    grad = torch.full((N,), 1.0, dtype=torch.bfloat16)
    zeros = block_quant.pack(block_quant.QuantisedMoment.quantise(torch.zeros(N), True))
    spacing = 2.0**-7  # between 1 and the next BF16 value down is 2^-8; the update below moves 2^-10
    hyper = (1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 2.0**-10, 1.0, 0.0)  # m = v^0.5 = g = 1: w -= step_size exactly
    nearest = p.clone()
    _native_step(nearest, grad, zeros.clone(), zeros.clone(), hyper, False, 0)
    assert torch.equal(nearest, p)  # below half a spacing: rounded away
    stochastic = p.clone()
    _native_step(stochastic, grad, zeros.clone(), zeros.clone(), hyper, True, rounding_key(0, "w", 1))
    assert set(stochastic.float().unique().tolist()) == {1.0 - spacing / 2, 1.0}
    assert float(stochastic.float().mean()) == pytest.approx(1.0 - 2.0**-10, abs=spacing * 0.02)


def test_a_nan_gradient_reaches_the_weights_and_the_block_scales() -> None:
    p, g, m, v = _state(torch.float32)
    g[300] = float("nan")  # in the second block
    _native_step(p, g, m, v, HYPER, False, 0)
    assert bool(p[300].isnan()) and not bool(p[:256].isnan().any())
    for packed in (m, v):
        scales = packed[N:].view(torch.float32)
        assert bool(scales[1].isnan()) and not bool(scales[0].isnan()) and not bool(scales[2:].isnan().any())


def _blocks_to_encode() -> torch.Tensor:
    """Blocks of values over every decade of the map and both signs, with the values where an encode can go wrong:
    each threshold between decades and the values one FP32 step either side of it, the zero and one thresholds,
    zeros of both signs, the block's largest magnitude (1 once scaled), and a NaN block."""
    torch.manual_seed(7)
    random = (torch.rand(64, 256) * 2 - 1) * torch.pow(10.0, -8 * torch.rand(64, 256))
    table = dynamic_codec.encoding_table(True) + dynamic_codec.encoding_table(False)
    edges = torch.tensor([t for t in table if 0.0 < t < 1.0], dtype=torch.float32)
    edges = torch.cat([edges, torch.nextafter(edges, torch.zeros(())), torch.nextafter(edges, torch.ones(())),
                       torch.tensor([0.0, -0.0, 1.0, 1e-30])])
    edge_blocks = torch.cat([edges, -edges]).repeat(2 * 256 // (2 * edges.numel()) + 1)[:512].view(2, 256).clone()
    edge_blocks[:, 0] = 1.0  # the scale is 1: the edges are the scaled values themselves
    nan_block = torch.full((1, 256), float("nan"))
    return torch.cat([random, edge_blocks, nan_block])


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_steps_encode_gives_the_portable_codes_and_the_codecs(signed: bool) -> None:
    """Where the build has vector loops (AVX2 without AVX-512) they must give the portable loops' codes exactly, and
    both :func:`dynamic_codec.encode`'s (but for the NaN block, whose scale is NaN: its codes decode to NaN)."""
    blocks = _blocks_to_encode()
    if not signed:
        blocks = blocks.abs()
    finite = blocks[:-1]
    scales = blocks.abs().amax(dim=1).clamp(min=1e-12)  # NaN for the NaN block, as the step's block scale
    kernel = native_adam()
    features = cpu_features()
    if platform.machine() in ("x86_64", "AMD64") and "avx2" in features and "avx512" not in features \
            and kernel.build.native_isa:
        assert kernel.vector_encode  # else the comparison below would be of the portable loops with themselves
    ours, portable = kernel.encode(blocks, scales, signed), kernel.encode(blocks, scales, signed, portable=True)
    assert torch.equal(ours, portable)
    reference = dynamic_codec.encode(finite / scales[:-1, None], signed)
    assert torch.equal(ours[:-1], reference)
    assert len(set(reference.flatten().tolist())) > 200  # the blocks reach most of the map's codes
    with pytest.raises(ConfigError, match=r"\(n, 256\)"):
        kernel.encode(blocks.view(-1, 128), scales, signed)


def _run(path: str, state: StatePrecision, master: MasterPrecision, steps: int = 3, size: int = N) -> Any:
    from tests.unit.test_update_path import _run as run

    return run(path, state, master, steps=steps, size=size)


def test_auto_steps_every_format_natively_on_a_cpu_at_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[StatePrecision] = []
    monkeypatch.setattr(update_path_module, "_kernel", lambda state: lambda *args: compiled.append(state))
    _, state, states = _run("auto", StatePrecision.INT8, MasterPrecision.FP32)
    assert states.updates.native_steps == 2 and states.updates.compiled_steps == 0
    assert state["exp_avg"].dtype == torch.uint8  # the first step created the state eagerly
    for treatment in ((StatePrecision.INT8, MasterPrecision.BF16), (StatePrecision.BF16, MasterPrecision.FP32),
                      (StatePrecision.FP32, MasterPrecision.BF16), (StatePrecision.BF16, MasterPrecision.BF16)):
        _, _, other = _run("auto", *treatment)
        assert other.updates.native_steps == 2, treatment
    _, small_state, small = _run("auto", StatePrecision.INT8, MasterPrecision.FP32, size=1024)
    assert small.updates.native_steps == 2 and small_state["exp_avg"].dtype == torch.float32  # too small: FP32
    assert not compiled
    _, _, forced = _run("compiled", StatePrecision.INT8, MasterPrecision.FP32)
    assert forced.updates.native_steps == 0 and compiled == [StatePrecision.INT8] * 2  # "compiled" is torch.compile
    _, _, eager = _run("eager", StatePrecision.INT8, MasterPrecision.FP32)
    assert eager.updates.native_steps == eager.updates.compiled_steps == 0


@pytest.mark.slow
def test_the_native_step_follows_the_eager_one_over_steps() -> None:
    """Six steps, the LR changing, against the eager 8-bit step and torch's own FP32 AdamW: as near as eager."""
    eager, eager_state, _ = _run("eager", StatePrecision.INT8, MasterPrecision.FP32, steps=6)
    native, native_state, states = _run("native", StatePrecision.INT8, MasterPrecision.FP32, steps=6)
    exact, _, _ = _run("eager", StatePrecision.FP32, MasterPrecision.FP32, steps=6)  # unmanaged: torch's step
    assert states.updates.native_steps == 5 and float(native_state["step"]) == 6
    assert native_state["exp_avg"].dtype == eager_state["exp_avg"].dtype == torch.uint8
    eager_error, native_error = (eager - exact).abs(), (native - exact).abs()
    assert float(native_error.mean()) <= 1.05 * float(eager_error.mean())
    assert float(native_error.max()) <= 1.5 * float(eager_error.max())


def _failing_build() -> Any:
    raise NativeBuildError("No C compiler found (tried $CC, cc, gcc, clang on the PATH)")


def test_native_raises_naming_the_cause_when_it_cannot_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(update_path_module, "native_adam", _failing_build)
    with pytest.raises(UnsupportedSetupError, match=r"update_path='native'.*No C compiler found.*'auto'"):
        _run("native", StatePrecision.INT8, MasterPrecision.FP32)


def test_auto_falls_back_with_a_warning_when_the_native_step_cannot_be_built(monkeypatch: pytest.MonkeyPatch
                                                                            ) -> None:
    eager, eager_state, _ = _run("eager", StatePrecision.INT8, MasterPrecision.FP32)
    monkeypatch.setattr(update_path_module, "native_adam", _failing_build)
    with pytest.warns(UserWarning, match=r"native optimizer step could not be built \(No C compiler found"):
        fallen, state, states = _run("auto", StatePrecision.INT8, MasterPrecision.FP32)
    assert states.updates.native_failure is not None and states.updates.native_steps == 0
    assert torch.equal(fallen, eager) and float(state["step"]) == 3  # eager (small): no step counted twice
    assert torch.equal(state["exp_avg"], eager_state["exp_avg"])


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("LIGHTNING_COMP_CACHE_DIR", str(tmp_path / "cache"))
    load_library.cache_clear()
    yield tmp_path / "cache"
    load_library.cache_clear()


def test_a_build_is_kept_and_reused_by_the_next_process(cache: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    built = load_library(source)
    assert built.library.answer() == 42 and built.path.parent == cache / "kernels" and built.path.exists()
    load_library.cache_clear()  # as a new process: from the cache, not compiled again
    monkeypatch.setattr(native_build, "_compile", lambda *args: pytest.fail("compiled again"))
    assert load_library(source).path == built.path
    load_library.cache_clear()
    source.write_text("int answer(void) { return 43; }\n")  # a changed source builds anew
    monkeypatch.undo()
    monkeypatch.setenv("LIGHTNING_COMP_CACHE_DIR", str(cache))
    rebuilt = load_library(source)
    assert rebuilt.path != built.path and rebuilt.library.answer() == 43
    assert not list(cache.glob("kernels/*.partial"))  # no half-written file left
    # a cached file that does not load (a truncated write) is built again, not skipped for a lesser attempt; a
    # source never loaded in this process, since the loader hands back a loaded library by its path
    load_library.cache_clear()
    source.write_text("int answer(void) { return 44; }\n")
    first_attempt = (*native_build._BASE_FLAGS, *native_build._ATTEMPTS[0])
    target = native_build._target(source, native_build._compiler(), first_attempt)
    target.write_bytes(b"truncated")
    again = load_library(source)
    assert again.path == target and again.library.answer() == 44 and again.threaded == built.threaded


def test_a_build_that_fails_names_the_compilers_error(cache: Path, tmp_path: Path) -> None:
    source = tmp_path / "broken.c"
    source.write_text("int broken(void) { return undeclared_name; }\n")
    with pytest.raises(NativeBuildError, match=r"broken\.c could not be built with .*undeclared_name.*3 attempts"):
        load_library(source)
    assert not list(cache.glob("kernels/*"))


def test_a_missing_compiler_is_named(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(NativeBuildError, match=r"CC='.*no-such-cc' names no executable \('.*no-such-cc' is not on"):
        load_library(tmp_path / "any.c")


def test_a_compiler_command_with_arguments_is_run_as_one(cache: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``CC="ccache gcc"`` and the like: the command's words reach the compiler, and its arguments key the cache."""
    compiler = native_build._compiler()[0]
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return ANSWER; }\n")
    monkeypatch.setenv("CC", f"{compiler} -DANSWER=42")
    assert load_library(source).library.answer() == 42
    load_library.cache_clear()
    monkeypatch.setenv("CC", f"{compiler} -DANSWER=43")  # other arguments: another build
    assert load_library(source).library.answer() == 43
    monkeypatch.setenv("CC", f"{compiler} 'unclosed")
    load_library.cache_clear()
    with pytest.raises(NativeBuildError, match=r"CC=.*unclosed.* cannot be split into a command"):
        load_library(source)


def test_an_unwritable_cache_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("LIGHTNING_COMP_CACHE_DIR", str(blocked))
    load_library.cache_clear()
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    try:
        with pytest.raises(NativeBuildError, match=r"cache directory .*a-file.* not writable.*CACHE_DIR"):
            load_library(source)
    finally:
        load_library.cache_clear()


def test_moments_not_laid_out_flat_are_left_to_the_eager_step() -> None:
    from lightning_comp.execution.adam_step import AdamSettings
    from lightning_comp.execution.update_path import CompiledUpdates

    p, g, m, v = _state(torch.float32)
    strided = torch.empty(2 * m.numel(), dtype=torch.uint8)[::2]
    strided.copy_(m)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(p)], lr=1e-3)
    settings = AdamSettings.of(optimizer, optimizer.param_groups[0])
    updates = CompiledUpdates("native")
    updates.begin(N, p.device)
    state = {"step": torch.tensor(1.0), "exp_avg": strided, "exp_avg_sq": v}
    assert not updates.step(p, g, state, settings, StatePrecision.INT8, False, "w")
    state["exp_avg"] = m
    assert updates.step(p, g, state, settings, StatePrecision.INT8, False, "w") and updates.native_steps == 1


DENSE = [(torch.float32, torch.float32, False), (torch.bfloat16, torch.float32, False),
         (torch.float32, torch.bfloat16, True), (torch.bfloat16, torch.bfloat16, True),
         (torch.float32, torch.bfloat16, False)]


@pytest.mark.parametrize(("moments", "weights", "stochastic"), DENSE,
                         ids=["fp32", "bf16-moments", "bf16-master", "bf16-both", "bf16-master-nearest"])
def test_the_native_dense_step_is_the_compiled_steps_arithmetic(
        moments: torch.dtype, weights: torch.dtype, stochastic: bool) -> None:
    """FP32 or BF16 moments: the functions the compiled path traces, run as plain torch, against the C loop. The
    same operations in the same order and the same hashed random bits: the same moments, bit for bit; the weights
    the same but for the last bit where torch's vectorised square root (not correctly rounded here) and the C
    library's (correctly rounded) differ, which moves a BF16 weight only where it sits at a rounding boundary."""
    def state() -> tuple[torch.Tensor, ...]:
        torch.manual_seed(0)
        p, g = (torch.randn(N + 3) * 0.1).to(weights), (torch.randn(N + 3) * 1e-2).to(weights)  # not whole chunks
        return p, g, (torch.randn(N + 3) * 1e-3).to(moments), (torch.rand(N + 3) * 1e-5).to(moments)

    ours, theirs = state(), state()
    key = rounding_key(7, "w", 3)
    step = fused_adam.step_bf16_moments if moments == torch.bfloat16 else fused_adam.step_fp32_moments
    step(*theirs, torch.tensor(HYPER), stochastic, key)
    _native_step(*ours, HYPER, stochastic, key)
    assert not torch.equal(ours[0], state()[0])  # it stepped
    for a, b in zip(ours[2:], theirs[2:]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    weights_ours, weights_theirs = ours[0].float(), theirs[0].float()
    # the last bits of the weight or of the update (about HYPER's step size) it took: two units at most
    spacing = 2 * torch.finfo(weights).eps * (weights_theirs.abs() + HYPER[6])
    assert torch.all((weights_ours - weights_theirs).abs() <= spacing)
    assert int((weights_ours != weights_theirs).sum()) <= (N if weights == torch.float32 else N * 1e-3) * 0.01


def _mixed_steps(seed: int) -> list[Any]:
    """Steps of every format at sizes that are not whole units of work, each with its own hyper-parameters and key:
    8-bit moments with FP32 weights and with a BF16 master, FP32 and BF16 moments, a BF16 master rounded to nearest,
    a tensor of a few elements."""
    from lightning_comp.execution.native_adam import NativeStep

    torch.manual_seed(seed)
    steps = []
    for index, (size, weights, moments, stochastic) in enumerate([
            (N + 768, torch.float32, torch.uint8, False), (4096, torch.bfloat16, torch.uint8, True),
            (N + 3, torch.float32, torch.float32, False), (5000, torch.float32, torch.bfloat16, False),
            (N + 5, torch.bfloat16, torch.bfloat16, True), (7, torch.bfloat16, torch.float32, False)]):
        p, g = (torch.randn(size) * 0.1).to(weights), (torch.randn(size) * 1e-2).to(weights)
        if moments == torch.uint8:
            m = block_quant.pack(block_quant.QuantisedMoment.quantise(torch.randn(size) * 1e-3, True))
            v = block_quant.pack(block_quant.QuantisedMoment.quantise(torch.rand(size) * 1e-5, False))
        else:
            m, v = (torch.randn(size) * 1e-3).to(moments), (torch.rand(size) * 1e-5).to(moments)
        hyper = (1.0, 0.0, 1.0 - 1e-4 * index, 0.1, 0.999, 1e-3, 3e-3 / (index + 1), 0.05 + index / 100, 1e-8)
        steps.append(NativeStep(p, g, m, v, hyper, stochastic, rounding_key(7, f"w{index}", 3 + index)))
    return steps


def test_one_call_steps_many_parameters_as_one_call_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """The units of every tensor shared among the threads in one region, each tensor with its own format, hyper-
    parameters and key: bit for bit what a call per tensor gives, on one thread or several."""
    from lightning_comp.execution import native_adam as native_adam_module

    kernel = native_adam()
    together, alone, one_thread = _mixed_steps(0), _mixed_steps(0), _mixed_steps(0)
    before = _mixed_steps(0)
    kernel.step(together)
    for step in alone:
        kernel.step([step])
    monkeypatch.setattr(native_adam_module, "GRAIN_SIZE", 1 << 40)  # every call on one thread
    kernel.step(one_thread)
    for ours, single, serial, start in zip(together, alone, one_thread, before):
        assert not torch.equal(ours.exp_avg_sq, start.exp_avg_sq)  # it stepped (a BF16 weight may not move)
        for field in ("p", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(ours, field), getattr(single, field)), field
            assert torch.equal(getattr(ours, field), getattr(serial, field)), field
    kernel.step([])  # nothing to step: nothing happens


def test_the_plugin_steps_every_managed_parameter_in_one_native_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two groups of their own learning rates and weight decays, a parameter whose step count lags (it had no gradient
    once), 8-bit and too-small tensors: one native call per optimizer step, and the result of one call per parameter
    (the update path's single-parameter step, as the search's timing used it)."""
    from lightning_comp import PrecisionPlan
    from lightning_comp.execution.native_adam import NativeAdam
    from lightning_comp.execution.optimizer_states import OptimizerStates

    many = update_path_module.CompiledUpdates.step_many

    def one_call_each(self: Any, steps: list[Any]) -> list[Any]:
        return [left for one in steps for left in many(self, [one])]

    def train(batched: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, OptimizerStates]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64), torch.nn.Linear(64, 32))
        states = OptimizerStates("native")
        states.assign(model, PrecisionPlan.from_dict({"type:Linear": {"state": "8bit"}}))
        optimizer = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-2, "weight_decay": 0.1},
                                       {"params": [*model[1].parameters(), *model[2].parameters()], "lr": 3e-3}])
        for step in range(4):
            for p in model.parameters():
                p.grad = torch.randn_like(p) * 1e-2
            if step == 1:
                model[1].weight.grad = None  # its counter lags from here on
            if batched:
                states.step(optimizer, optimizer.step)
            else:
                with monkeypatch.context() as patched:  # one native call per parameter
                    patched.setattr(update_path_module.CompiledUpdates, "step_many", one_call_each)
                    states.step(optimizer, optimizer.step)
        return model, optimizer, states

    calls: list[int] = []
    original = NativeAdam.step
    monkeypatch.setattr(NativeAdam, "step", lambda self, steps: (calls.append(len(steps)), original(self, steps))[1])
    model, optimizer, states = train(batched=True)
    assert calls == [5, 6, 6]  # the first step creates the states eagerly; then all six but the one with no gradient
    assert float(optimizer.state[model[1].weight]["step"]) == 3 and float(optimizer.state[model[0].weight]["step"]) == 4
    calls.clear()
    reference, reference_optimizer, _ = train(batched=False)
    assert calls == [1] * 17
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, reference_optimizer.state[q][key]), key
    assert states.updates.native_steps == 17
