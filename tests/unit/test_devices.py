"""Device classes: what each CPU/GPU class runs natively (a monkeypatched capability stands in for the classes this
machine is not), what ``auto`` resolves to there, plans moved between machines, and errors that name the device."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_comp import CoMPPrecision, PrecisionPlan, SearchConfig
from lightning_comp.devices import DeviceClass
from lightning_comp.devices import cpu_features as cpu_mod
from lightning_comp.devices import device_classes as devices
from lightning_comp.devices.device_classes import device_class
from lightning_comp.errors import PlanError, PlanFileError
from lightning_comp.execution.emulation import check_plan_device, decline_slow_fp16
from lightning_comp.execution.hooks import precision_may_cause
from lightning_comp.numerics import ComputePrecision
from lightning_comp.plan import PLAN_VERSION
from lightning_comp.plugins import runtime as plan_runtime
from tests.helpers.models import TinyMLP, regression_loader

BF16, FP16, FP32 = ComputePrecision.BF16, ComputePrecision.FP16, ComputePrecision.FP32
FP8, FP8_ROWWISE = ComputePrecision.FP8, ComputePrecision.FP8_ROWWISE


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    """Device classes are cached per process: forget them around a test that fakes a CPU or a GPU."""
    device_class.cache_clear()  # type: ignore[attr-defined]
    yield
    device_class.cache_clear()  # type: ignore[attr-defined]


def _fake_cpu(monkeypatch: pytest.MonkeyPatch, capability: str, features: set[str]) -> DeviceClass:
    monkeypatch.setattr(devices, "cpu_capability", lambda: capability)
    monkeypatch.setattr(devices, "cpu_features", lambda: frozenset(features))
    device_class.cache_clear()  # type: ignore[attr-defined]
    return device_class("cpu")


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, major: int, minor: int = 0, name: str = "Fake GPU") -> DeviceClass:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (major, minor))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    device_class.cache_clear()  # type: ignore[attr-defined]
    return device_class("cuda:0")


# ------------------------------------------------------------------------------------------- the classes
@pytest.mark.parametrize(
    ("capability", "features", "native", "auto"),
    [
        ("AVX2", set(), set(), None),  # AVX2-only EPYC: BF16 emulated, the search stays FP32
        ("AVX2", {"avx512_bf16"}, set(), None),  # AVX512-BF16 silicon dispatched at AVX2 (ATEN_CPU_CAPABILITY)
        ("AVX512", set(), set(), None),  # AVX512 without BF16 (Skylake-class)
        ("AVX512", {"avx512_bf16"}, {BF16}, BF16),  # EPYC Genoa-class
        ("AVX512", {"avx512_bf16", "amx_tile"}, {BF16}, BF16),  # Sapphire Rapids
        ("AVX512", {"avx512_bf16", "amx_tile", "amx_fp16"}, {BF16, FP16}, BF16),  # Granite Rapids
        ("DEFAULT", set(), set(), None),
    ],
)
def test_cpu_classes_and_what_auto_searches_with(monkeypatch: pytest.MonkeyPatch, fresh_probe: None,
                                                  capability: str, features: set[str], native: set[ComputePrecision],
                                                  auto: ComputePrecision | None) -> None:
    cpu = _fake_cpu(monkeypatch, capability, features)
    assert cpu.type == "cpu" and cpu.capability == capability
    assert cpu.native == native
    # a CPU runs every 16-bit precision, natively or not, and fp8 emulated (torch._scaled_mm's CPU kernel)
    assert cpu.emulated == ({BF16, FP16} - native) | {FP8, FP8_ROWWISE}
    assert all(cpu.runs(p) for p in ComputePrecision)
    assert SearchConfig().resolve_low_precision(cpu) is auto
    assert SearchConfig(low_precision="bf16").resolve_low_precision(cpu) is BF16  # pinned: searched anyway
    # an objective that weighs memory still searches the memory dimensions where no 16-bit compute pays
    for objective in ("memory", "balanced"):
        assert SearchConfig(objective=objective).resolve_low_precision(cpu) is (auto or FP32), objective
    # ... unless it may try none of them
    nothing = SearchConfig(objective="memory", precisions={"saved": "off", "state": "off", "master": "off"})
    assert nothing.resolve_low_precision(cpu) is auto
    saved_only = SearchConfig(objective="memory", precisions={"state": "off", "master": "off"})
    assert saved_only.resolve_low_precision(cpu) is (auto or FP32)


@pytest.mark.parametrize(
    ("sm", "native", "emulated", "auto"),
    [((6, 0), set(), {FP16, BF16}, None), ((7, 0), {FP16}, {BF16}, FP16), ((8, 0), {FP16, BF16}, set(), BF16),
     ((8, 6), {FP16, BF16}, set(), BF16),  # A10/RTX 30: no fp8 matmul kernel, so fp8 does not run at all
     ((8, 9), {FP16, BF16, FP8, FP8_ROWWISE}, set(), BF16),  # L4/L40
     ((9, 0), {FP16, BF16, FP8, FP8_ROWWISE}, set(), BF16)],  # H100/H200
)
def test_cuda_classes_and_what_auto_searches_with(monkeypatch: pytest.MonkeyPatch, fresh_probe: None,
                                                   sm: tuple[int, int], native: set[ComputePrecision],
                                                   emulated: set[ComputePrecision],
                                                   auto: ComputePrecision | None) -> None:
    gpu = _fake_cuda(monkeypatch, *sm, name="NVIDIA Fake")
    assert (gpu.type, gpu.capability, gpu.name) == ("cuda", f"sm{sm[0]}{sm[1]}", "NVIDIA Fake")
    assert gpu.native == native and gpu.emulated == emulated
    assert gpu.runs(FP8) is (FP8 in native)
    assert SearchConfig().resolve_low_precision(gpu) is auto
    assert SearchConfig(objective="memory").resolve_low_precision(gpu) is (auto or FP32)  # sm60: memory alone
    assert ("fp8 native" in gpu.describe()) is (FP8 in native)


def test_this_machine_is_classified_consistently() -> None:
    """Whatever CPU runs the suite: the class agrees with torch's public capability and round-trips through JSON."""
    cpu = device_class("cpu")
    assert cpu.capability == torch.backends.cpu.get_cpu_capability()
    if not cpu.capability.startswith("AVX512"):
        assert not cpu.native  # below AVX512 dispatch nothing 16-bit is native
    assert DeviceClass.from_dict(json.loads(json.dumps(cpu.to_dict()))) == cpu
    assert cpu.describe().startswith(f"cpu {cpu.capability} (")
    assert device_class(nn.Linear(2, 2)) == cpu  # a module: where its parameters are


