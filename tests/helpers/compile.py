"""Counting TorchDynamo's graphs and graph breaks of a call (nothing is compiled)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["graph_breaks"]


def graph_breaks(fn: Any, *args: Any, **kwargs: Any) -> tuple[int, int, list[str]]:
    """Trace ``fn(*args, **kwargs)`` with TorchDynamo (``torch._dynamo.explain``) and count graphs and breaks.

    Returns:
        ``(graphs, breaks, reasons)``: the number of graphs, of graph breaks, and each break's reason.
    """
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = [str(getattr(b, "reason", b)) for b in explained.break_reasons]
    return int(explained.graph_count), int(explained.graph_break_count), reasons
