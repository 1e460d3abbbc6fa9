"""PrecisionPlan: parsing, selector precedence, validation against a model, serialisation and file errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_comp import PlanError, PlanFileError, PlanMismatchError, PrecisionPlan
from lightning_comp.numerics import ComputePrecision, parse_precision
from lightning_comp.operators.owned_work import WorkRecorder
from lightning_comp.plan import PLAN_FORMAT, PLAN_VERSION, OperatorFingerprint
from lightning_comp.plan.plan import plan_from_any


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(4, 4)
        self.linear2 = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.conv = nn.Conv1d(4, 4, 1)
        self.act = nn.GELU()


class _MyLinear(nn.Linear):
    pass


def _model() -> nn.Module:
    model = nn.Module()
    model.encoder = nn.ModuleList([_Encoder(), _Encoder()])
    model.head = _MyLinear(4, 2)
    return model


# ------------------------------------------------------------------------------------------------ precisions
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("fp32", ComputePrecision.FP32),
        ("float32", ComputePrecision.FP32),
        ("32", ComputePrecision.FP32),
        (" BF16 ", ComputePrecision.BF16),
        ("bfloat16", ComputePrecision.BF16),
        ("half", ComputePrecision.FP16),
        ("16", ComputePrecision.FP16),
        (torch.float16, ComputePrecision.FP16),
        (torch.bfloat16, ComputePrecision.BF16),
        (ComputePrecision.FP32, ComputePrecision.FP32),
    ],
)
def test_parse_precision_aliases(value: object, expected: ComputePrecision) -> None:
    assert parse_precision(value) is expected


@pytest.mark.parametrize("value", ["fp4", "bf-16", "", "float64", None, 16, 1.5, ["bf16"]])
def test_unknown_precision_names_value_and_valid_ones(value: object) -> None:
    with pytest.raises(PlanError) as info:
        parse_precision(value)
    message = str(info.value)
    assert repr(value) in message
    assert all(v in message for v in ("'fp32'", "'bf16'", "'fp16'", "'fp8'", "'fp8-rowwise'"))


def test_unsupported_dtype_names_valid_dtypes() -> None:
    with pytest.raises(PlanError, match=r"torch\.float64.*torch\.float32, torch\.bfloat16, torch\.float16"):
        parse_precision(torch.float64)


def test_precision_properties() -> None:
    assert ComputePrecision.BF16.dtype is torch.bfloat16 and ComputePrecision.FP16.dtype is torch.float16
    assert ComputePrecision.FP32.dtype is torch.float32
    assert ComputePrecision.BF16.is_low and not ComputePrecision.FP32.is_low
    assert str(ComputePrecision.FP16) == "fp16"


def test_plan_entry_error_names_selector_and_value() -> None:
    with pytest.raises(PlanError, match=r"'encoder\.\*'.*'int8'.*'fp32', 'bf16', 'fp16', 'fp8' .* and 'fp8-rowwise'"):
        PrecisionPlan.from_dict({"encoder.*": "int8"})
    with pytest.raises(PlanError, match="'fp32', 'bf16', 'fp16', 'fp8'"):
        PrecisionPlan.from_dict({}, default="tf32")


@pytest.mark.parametrize("selector", ["type:", "type:1Linear", "type:nn.Linear", "type:Lin ear"])
def test_bad_type_selector(selector: str) -> None:
    with pytest.raises(PlanError, match="must name a class"):
        PrecisionPlan.from_dict({selector: "bf16"})


def test_non_string_selector_and_non_mapping() -> None:
    with pytest.raises(PlanError, match="must be a string"):
        PrecisionPlan.from_dict({3: "bf16"})  # type: ignore[dict-item]
    with pytest.raises(PlanError, match="from a mapping"):
        PrecisionPlan.from_dict([("a", "bf16")])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ precedence
def test_exact_beats_glob_beats_type_beats_default() -> None:
    model = _model()
    plan = PrecisionPlan.from_dict(
        {
            "encoder.0.linear1": "fp32",
            "encoder.*.linear?": "fp16",
            "type:Linear": "bf16",
        },
        default="fp32",
    )
    resolved = plan.resolve(model)
    assert resolved["encoder.0.linear1"] is ComputePrecision.FP32  # exact
    assert resolved["encoder.0.linear2"] is ComputePrecision.FP16  # glob over type
    assert resolved["encoder.1.linear1"] is ComputePrecision.FP16
    assert resolved["head"] is ComputePrecision.BF16  # type (through the MRO: _MyLinear -> Linear)
    assert resolved["encoder.0.norm"] is ComputePrecision.FP32  # default
    explain = plan.explain(model)
    assert explain["encoder.0.linear1"] == "encoder.0.linear1"
    assert explain["encoder.1.linear2"] == "encoder.*.linear?"
    assert explain["head"] == "type:Linear"
    assert explain["encoder.1.act"] == "<default>"


def test_longest_glob_wins() -> None:
    plan = PrecisionPlan.from_dict({"encoder.*": "bf16", "encoder.1.*": "fp16", "*": "fp32"})
    assert plan.of("compute", "encoder.1.norm") is ComputePrecision.FP16
    assert plan.of("compute", "encoder.0.norm") is ComputePrecision.BF16
    assert plan.of("compute", "head") is ComputePrecision.FP32


def test_nearest_class_in_mro_wins() -> None:
    plan = PrecisionPlan.from_dict({"type:Linear": "fp16", "type:_MyLinear": "bf16", "type:Module": "fp32"})
    assert plan.of("compute", "head", _MyLinear) is ComputePrecision.BF16
    assert plan.of("compute", "x", nn.Linear) is ComputePrecision.FP16
    assert plan.of("compute", "x", nn.ReLU) is ComputePrecision.FP32
    plan2 = PrecisionPlan.from_dict({"type:_ConvNd": "bf16"}, default="fp16")
    assert plan2.of("compute", "c", nn.Conv2d) is ComputePrecision.BF16  # private base classes can be named
    assert plan2.of("compute", "c") is ComputePrecision.FP16  # type selectors need the class


def test_queries() -> None:
    assert PrecisionPlan().is_all_fp32
    plan = PrecisionPlan.from_dict({"type:Linear": "bf16"})
    assert not plan.is_all_fp32 and plan.uses("bf16") and plan.uses(ComputePrecision.FP32) and not plan.uses("fp16")
    assert PrecisionPlan.from_dict({}, default="fp16").uses(torch.float16)
    assert plan.low_operators(_model()) == [
        "encoder.0.linear1", "encoder.0.linear2", "encoder.1.linear1", "encoder.1.linear2", "head",
    ]
    shape = PrecisionPlan.from_dict({}, default="bf16").low_operators(nn.Sequential(nn.Linear(2, 2), nn.Flatten()))
    assert shape == ["0"]  # shape-only operators are never "low"


def test_with_entries_and_provenance_do_not_mutate() -> None:
    plan = PrecisionPlan.from_dict({"a": "bf16"})
    plan2 = plan.with_assignment("compute", {"a": "fp16", "b": "bf16"})
    assert dict(plan["compute"].entries) == {"a": ComputePrecision.BF16}
    assert dict(plan2["compute"].entries) == {"a": ComputePrecision.FP16, "b": ComputePrecision.BF16}
    noted = plan.with_provenance(source="test", epochs=2)
    assert noted == plan and noted.provenance == {"source": "test", "epochs": 2} and plan.provenance == {}
    with pytest.raises(TypeError):
        noted.provenance["x"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        plan.assignments = ()  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------ validation
def test_validate_names_every_unmatched_entry() -> None:
    model = _model()
    plan = PrecisionPlan.from_dict(
        {"encoder.0.linear3": "bf16", "decoder.*": "bf16", "type:Conv2d": "bf16", "head": "bf16", "type:Linear": "bf16"}
    )
    assert plan.unmatched_entries(model) == ["decoder.*", "encoder.0.linear3", "type:Conv2d"]
    with pytest.raises(PlanMismatchError) as info:
        plan.validate(model)
    message = str(info.value)
    assert "3 plan entries match no operator" in message
    for selector in ("'decoder.*'", "'encoder.0.linear3'", "'type:Conv2d'"):
        assert selector in message
    assert "'encoder.0.linear3' (did you mean 'encoder.0.linear2', 'encoder.0.linear1'" in message
    assert "'head'" not in message.split("The model's operators are")[0]


def test_containers_are_not_operators_once_a_trace_finds_them_computing_nothing_themselves() -> None:
    model = _model()
    plan = PrecisionPlan.from_dict({"encoder.0": "bf16"})
    plan.validate(model)  # not traced yet: it may turn out to compute between its children
    with WorkRecorder(model):
        model.head(torch.randn(2, 4))  # the trace sees every module of the model, called or not
    with pytest.raises(PlanMismatchError, match="1 plan entry matches no operator"):
        plan.validate(model)
    PrecisionPlan.from_dict({"encoder.0.*": "bf16"}).validate(model)  # a glob covers a container's operators


def test_for_model_binds_fingerprint_and_environment() -> None:
    model = _model()
    plan = PrecisionPlan.for_model(model, {"type:Linear": "bf16"}, provenance={"by": "test"})
    assert plan.fingerprint == OperatorFingerprint.of(model)
    assert plan.torch_version == torch.__version__ and type(plan.torch_version) is str
    assert plan.device_type == "cpu"
    assert plan.provenance == {"by": "test"}
    assert len(plan.fingerprint.digest) == 16
    assert plan.fingerprint.operators[0] == ("encoder.0.linear1", "Linear")
    with pytest.raises(PlanMismatchError):
        PrecisionPlan.for_model(model, {"nope": "bf16"})


def test_fingerprint_mismatch_error_describes_difference() -> None:
    plan = PrecisionPlan.for_model(_model(), {"type:Linear": "bf16"})
    other = _model()
    other.head = nn.Conv1d(4, 2, 1)  # retyped
    other.extra = nn.ReLU()  # new
    del other.encoder[1]  # missing
    with pytest.raises(PlanMismatchError) as info:
        plan.validate(other)
    message = str(info.value)
    assert plan.fingerprint is not None and plan.fingerprint.digest in message
    assert "missing from the model: encoder.1.linear1" in message
    assert "new in the model: extra" in message
    assert "retyped: head (_MyLinear -> Conv1d)" in message
    plan.validate(_model())  # a fresh instance of the same architecture fits


def test_fingerprint_difference_truncates_long_lists() -> None:
    small = OperatorFingerprint((("a", "Linear"),))
    big = OperatorFingerprint(tuple((f"m{i}", "Linear") for i in range(20)))
    text = small.difference(big, limit=3)
    assert "m0, m1, m2, ... (20 in all)" in text
    assert small.difference(small) == "same operators"


# --------------------------------------------------------------------------------------------- serialisation
def _bound_plan() -> PrecisionPlan:
    return PrecisionPlan.for_model(
        _model(), {"encoder.*.norm": "bf16", "type:Linear": "bf16", "head": "fp32"}, default="fp32",
        provenance={"epochs": [1, 2], "score": 0.5},
    )


def test_dict_round_trip_is_plain_and_equal() -> None:
    plan = _bound_plan()
    data = plan.to_dict()
    assert data["format"] == PLAN_FORMAT and data["version"] == PLAN_VERSION
    assert data["saved"] == {} and data["saved_default"] == "fp32"  # every field, always: one format
    assert data["entries"] == {"encoder.*.norm": "bf16", "head": "fp32", "type:Linear": "bf16"}
    assert json.loads(json.dumps(data)) == data  # plain JSON types only
    again = PrecisionPlan.from_dict(data)
    assert again == plan and hash(again) == hash(plan)
    assert again.provenance == {"epochs": [1, 2], "score": 0.5}
    assert PrecisionPlan.from_dict(json.loads(plan.to_json())) == plan


def test_equality_ignores_provenance_and_entry_order() -> None:
    a = PrecisionPlan.from_dict({"x": "bf16", "y": "fp16"}).with_provenance(a=1)
    b = PrecisionPlan.from_dict({"y": "half", "x": torch.bfloat16})
    assert a == b
    assert a != PrecisionPlan.from_dict({"x": "bf16", "y": "fp16"}, default="bf16")
    model = nn.Module()
    model.x, model.y = nn.Linear(1, 1), nn.Linear(1, 1)
    assert a != a.bind(model)  # the fingerprint is part of a plan's identity


def test_save_load_round_trip(tmp_path: Path) -> None:
    plan = _bound_plan()
    path = plan.save(tmp_path / "sub" / "plan.json")
    assert path.exists() and not list(path.parent.glob("*.tmp"))
    assert PrecisionPlan.load(path) == plan
    assert PrecisionPlan.load(str(path)).provenance == plan.provenance
    assert plan_from_any(path) == plan


def test_load_plain_selector_mapping(tmp_path: Path) -> None:
    path = tmp_path / "plain.json"
    path.write_text(json.dumps({"type:Linear": "bf16"}))
    assert PrecisionPlan.load(path) == PrecisionPlan.from_dict({"type:Linear": "bf16"})


def test_repr_mentions_entries_default_and_fingerprint() -> None:
    plan = _bound_plan()
    text = repr(plan)
    assert "'type:Linear': 'bf16'" in text and "default='fp32'" in text and plan.fingerprint.digest in text


def test_summary_without_and_with_model() -> None:
    plan = PrecisionPlan.from_dict({"type:Linear": "bf16", "encoder.0.*": "fp32"})
    table = plan.summary()
    lines = table.splitlines()
    assert lines[0].split() == ["selector", "precision"]
    assert any(line.split() == ["type:Linear", "bf16"] for line in lines)
    assert lines[-1].split() == ["<default>", "fp32"]
    model = _model()
    table = plan.summary(model)
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:-1]}
    assert rows["encoder.1.linear1"] == ["encoder.1.linear1", "Linear", "20", "bf16", "type:Linear"]
    assert rows["encoder.0.linear1"][3:] == ["fp32", "encoder.0.*"]
    assert rows["encoder.1.norm"][3:] == ["fp32", "<default>"]
    assert table.splitlines()[-1] == "3 of 11 operators in 16-bit precision"


def test_summary_of_bare_module_names_root() -> None:
    assert "<root>" in PrecisionPlan.from_dict({}, default="bf16").summary(nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------- file errors
def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlanFileError, match="does not exist"):
        PrecisionPlan.load(tmp_path / "nope.json")


def test_load_not_json(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("{'type:Linear': bf16}")
    with pytest.raises(PlanFileError, match="not valid JSON"):
        PrecisionPlan.load(path)


def test_load_unreadable(tmp_path: Path) -> None:
    with pytest.raises(PlanFileError, match="cannot be read"):
        PrecisionPlan.load(tmp_path)  # a directory
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(PlanFileError, match="cannot be read"):
        PrecisionPlan.load(path)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ([["type:Linear", "bf16"]], "holds a JSON list"),
        ("bf16", "holds a JSON str"),
        ({"type:Linear": "int8"}, "'int8'"),
        ({"format": PLAN_FORMAT, "version": 99, "entries": {}}, "Unsupported plan version 99"),
        ({"format": PLAN_FORMAT, "version": PLAN_VERSION, "entries": ["a"]}, "mapping of selector"),
        ({"format": PLAN_FORMAT, "version": PLAN_VERSION, "colour": "red"}, "Unknown keys"),
        (
            {"format": PLAN_FORMAT, "version": PLAN_VERSION, "fingerprint": {"operators": "x"}},
            "Malformed plan fingerprint",
        ),
        ({"format": PLAN_FORMAT, "version": PLAN_VERSION, "fingerprint": {"operators": [["a"]]}}, "Malformed"),
        ({"format": PLAN_FORMAT, "version": PLAN_VERSION, "provenance": [1]}, "provenance must be a mapping"),
        ({"format": PLAN_FORMAT, "version": PLAN_VERSION, "torch_version": 2}, "torch_version must be a string"),
    ],
)
def test_load_wrong_shape(tmp_path: Path, content: object, match: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(content))
    with pytest.raises(PlanFileError, match=match) as info:
        PrecisionPlan.load(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, PlanError)  # callers may catch the base class


def test_edited_fingerprint_is_detected(tmp_path: Path) -> None:
    data = _bound_plan().to_dict()
    data["fingerprint"]["operators"][0][1] = "Conv1d"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="edited or corrupted"):
        PrecisionPlan.load(path)


def test_plan_from_any() -> None:
    assert plan_from_any(None) == PrecisionPlan()
    plan = PrecisionPlan.from_dict({"a": "bf16"})
    assert plan_from_any(plan) is plan
    assert plan_from_any({"a": ComputePrecision.BF16}) == plan
    with pytest.raises(PlanError, match="Cannot make a plan from int"):
        plan_from_any(3)  # type: ignore[arg-type]


def test_plans_pickle_and_deepcopy() -> None:
    """ddp_spawn pickles the plugin (and its plan); snapshots deep-copy callback state holding plans."""
    import copy
    import pickle

    plan = _bound_plan()
    for clone in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan), copy.copy(plan)):
        assert clone == plan and clone.provenance == plan.provenance and clone.fingerprint == plan.fingerprint
        with pytest.raises(TypeError):
            clone.provenance["x"] = 1  # still read-only