def test_malformed_device_classes_name_the_bad_value() -> None:
    with pytest.raises(PlanError, match=r"Malformed device class 'gpu'"):
        DeviceClass.from_dict("gpu")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"Unknown keys \['speed'\]"):
        DeviceClass.from_dict({"type": "cpu", "speed": 1})
    with pytest.raises(PlanError, match=r"Malformed device class .*Unknown precision 'int8'"):
        DeviceClass.from_dict({"type": "cpu", "native": ["int8"]})


def test_private_cpu_probes_fall_back_to_proc_cpuinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    """If a future torch drops ``torch.cpu._is_*_supported``, the kernel's flags answer instead."""
    for feature in cpu_mod.FEATURES:
        monkeypatch.delattr(torch.cpu, f"_is_{feature}_supported", raising=False)
    monkeypatch.setattr(cpu_mod, "_proc_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert cpu_mod.cpu_features() == {"avx2", "avx512", "avx512_bf16"}

    def broken() -> bool:
        raise RuntimeError("cpuinfo failed")

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", broken, raising=False)
    monkeypatch.setattr(cpu_mod, "_proc_flags", lambda: frozenset({"amx_tile"}))
    assert "amx_tile" in cpu_mod.cpu_features()


# ------------------------------------------------------------------------------- plans moved between machines
_AMX = DeviceClass("cpu", name="Intel Xeon", capability="AVX512", native=frozenset({BF16}),
                   emulated=frozenset({FP16}), features=("amx_tile", "avx512_bf16"))
_AVX2 = DeviceClass("cpu", name="AMD EPYC", capability="AVX2", emulated=frozenset({BF16, FP16}))


def test_a_plan_records_the_device_class_it_was_made_on(tmp_path: Path) -> None:
    model = TinyMLP()
    plan = PrecisionPlan.for_model(model, {"type:Linear": "bf16"})
    assert plan.device == device_class("cpu") and plan.device_type == "cpu"
    saved = PrecisionPlan.load(plan.save(tmp_path / "plan.json"))
    assert saved.device == plan.device
    assert json.loads((tmp_path / "plan.json").read_text())["version"] == PLAN_VERSION


def test_a_plan_document_of_another_version_is_refused_naming_both(tmp_path: Path) -> None:
    """One format, no readers for pre-release ones: a document of another version fails, saying which this reads."""
    old = PrecisionPlan.for_model(TinyMLP(), {"net.0": "bf16"}).to_dict()
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old | {"version": PLAN_VERSION + 1}))
    with pytest.raises(PlanFileError, match=rf"Unsupported plan version {PLAN_VERSION + 1}: this lightning-comp reads"
                                            rf" version {PLAN_VERSION}"):
        PrecisionPlan.load(path)


