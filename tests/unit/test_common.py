"""What every layer shares: enums spelled in configs, nested structures of tensors, tables, plain JSON values."""

from __future__ import annotations

import json
from collections import OrderedDict, namedtuple
from dataclasses import dataclass
from enum import Enum

import pytest
import torch

from lightning_comp import ConfigError, PlanError, SearchConfigError
from lightning_comp.common.nested import cast_floating, has_dtype, map_tensors, structures_equal, tensors, to_device
from lightning_comp.common.plain import plain
from lightning_comp.common.spelled_enum import quoted
from lightning_comp.common.tables import format_table
from lightning_comp.distributed import GradCommDtype
from lightning_comp.numerics import ComputePrecision, SavedPrecision
from lightning_comp.search import LowPrecision, Mode, Objective, Timing, ToleranceMode


@pytest.mark.parametrize(("enum", "spellings", "member"), [
    (ComputePrecision, ["bf16", " BFloat16 ", torch.bfloat16, ComputePrecision.BF16], ComputePrecision.BF16),
    (SavedPrecision, ["fp8", "E4M3", "fp8_e4m3"], SavedPrecision.FP8),
    (GradCommDtype, ["fp32", "32-true", "none", torch.float32], GradCommDtype.FP32),
    (Objective, ["memory", "MEMORY", "Memory"], Objective.MEMORY),
])
def test_members_are_spelled_by_value_alias_name_or_dtype(enum: type, spellings: list[object], member: Enum) -> None:
    for spelling in spellings:
        assert enum.parse(spelling) is member, spelling  # type: ignore[attr-defined]
    text = next(s for s in spellings if isinstance(s, str))
    assert enum[text] is member and enum(text) is member  # by name-style lookup too (LightningCLI's)
    assert str(member) == member.value and json.loads(json.dumps(member)) == member.value


@pytest.mark.parametrize(("enum", "error", "message"), [
    (ComputePrecision, PlanError, "Unknown precision 'fp4': valid precisions are 'fp32', 'bf16', 'fp16', 'fp8'"
                                  " (nn.Linear only, per-tensor scales) and 'fp8-rowwise' (nn.Linear only, per-row"
                                  " scales)."),
    (SavedPrecision, PlanError, "Unknown saved precision 'fp4': valid saved precisions are 'fp32' (as computed),"),
    (GradCommDtype, ConfigError, "Unknown gradient communication dtype 'fp4': valid gradient communication dtypes"),
    (Timing, SearchConfigError, "Unknown value 'fp4': valid values are 'auto', 'wall' and 'cpu'."),
])
def test_a_bad_spelling_names_the_value_and_every_valid_one(enum: type, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        enum.parse("fp4")  # type: ignore[attr-defined]
    assert str(info.value).startswith(message)
    with pytest.raises(KeyError):
        enum["fp4"]
    with pytest.raises(PlanError, match=r"Unsupported dtype torch.int8 for a precision: valid dtypes are"
                                         r" torch.float32, torch.bfloat16, torch.float16"):
        ComputePrecision.parse(torch.int8)
    with pytest.raises(PlanError, match="Unknown saved precision torch.float16"):
        SavedPrecision.parse(torch.float16)  # no member names a dtype: a dtype is just an unknown value


def test_every_setting_choice_is_an_enum_of_its_own() -> None:
    assert [m.value for m in Mode] == ["min", "max"] and [m.value for m in ToleranceMode] == ["relative", "absolute"]
    assert [m.value for m in LowPrecision] == ["auto", "bf16", "fp16", "off"]


def test_choices_and_advice_are_generated_from_the_members() -> None:
    assert Timing.choices() == "'auto', 'wall' and 'cpu'" and Mode.alternatives() == "'min' or 'max'"
    assert quoted(["only"]) == "'only'" and quoted([Objective.MEMORY, "x"], last="and") == "'memory' and 'x'"


Pair = namedtuple("Pair", "a b")


@dataclass
class Output:
    logits: torch.Tensor
    note: str


def test_a_member_is_found_by_its_value_in_dicts_and_sets() -> None:
    """Equal to its value (str equality), so hashed like it: a dict keyed by members answers the spelled value."""
    keyed = {Objective.MEMORY: 1, ComputePrecision.BF16: 2}
    assert keyed["memory"] == 1 and keyed["bf16"] == 2 and "memory" in set(keyed)
    assert hash(SavedPrecision.FP8) == hash("fp8")


def test_the_walker_reaches_tensors_in_every_structure_and_keeps_its_types() -> None:
    bf16 = torch.ones(2, dtype=torch.bfloat16)
    structure = (bf16, [torch.ones(1), 3], {"x": Pair(bf16, "s")}, OrderedDict(y=bf16), Output(bf16, "n"), None)
    cast = cast_floating(structure, torch.float32)
    assert isinstance(cast[2]["x"], Pair) and isinstance(cast[3], OrderedDict) and isinstance(cast[4], Output)
    assert [t.dtype for t in tensors(cast)] == [torch.float32] * 5 and cast[1][1] == 3 and cast[4].note == "n"
    assert [t.dtype for t in tensors(structure)].count(torch.bfloat16) == 4  # the original is untouched
    assert has_dtype(structure, (torch.bfloat16,)) and not has_dtype(cast, (torch.bfloat16,))
    only = cast_floating((bf16, torch.ones(1, dtype=torch.float16)), torch.float32, only=(torch.float16,))
    assert [t.dtype for t in only] == [torch.bfloat16, torch.float32]
    assert cast_floating(torch.ones(1, dtype=torch.long), torch.float32).dtype == torch.long  # integers as they are
    assert map_tensors({"a": torch.ones(1)}, lambda t: t * 2)["a"].item() == 2.0
    assert to_device([torch.ones(1)], torch.device("meta"))[0].device.type == "meta"


def test_structures_are_equal_only_with_the_same_shape_of_containers_and_equal_leaves() -> None:
    same = lambda a, b: torch.equal(a, b)  # noqa: E731
    a = {"w": torch.ones(2), "steps": [1, 2]}
    assert structures_equal(a, {"w": torch.ones(2), "steps": [1, 2]}, same)
    assert structures_equal([torch.ones(1)], (torch.ones(1),), same)  # a list and a tuple of equal items
    for b in ({"w": torch.zeros(2), "steps": [1, 2]}, {"w": torch.ones(2), "steps": [1]}, {"w": torch.ones(2)},
              {"w": 1.0, "steps": [1, 2]}, {"w": torch.ones(2), "steps": [1, 3]}):
        assert not structures_equal(a, b, same), b


def test_tables_and_plain_values() -> None:
    assert format_table(("a", "bb"), [("x", None), ("long", 2)]).splitlines() == [
        "a     bb", "----  --", "x", "long  2"]
    value = plain({1: (ComputePrecision.BF16, {"s"}), "t": torch.tensor(0.5), "o": object, "n": None})
    assert value == {"1": ["bf16", ["s"]], "t": 0.5, "o": str(object), "n": None}
    assert json.loads(json.dumps(value)) == value
