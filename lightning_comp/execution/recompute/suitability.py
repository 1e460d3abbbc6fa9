"""Which operators the search offers ``saved="recompute"`` at all: :func:`recompute_unsuitable`."""

from __future__ import annotations

from torch import nn

from lightning_comp.operators.kinds import OperatorKind, classify, is_recurrent
from lightning_comp.operators.owned_work import runs_planned_work

__all__ = ["MAX_BUFFER_BYTES", "recompute_unsuitable"]

#: Operators with more bytes of buffers than this are not offered ``recompute`` (each recorded call copies them).
MAX_BUFFER_BYTES = 1 << 20


def recompute_unsuitable(module: nn.Module) -> str | None:
    """Why the search should not offer ``saved="recompute"`` for ``module`` (``None``: it may).

    Only cheap operators are worth recomputing (norms, activations, dropout, pooling, look-ups): recomputing a
    matmul, convolution, recurrent layer or attention costs as much as its forward, and a region around it is better
    checkpointed as a whole. Operators that only reshape free nothing; operators working in place overwrite the
    input the recipe needs; an operator's buffers are copied at every recorded call, so one holding more than
    :data:`MAX_BUFFER_BYTES` of them is not worth it. Whether an operator returns a tensor (or a tuple or list of
    them) shows only when it runs: one that does not is refused at its first training step.

    Args:
        module: the operator.
    """
    kind = classify(module)
    if kind is OperatorKind.SHAPE:
        return "it only reshapes: its output shares its input's memory, so recomputing it frees nothing"
    if getattr(module, "inplace", False) is True:
        return "it computes in place: it overwrites the input its output would be recomputed from"
    if is_recurrent(module):
        return "a recurrent layer costs as much to recompute as its forward, and returns nested tuples"
    if kind in (OperatorKind.COMPUTE, OperatorKind.FUNCTIONAL) or runs_planned_work(module):
        return ("it does matmul/convolution/attention work: recomputing it costs as much as its forward (checkpoint a"
                " region around it instead)")
    if kind is OperatorKind.OTHER:
        return "a user-defined operator with parameters: what recomputing it costs is unknown"
    buffer_bytes = sum(b.nbytes for b in module.buffers())
    if buffer_bytes > MAX_BUFFER_BYTES:
        return f"it holds {buffer_bytes} bytes of buffers, which every recorded call would copy"
    return None
