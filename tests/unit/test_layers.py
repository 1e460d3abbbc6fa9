"""The package's import layers hold: each package imports only the ones below it, with no cycle, lazy imports
included (``tests/helpers/layers.py`` says which layers there are). The checker itself is shown to catch an upward
import, a lazy one and a cycle, in a copy of the package."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.layers import LAYERS, SEARCH_LAYERS, check_layers, import_graph
from tests.helpers.paths import REPO


def test_every_package_imports_only_the_layers_below_it_and_nothing_imports_itself() -> None:
    found = check_layers(REPO)
    assert not found.upward, "\n".join(found.upward)
    assert not found.cycles, "\n".join(found.cycles)


def test_every_package_and_part_of_the_search_is_in_a_layer() -> None:
    packages = {p.name for p in (REPO / "lightning_comp").iterdir() if p.suffix == ".py" or p.is_dir()}
    packages = {p.removesuffix(".py") for p in packages if not p.startswith("__")} | {""}
    assert packages <= {name for layer in LAYERS for name in layer} | {"py.typed"}, packages
    parts = {p.name.removesuffix(".py") for p in (REPO / "lightning_comp" / "search").iterdir()
             if not p.name.startswith("__")} | {""}
    assert parts == {name for layer in SEARCH_LAYERS for name in layer}


@pytest.fixture
def copy_of_the_package(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "lightning_comp", tmp_path / "lightning_comp",
                    ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    return tmp_path


def _append(root: Path, module: str, code: str) -> None:
    path = root / "lightning_comp" / module
    path.write_text(path.read_text() + "\n" + code + "\n")


def test_an_upward_import_is_caught(copy_of_the_package: Path) -> None:
    _append(copy_of_the_package, "numerics/precision.py", "from lightning_comp.search.config import Objective")
    found = check_layers(copy_of_the_package)
    assert found.upward == [
        "lightning_comp.numerics.precision -> lightning_comp.search.config: layer 8 (search) is not below layer 2"
        " (numerics)"]


def test_a_lazy_import_inside_a_function_is_caught_and_one_only_for_type_checking_is_not(
        copy_of_the_package: Path) -> None:
    _append(copy_of_the_package, "devices/lowering.py",
            "def _late() -> None:\n    from lightning_comp.plan.plan import PrecisionPlan  # noqa\n")
    _append(copy_of_the_package, "devices/kernel_probes.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_comp.plan import PrecisionPlan\n")
    assert check_layers(copy_of_the_package).upward == [
        "lightning_comp.devices.lowering -> lightning_comp.plan.plan: layer 5 (plan) is not below layer 4 (devices)"]


def test_a_cycle_inside_a_package_and_a_sideways_import_are_caught(copy_of_the_package: Path) -> None:
    _append(copy_of_the_package, "execution/saved_hooks.py", "from lightning_comp.execution.executor import StepKind")
    _append(copy_of_the_package, "search/measurement/clocks.py", "import lightning_comp.search.state")
    found = check_layers(copy_of_the_package)
    cycle = "lightning_comp.execution.saved_hooks -> lightning_comp.execution.executor"
    assert any(c.startswith("lightning_comp.execution.executor -> ") and c.endswith(cycle) for c in found.cycles), found
    assert found.upward == [
        "lightning_comp.search.measurement.clocks -> lightning_comp.search.state: layer 3 (search.state) is not"
        " below layer 1 (search.measurement)"]


def test_the_graph_resolves_names_to_the_modules_that_define_them() -> None:
    graph = import_graph(REPO)
    assert "lightning_comp.devices.lowering" in graph["lightning_comp.execution.planned_operators"]
    assert "lightning_comp.plugins.comp" in graph["lightning_comp.search.stages.batch_stage"]
    assert not any(t.startswith("lightning_comp.search") for t in graph["lightning_comp.plugins.comp"])


def _documented_layers() -> tuple[dict[int, set[str]], list[set[str]]]:
    """docs/architecture.md's layer table (layer -> packages) and its sentence on the search's parts, bottom first."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = {int(n): {tok.removesuffix("/").replace("lightning_comp", "") for tok in re.findall(r"`([^`]+)`", cell)
                      if tok != "__init__"}
             for n, cell in re.findall(r"^\| (\d+) \| ([^|]+) \|", text, flags=re.M)}
    sentence = text.split("Inside `search/`, bottom first:")[1].split("\n\n")[0]
    while re.search(r"\([^()]*\)", sentence):  # asides, nested ones too
        sentence = re.sub(r"\([^()]*\)", "", sentence)
    parts = [{tok.removesuffix("/") for tok in re.findall(r"`([^`]+)`", step)} for step in sentence.split(";")]
    return table, parts


def test_docs_architecture_shows_the_layers_the_checker_holds() -> None:
    table, parts = _documented_layers()
    assert table == {index: set(layer) for index, layer in enumerate(LAYERS)}
    assert parts == [set(layer) for layer in SEARCH_LAYERS if layer != ("",)]
