"""Facts said once, and checked: the public surface is documented, every module says what it holds, and the
documents cite only files that exist.

- Every name of ``lightning_comp.__all__`` is explained in README.md's prose (in an inline code span, not only used
  in a snippet) and has a docstring of its own.
- Every module of the package opens with a docstring. A package's docstring that names its own modules (a table, a
  list) names all of them and only those that exist; most name none and leave each module to say what it holds.
- Every repository path README.md, ``docs/*.md`` and ``.ci/`` cite exists, and every test they cite by name
  (``test_file.py::test_name``).
"""

from __future__ import annotations

import ast
import inspect
import re
import types
from pathlib import Path

import pytest

import lightning_comp
from tests.helpers.paths import REPO

PACKAGE = REPO / "lightning_comp"
README = REPO / "README.md"
_FENCE = re.compile(r"^```[^\n]*\n.*?^```", flags=re.S | re.M)


def _prose(text: str) -> str:
    return _FENCE.sub("", text)


def _inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(text))


def test_the_public_surface_is_what_all_names() -> None:
    public = {name for name, value in vars(lightning_comp).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    assert public == set(lightning_comp.__all__)
    assert len(lightning_comp.__all__) == len(set(lightning_comp.__all__))


@pytest.mark.parametrize("name", lightning_comp.__all__)
def test_every_public_name_is_explained_in_the_readme_and_has_a_docstring(name: str) -> None:
    spans = _inline_code(README.read_text())
    assert any(re.search(rf"\b{name}\b", span) for span in spans), f"README.md's prose never names `{name}`"
    value = getattr(lightning_comp, name)
    own = value.__dict__.get("__doc__") if inspect.isclass(value) else value.__doc__
    assert own and own.strip(), f"lightning_comp.{name} has no docstring of its own"


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_opens_with_a_docstring(path: Path) -> None:
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring and docstring.split("\n\n")[0].strip(), f"{path.relative_to(REPO)} has no docstring"


def _own_modules(package: Path) -> set[str]:
    return {p.stem for p in package.glob("*.py") if p.name != "__init__.py"} | {
        p.name for p in package.iterdir() if (p / "__init__.py").is_file()}


def _cited_modules(docstring: str, package: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """What ``package``'s docstring says of its modules: every module it names as :mod:`<package>.name` (which must
    exist), and the index it keeps, if any: the modules opening a line (a table's first column, a list's items), as
    ``name``, ``name/`` or :mod:`<package>.name`."""
    dotted = re.escape(".".join(package.relative_to(REPO).parts))
    referenced = set(re.findall(rf":mod:`~?{dotted}\.(\w+)", docstring))
    leading = set(re.findall(r"^\s*(?:[-*]\s+)?``(\w+)/?``", docstring, flags=re.M)) & modules
    leading |= set(re.findall(rf"^\s*(?:[-*]\s+)?:mod:`~?{dotted}\.(\w+)", docstring, flags=re.M))
    return referenced | leading, leading


@pytest.mark.parametrize("package", sorted(p.parent for p in PACKAGE.rglob("__init__.py")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_a_package_docstring_that_indexes_its_modules_names_each_one_that_exists(package: Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    modules = _own_modules(package)
    cited, index = _cited_modules(docstring, package, modules)
    where = package.relative_to(REPO)
    assert cited <= modules, f"{where}'s docstring names modules that do not exist: {sorted(cited - modules)}"
    assert not index or index == modules, f"{where}'s docstring indexes modules but misses {sorted(modules - index)}"


def test_the_index_check_catches_a_missing_module_and_one_that_is_gone() -> None:
    package = PACKAGE / "execution" / "recompute"
    modules = _own_modules(package)
    listing = "\n".join(f"- :mod:`~lightning_comp.execution.recompute.{m}`: ..." for m in sorted(modules))
    assert _cited_modules(listing, package, modules) == (modules, modules)
    cited, index = _cited_modules(listing.replace(".saved`", ".gone`"), package, modules)
    assert "gone" in cited and index == modules - {"saved"} | {"gone"}
    table = "``saved``  what autograd keeps\n``fp32``, ``recipe``, :mod:`lightning_comp.execution.recompute.recipe`"
    assert _cited_modules(table, package, modules) == ({"saved", "recipe"}, {"saved"})


# a path, unless a glob or a brace expansion continues it (``busy_machine*.json``, ``seed{0,1}/``)
_PATH = re.compile(r"(?<![\w/.-])((?:lightning_comp|tests|benchmarks|examples|docs|conf|\.ci)/[\w./-]*[\w/])"
                   r"(?![\w.]*[*{])")
_PACKAGE_PATHS = [p for p in PACKAGE.rglob("*") if "__pycache__" not in p.parts]
_FILES = {p.name for p in REPO.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(REPO).parts)}


def _missing_paths(text: str, bare: bool = True) -> list[str]:
    """Repository paths ``text`` cites that do not exist: ``tests/...``-style paths anywhere, and in code spans paths
    inside the package, whole or from a package a sentence names (``execution/hooks.py``, ``decisions/trials.py``,
    ``search/rewind/``), and bare module files (``loop.py``)."""
    missing = {m.rstrip("/") for m in _PATH.findall(text)
               if "*" not in m and "<" not in m and not (REPO / m.rstrip("/")).exists()}
    for span in _inline_code(text):
        if not re.fullmatch(r"[\w/]+(\.py|/)", span):
            continue
        if "/" in span.rstrip("/"):
            inside = any(p.as_posix().endswith("/" + span.rstrip("/")) for p in _PACKAGE_PATHS)
            if not (inside or (REPO / span).exists()):
                missing.add(span)
        elif bare and span.endswith(".py") and span not in _FILES:
            missing.add(span)
    return sorted(missing)


def test_the_path_check_catches_a_path_that_is_gone() -> None:
    assert _missing_paths("`execution/hooks.py`, `rewind/loop.py`, `hooks.py`, [x](lightning_comp/plan/plan.py)") == []
    assert _missing_paths("see `execution/recompute.py` and tests/unit/test_gone.py, `gone.py`") == [
        "execution/recompute.py", "gone.py", "tests/unit/test_gone.py"]
    assert _missing_paths("benchmarks/results/busy*.json, tests/unit/test_{a,b}.py, `gone.py`", bare=False) == []


@pytest.mark.parametrize("document", [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / ".ci").iterdir())],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_a_document_cites_exists(document: Path) -> None:
    # docs/benchmark.md logs results: its history names the modules of their day (``casting.py``) by file name
    missing = _missing_paths(document.read_text(), bare=document.name != "benchmark.md")
    assert not missing, f"{document.relative_to(REPO)} cites paths that do not exist: {missing}"


def _missing_tests(text: str) -> list[str]:
    """The ``test_file.py::test_name`` references in ``text`` whose file or test does not exist."""
    sources: dict[str, list[str]] = {}
    for path in (REPO / "tests").rglob("test_*.py"):
        sources.setdefault(path.name, []).append(path.read_text())
    return sorted(f"{file}::{name}" for file, name in re.findall(r"(test_\w+\.py)::(\w+)", text)
                  if not any(re.search(rf"^\s*(?:async )?def {name}\(", source, flags=re.M)
                             for source in sources.get(file, [])))


@pytest.mark.parametrize("document", [README, *sorted((REPO / "docs").glob("*.md")), REPO / "examples" / "README.md"],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_test_a_document_cites_exists(document: Path) -> None:
    assert _missing_tests("see test_layers.py::test_an_upward_import_is_caught") == []
    missing = _missing_tests(document.read_text())
    assert not missing, f"{document.relative_to(REPO)} cites tests that do not exist: {missing}"
