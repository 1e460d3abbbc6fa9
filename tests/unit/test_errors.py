"""Every exception the package raises is a ``CoMPError`` subclass: checked on the source, raise by raise."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_comp
from lightning_comp import errors

PACKAGE = Path(lightning_comp.__file__).parent

# The one built-in the package may raise: an abstract method's body (``NotImplementedError`` is its contract).
ALLOWED_BUILTINS = {"NotImplementedError"}


def raised_class_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Return ``(line, name)`` for every ``raise Name(...)`` or ``raise Name`` whose name is a class-like CapWord."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(target, ast.Name) and target.id[:1].isupper():
            found.append((node.lineno, target.id))
    return found


def test_the_scan_sees_a_bare_builtin_raise() -> None:
    tree = ast.parse("def f(x):\n    if x:\n        raise ValueError(x)\n    raise errors.ConfigError(x)\n")
    assert raised_class_names(tree) == [(3, "ValueError")]


def test_every_raise_in_the_package_is_a_comp_error() -> None:
    comp_errors = {name for name in errors.__all__ if issubclass(getattr(errors, name), errors.CoMPError)}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, name in raised_class_names(ast.parse(path.read_text(), filename=str(path))):
            if name not in comp_errors and name not in ALLOWED_BUILTINS:
                offenders.append(f"{path.relative_to(PACKAGE)}:{line}: raise {name}")
    assert not offenders, "raise a CoMPError subclass from lightning_comp.errors instead:\n" + "\n".join(offenders)


def test_each_error_class_is_also_the_builtin_a_caller_would_catch() -> None:
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.PlanError, errors.ConfigError)
    assert issubclass(errors.SearchConfigError, errors.ConfigError)
    assert issubclass(errors.UnsupportedSetupError, RuntimeError)
    assert issubclass(errors.UsageError, RuntimeError)
    assert issubclass(errors.MissingExtraError, ImportError)
