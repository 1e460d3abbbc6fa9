"""Property tests (hypothesis) for plan parsing, precedence and round trips over arbitrary selectors/precisions."""

from __future__ import annotations

import fnmatch
import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_comp import PlanError, PrecisionPlan
from lightning_comp.numerics import ComputePrecision, parse_precision
from lightning_comp.operators.owned_work import WorkRecorder
from lightning_comp.plan import OperatorFingerprint

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

identifier = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
segment = st.one_of(identifier, st.integers(0, 20).map(str))
name = st.lists(segment, min_size=1, max_size=4).map(".".join)
glob = st.lists(st.one_of(segment, st.sampled_from(["*", "?", "[0-3]", "lin*", "*.0"])), min_size=1, max_size=4).map(
    ".".join
).filter(lambda s: any(c in s for c in "*?["))
type_selector = identifier.map(lambda s: "type:" + s)
free_text = st.text(max_size=12).filter(lambda s: not s.startswith("type:"))  # any other string is a valid selector
selector = st.one_of(name, glob, type_selector, free_text)


Raw = dict[str, tuple[ComputePrecision, Any]]
SPELLINGS = {**{p.value: p for p in ComputePrecision},
             **{a: ComputePrecision(v) for a, v in ComputePrecision.aliases().items()}}


def _spellings(precision: ComputePrecision) -> st.SearchStrategy[Any]:
    aliases = [a for a, p in SPELLINGS.items() if p is precision]
    text = st.sampled_from(aliases).flatmap(
        lambda a: st.tuples(st.sampled_from([a, a.upper(), a.title()]), st.sampled_from(["", " ", "\t"])).map(
            lambda t: t[1] + t[0] + t[1]
        )
    )
    # a dtype spells the precision computing in it (fp8's activations are bf16, so bf16 spells bf16, not fp8)
    dtype = [st.just(precision.dtype)] if not precision.is_fp8 else []
    return st.one_of(text, st.just(precision), *dtype)


precision = st.sampled_from(list(ComputePrecision))
precision_value = precision.flatmap(lambda p: _spellings(p).map(lambda v: (p, v)))
entries = st.dictionaries(selector, precision_value, max_size=8)


def _plan(raw: Raw, default: ComputePrecision) -> PrecisionPlan:
    return PrecisionPlan.from_dict({s: v for s, (_, v) in raw.items()}, default=default)


@pytest.mark.slow
@SETTINGS
@given(raw=entries, default=precision)
def test_spellings_parse_to_their_precision(raw: Raw, default: ComputePrecision) -> None:
    plan = _plan(raw, default)
    assert dict(plan["compute"].entries) == {s: p for s, (p, _) in raw.items()}
    assert plan["compute"].default is default
    assert [s for s, _ in plan["compute"].entries] == sorted(raw)


@SETTINGS
@given(raw=entries, default=precision, notes=st.dictionaries(identifier, st.integers() | st.text(max_size=5)))
def test_dict_and_json_round_trip(raw: Raw, default: ComputePrecision, notes: dict) -> None:
    plan = _plan(raw, default).with_provenance(**notes)
    data = plan.to_dict()
    assert PrecisionPlan.from_dict(data) == plan
    restored = PrecisionPlan.from_dict(json.loads(json.dumps(data)))
    assert restored == plan and restored.provenance == plan.provenance
    assert restored.to_dict() == data  # serialisation is a fixed point


@SETTINGS
@given(
    raw=entries,
    default=precision,
    operators=st.lists(st.tuples(name, identifier), max_size=6, unique_by=lambda t: t[0]),
)
def test_save_load_round_trip(
    tmp_path_factory: pytest.TempPathFactory,
    raw: dict[str, tuple[ComputePrecision, Any]],
    default: ComputePrecision,
    operators: list[tuple[str, str]],
) -> None:
    plan = _plan(raw, default)
    if operators:  # a bound plan keeps its fingerprint and environment through the file
        plan = PrecisionPlan(plan.assignments, OperatorFingerprint(tuple(operators)), "2.x", "cpu")
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    assert PrecisionPlan.load(plan.save(path)) == plan


_VALID = set(SPELLINGS)


@SETTINGS
@given(value=st.text(max_size=10).filter(lambda s: s.strip().lower() not in _VALID), sel=name)
def test_invalid_precision_strings_raise_naming_the_value(value: str, sel: str) -> None:
    with pytest.raises(PlanError) as info:
        parse_precision(value)
    assert repr(value) in str(info.value) and "'bf16'" in str(info.value)
    with pytest.raises(PlanError) as info:
        PrecisionPlan.from_dict({sel: value})
    assert repr(value) in str(info.value) and repr(sel) in str(info.value)
    with pytest.raises(PlanError):
        PrecisionPlan.from_dict({}, default=value)


