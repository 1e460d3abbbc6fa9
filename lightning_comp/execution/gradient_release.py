"""Releasing gradients as soon as the optimizer step has used them: :func:`release_gradients`.

Lightning's automatic optimization zeroes gradients inside the closure of the *next* step, after its forward (so
that a closure-evaluating optimizer such as LBFGS sees fresh ones): from one step's update to the next step's
backward, the FP32 gradients of every parameter stay allocated, through the forward whose end is where a training
step's memory usually peaks. Setting them to ``None`` right after the update frees them there; nothing reads them
before the next backward but user code that inspects ``p.grad`` between steps.
"""

from __future__ import annotations

from typing import Any

__all__ = ["release_gradients"]


def release_gradients(optimizer: Any) -> None:
    """Set the gradient of every parameter ``optimizer`` steps to ``None`` (``zero_grad(set_to_none=True)``'s effect,
    without an optimizer subclass's own ``zero_grad``, which may do more, e.g. log or reset its state)."""
    for group in getattr(optimizer, "param_groups", ()):
        for param in group["params"]:
            param.grad = None
