"""The package's import layers, and a checker of them that reads the source (nothing is imported).

Each package imports only the packages of lower layers (and its own modules); inside ``search`` the same holds
for its parts. Every import counts, those inside functions ("lazy" imports) too; only imports under
``if TYPE_CHECKING:`` are left out (they never run). No module may import itself through others (no cycles).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LAYERS", "SEARCH_LAYERS", "Violations", "check_layers", "import_graph"]

# bottom first; packages of one layer must not import each other
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("common", "adapters"),
    ("numerics",),
    ("operators",),
    ("devices",),
    ("plan",),
    ("execution",),
    ("plugins", "distributed"),
    ("search",),
    ("zoo",),
    ("", "conf"),  # the package's own __init__ (the public API) and the Hydra config tree
)
SEARCH_LAYERS: tuple[tuple[str, ...], ...] = (
    ("config", "candidates"),
    ("measurement",),
    ("decisions",),
    ("state",),
    ("ranks",),
    ("record",),
    ("rewind",),
    ("checks", "compiled"),
    ("stages",),
    ("callback",),
    ("",),  # search/__init__.py
)


@dataclass
class Violations:
    """What :func:`check_layers` found: upward (or sideways) imports, and import cycles."""

    upward: list[str]
    cycles: list[str]

    def __bool__(self) -> bool:
        return bool(self.upward or self.cycles)


def _modules(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(child) for child in ast.walk(node)}
    return skipped


def import_graph(root: Path, package: str = "lightning_comp") -> dict[str, set[str]]:
    """Module -> the package's modules it imports (resolved to the module that defines what is imported)."""
    modules = _modules(root, package)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = _type_checking_nodes(tree)
        targets: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if not base.startswith(package):
                    continue
                for alias in node.names:
                    target = resolve(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else resolve(base)
                    if target:
                        targets.add(target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(package) and (target := resolve(alias.name)):
                        targets.add(target)
        targets.discard(module)
        graph[module] = targets
    return graph


def _rank(parts: Sequence[str], layers: tuple[tuple[str, ...], ...]) -> int | None:
    head = parts[0] if parts else ""
    for index, layer in enumerate(layers):
        if head in layer:
            return index
    return None


def check_layers(root: Path, package: str = "lightning_comp") -> Violations:
    """Every import of a module of ``package`` (under ``root``) that goes up or sideways a layer, and every cycle."""
    graph = import_graph(root, package)
    upward = []
    for module, targets in sorted(graph.items()):
        mine = module.split(".")[1:]
        for target in sorted(targets):
            theirs = target.split(".")[1:]
            if mine[:1] == theirs[:1] and mine[:1] == ["search"]:  # inside the search: its own layers
                a, b, layers, where = mine[1:], theirs[1:], SEARCH_LAYERS, "search."
            else:
                a, b, layers, where = mine, theirs, LAYERS, ""
            if a[:1] == b[:1] and a[:1] != [""] and (where or a[:1] != ["search"]):
                continue  # within one package: only cycles matter
            ra, rb = _rank(a, layers), _rank(b, layers)
            if ra is None or rb is None:
                upward.append(f"{module} -> {target}: {where}{(a or [''])[0] if ra is None else (b or [''])[0]}"
                              " is in no layer")
            elif rb >= ra:
                upward.append(f"{module} -> {target}: layer {rb} ({where}{(b or [''])[0] or '__init__'}) is not"
                              f" below layer {ra} ({where}{(a or [''])[0] or '__init__'})")
    return Violations(upward, _cycles(graph))


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    found: list[str] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found