@SETTINGS
@given(value=st.one_of(st.integers(), st.floats(allow_nan=False), st.none(), st.lists(st.integers(), max_size=2)))
def test_non_string_precisions_raise(value: object) -> None:
    with pytest.raises(PlanError, match="Unknown precision"):
        parse_precision(value)


@SETTINGS
@given(bad=identifier.map(lambda s: "type:" + s + "."), p=precision)
def test_malformed_type_selectors_raise(bad: str, p: ComputePrecision) -> None:
    with pytest.raises(PlanError, match="must name a class"):
        PrecisionPlan.from_dict({bad: p})


class _A(nn.Linear):
    pass


class _B(_A):
    pass


_CLASSES = [_B, _A, nn.Linear, nn.Module, object]


def _oracle(plan: PrecisionPlan, op: str, klass: type) -> ComputePrecision:
    """The documented precedence, spelled out independently: exact > longest glob > nearest type > default."""
    table = dict(plan["compute"].entries)
    if op in table and not any(c in op for c in "*?[") and not op.startswith("type:"):
        return table[op]
    globs = [
        s for s in table if not s.startswith("type:") and any(c in s for c in "*?[") and fnmatch.fnmatchcase(op, s)
    ]
    if globs:
        return table[max(globs, key=lambda s: (len(s), s))]
    for k in klass.__mro__:
        if "type:" + k.__name__ in table:
            return table["type:" + k.__name__]
    return plan["compute"].default


@SETTINGS
@given(
    raw=entries,
    default=precision,
    op=name,
    klass=st.sampled_from(_CLASSES[:3]),
    types=st.dictionaries(st.sampled_from([c.__name__ for c in _CLASSES[:4]]), precision, max_size=4),
)
def test_precedence_matches_the_documented_rule(
    raw: Raw, default: ComputePrecision, op: str, klass: type, types: dict[str, ComputePrecision]
) -> None:
    plan = _plan(raw, default).with_assignment("compute", {"type:" + t: p for t, p in types.items()})
    assert plan.of("compute", op, klass) is _oracle(plan, op, klass)


@SETTINGS
@given(raw=entries, op=name, p=precision, q=precision)
def test_exact_entry_always_decides_and_types_never_override_names(
    raw: dict[str, tuple[ComputePrecision, Any]], op: str, p: ComputePrecision, q: ComputePrecision
) -> None:
    plan = _plan(raw, ComputePrecision.FP32)
    assert plan.with_assignment("compute", {op: p}).of("compute", op, _B) is p
    named = plan.with_assignment("compute", {op: p, "type:_B": q, "type:Linear": q})
    assert named.of("compute", op, _B) is p
    before = plan.of("compute", op)  # decided without a class: by name, glob or default
    explained_by_name = any(
        s == op or (any(c in s for c in "*?[") and not s.startswith("type:") and fnmatch.fnmatchcase(op, s))
        for s, _ in plan["compute"].entries
    )
    if explained_by_name:
        assert plan.with_assignment("compute", {"type:_B": q}).of("compute", op, _B) is before


@SETTINGS
@given(raw=entries, default=precision)
def test_entries_are_validated_against_a_model(raw: Raw, default: ComputePrecision) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with WorkRecorder(model):  # traced: the container is known to compute nothing itself (else entries wait)
        model(torch.randn(1, 2))
    plan = _plan(raw, default)
    unmatched = plan.unmatched_entries(model)
    for s in unmatched:
        assert s in raw
    matched = [s for s in raw if s not in unmatched]
    for s in matched:  # every matched entry can decide at least one operator when it is the only entry
        alone = PrecisionPlan.from_dict({s: "fp16"}, default="bf16")
        assert ComputePrecision.FP16 in alone.resolve(model).values()
    kept = PrecisionPlan.from_dict({s: p for s, (p, _) in raw.items() if s in matched}, default=default)
    assert kept.bind(model).fingerprint == OperatorFingerprint.of(model)
    if unmatched:
        with pytest.raises(PlanError, match="match"):
            plan.bind(model)


def test_dtype_precisions_are_accepted() -> None:
    assert PrecisionPlan.from_dict({"x": torch.bfloat16}) == PrecisionPlan.from_dict({"x": "bf16"})
