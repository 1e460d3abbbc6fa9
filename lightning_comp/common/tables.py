"""Plain-text tables, as the plan summary and the search's report print them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["format_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A left-aligned table: the header, a rule of dashes, one line per row (``None`` cells are empty)."""
    cells = [[str(c) for c in header]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells[0], widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells[1:]]
    return "\n".join(lines)
