"""Readable tables of a plan: its entries, or one row per operator of a model with both of its precisions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lightning_comp.operators.discovery import iter_operators

if TYPE_CHECKING:
    from lightning_comp.plan.plan import PrecisionPlan

__all__ = ["plan_summary"]


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(f"{h:<{w}}" for h, w in zip(header, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths)).rstrip() for r in rows]
    return lines


def plan_summary(plan: PrecisionPlan, model: nn.Module | None = None) -> str:
    """The plan's entries as a table; with ``model``, one row per operator: its compute precision, the precision of
    what it saves for backward (when the plan sets any), and the selectors that decided them."""
    saved = plan.compresses_saved
    if model is None:
        selectors = sorted({s for s, _ in plan.entries} | {s for s, _ in plan.saved})
        compute, stored = dict(plan.entries), dict(plan.saved)
        rows = [(s, compute[s].value if s in compute else "-", *((stored[s].value if s in stored else "-",)
                                                                   if saved else ())) for s in selectors]
        rows.append(("<default>", plan.default.value, *((plan.saved_default.value,) if saved else ())))
        return "\n".join(_table(("selector", "precision", *(("saved",) if saved else ())), rows))
    explain = plan.explain(model)
    explain_saved = plan.explain_saved(model) if saved else {}
    rows2 = []
    for name, module in iter_operators(model):
        params = sum(p.numel() for p in module.parameters())
        row = [name or "<root>", type(module).__name__, f"{params:,}", plan.precision_of(name, type(module)).value]
        if saved:
            row.append(plan.saved_of(name, type(module)).value)
        row.append(explain[name] if not saved or explain_saved[name] == explain[name]
                   else f"{explain[name]} / {explain_saved[name]}")
        rows2.append(tuple(row))
    header = ("operator", "type", "params", "precision", *(("saved",) if saved else ()), "decided by")
    lines = _table(header, rows2)
    low = sum(1 for r in rows2 if r[3] != "fp32")
    tail = f"{low} of {len(rows2)} operators in 16-bit precision"
    if saved:
        tail += f", {sum(1 for r in rows2 if r[4] != 'fp32')} save for backward in bf16/fp8"
    lines.append(tail)
    return "\n".join(lines)