def test_a_plan_moved_to_a_device_that_emulates_its_precision_warns_once() -> None:
    model = TinyMLP()
    plan = PrecisionPlan.for_model(model, {"net.0": "bf16", "net.4": "bf16"})
    plan = PrecisionPlan.from_dict(plan.to_dict() | {"device": _AMX.to_dict()})
    with pytest.warns(UserWarning) as record:
        message = check_plan_device(plan, model, _AVX2)
        again = check_plan_device(plan, model, _AVX2)
    assert len(record) == 1 and message == again == str(record[0].message)
    assert message is not None
    assert "made on cpu AVX512 (Intel Xeon; bf16 native 16-bit)" in message
    assert "computes 2 operator(s) in bf16 on cpu AVX2 (AMD EPYC; no native 16-bit)" in message
    assert "net.0, net.4" in message and "Search again on this machine" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_plan_device(plan, model, _AMX) is None  # native there: nothing to say
        assert check_plan_device(PrecisionPlan.for_model(model, {"net.0": "fp16"}), model, _AVX2,
                                 accepted=frozenset({FP16})) is None


def test_the_plugin_warns_when_it_loads_a_plan_made_where_bf16_was_native(
        monkeypatch: pytest.MonkeyPatch, fresh_probe: None, fast_trainer_kwargs: dict[str, Any]) -> None:
    model = TinyMLP()
    plan = PrecisionPlan.from_dict(PrecisionPlan.for_model(model, {"net.2": "bf16"}).to_dict()
                                   | {"device": _AMX.to_dict()})
    _fake_cpu(monkeypatch, "AVX2", set())
    plugin = CoMPPrecision(plan)
    pattern = r"made on cpu AVX512 .* computes 1 operator\(s\) in bf16 on cpu AVX2 .*net\.2"
    with pytest.warns(UserWarning, match=pattern):
        pl.Trainer(max_steps=1, plugins=[plugin], **fast_trainer_kwargs).fit(model, regression_loader())
    assert plugin.executor.precisions()["net.2"] is BF16  # still trains with the plan: correct, only slower


def test_an_error_inside_a_lowered_operator_names_it_and_the_device() -> None:
    class Picky(nn.Linear):  # like a kernel with no 16-bit primitive on this device
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled("cpu"):
                raise RuntimeError("could not create a primitive descriptor")
            return super().forward(x)

    model = nn.Sequential(nn.Linear(4, 4), Picky(4, 4))
    plugin = CoMPPrecision({"1": "bf16", "0": "bf16"})
    plugin.convert_module(model)
    with pytest.raises(RuntimeError, match="primitive descriptor") as info, plugin.train_step_context():
        model(torch.randn(2, 4))
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1, notes
    assert "operator '1' (Picky) computing in bf16 (autocast lowering) on cpu [cpu " in notes[0]
    assert "Assign it 'fp32'" in notes[0]


def test_an_error_that_does_not_come_from_precision_is_not_blamed_on_it() -> None:
    """An out-of-range token index raises the same IndexError in fp32: the note must not advise fp32 as the fix."""
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
    plugin = CoMPPrecision({"0": "bf16", "1": "bf16"})
    plugin.convert_module(model)
    with pytest.raises(IndexError, match="index out of range") as info, plugin.train_step_context():
        model(torch.tensor([[1, 9]]))  # 9 is not a row of the table
    (note,) = getattr(info.value, "__notes__", [])
    assert "operator '0' (Embedding) computing in bf16 (output lowering)" in note
    assert "may not come from precision" in note and "Assign it 'fp32'" not in note
    with pytest.raises(IndexError) as fp32, torch.no_grad():
        nn.Embedding(8, 4)(torch.tensor([[1, 9]]))  # the same error in fp32
    assert type(fp32.value) is type(info.value)


@pytest.mark.parametrize("message", [
    "expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16",
    "\"addmm_impl_cpu_\" not implemented for 'Half'",
    "could not create a primitive descriptor for the LSTM forward propagation primitive",
])
def test_errors_that_speak_of_dtypes_or_16_bit_kernels_advise_fp32(message: str) -> None:
    assert precision_may_cause(RuntimeError(message))
    assert not precision_may_cause(IndexError("index out of range in self"))
    assert not precision_may_cause(RuntimeError("shape '[2, 3]' is invalid for input of size 4"))


def test_declining_slow_fp16_keeps_the_saved_dimension_and_the_rest_of_the_plan() -> None:
    """An fp16 plan on a device without fast fp16 runs its fp16 entries in fp32; its saved entries, saved default,
    fingerprint and provenance are the plan's still (they used to be dropped: the plan was rebuilt from its compute
    entries alone)."""
    model = TinyMLP()
    plan = PrecisionPlan.for_model(model, {"net.0": {"compute": "fp16", "saved": "fp8"}, "net.2": "bf16"},
                                   provenance={"made_by": "me"})
    plan = plan.with_assignment("saved", {}, default="bf16")
    no_fast_fp16 = DeviceClass("cpu", name="test", capability="AVX512", native=frozenset({BF16}),
                               emulated=frozenset({FP16}))
    with pytest.warns(UserWarning, match="no fast fp16"):
        declined = decline_slow_fp16(plan, no_fast_fp16, allow=False)
    assert declined.of("compute", "net.0") is FP32 and declined.of("compute", "net.2") is BF16
    assert declined["saved"] == plan["saved"] and declined.of("saved", "net.0").value == "fp8"
    assert declined["saved"].default is plan["saved"].default and declined.of("saved", "net.4").value == "bf16"
    assert declined.fingerprint == plan.fingerprint and declined.provenance["made_by"] == "me"
    assert declined.provenance["declined_fp16"] is True
    assert decline_slow_fp16(plan, no_fast_fp16, allow=True) is plan


def test_the_plugin_trains_a_declined_fp16_plan_with_its_saved_entries(
        monkeypatch: pytest.MonkeyPatch, fast_trainer_kwargs: dict[str, Any]) -> None:
    """The Trainer path of the same defect: the saved entries reach the operators' hooks."""
    no_fast_fp16 = DeviceClass("cpu", name="test", capability="AVX512", native=frozenset({BF16}),
                               emulated=frozenset({FP16}))
    monkeypatch.setattr(plan_runtime, "device_class", lambda device: no_fast_fp16)
    plugin = CoMPPrecision({"net.0": {"compute": "fp16", "saved": "fp8"}}, min_saved_bytes=0)
    with pytest.warns(UserWarning, match="no fast fp16"):
        pl.Trainer(max_steps=1, plugins=[plugin], **fast_trainer_kwargs).fit(TinyMLP(), regression_loader())
    assert plugin.plan.of("compute", "net.0") is FP32 and plugin.plan.of("saved", "net.0").value == "fp8"
    assert plugin.executor._operators["net.0"].saved.value == "fp8"
    assert plugin.executor.saved_tensors.compressed_bytes > 0  # the fp8 codec ran in training
