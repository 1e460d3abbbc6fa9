"""Recomputation instead of storage: operators whose plan entry saves ``"recompute"``.

An operator X saving ``recompute`` keeps none of its outputs for backward. Wherever autograd saves one of them (or a
view of one, or a cast of one a consumer made) in a training step, in any operator, in the model's own functional
code, or in X itself (ReLU, Sigmoid, Tanh and Softmax save their result), a *recipe* is stored instead: X, the
inputs its forward received (after the pre-hook's casts, held by reference), and what reproduces the forward (RNG,
autocast state, functional-region depth, the step's cast boundaries, a copy of X's buffers). Backward unpacks the
recipe by calling X again under ``torch.no_grad()``, through its hooks, so X computes in the precision it did in the
step. Recipes are made only in training steps whose autograd records; validation, ``no_grad`` and inference run X as
usual.

One concept a module, in the order a step meets them:

- :mod:`~lightning_comp.execution.recompute.recomputer`: :class:`Recomputer`, the saved-tensor hooks in force for a
  training step's forward and the wrapped pre-/post-hooks of each recompute operator that make its recipes;
- :mod:`~lightning_comp.execution.recompute.recognition`: which recorded output (or view, or consumer's cast of
  one) a saved tensor is, found by identity, view base or autograd node;
- :mod:`~lightning_comp.execution.recompute.forward_state`: the RNG, autocast and buffer (BatchNorm statistics)
  state a forward depended on, captured at its call and put back to re-run it;
- :mod:`~lightning_comp.execution.recompute.recipe`: the recipe of one call, its inputs and outputs, and its
  recomputation in backward (cached while references to it live; refused loudly where it would be wrong);
- :mod:`~lightning_comp.execution.recompute.saved`: what autograd keeps in place of a claimed tensor, and the unpack
  hook;
- :mod:`~lightning_comp.execution.recompute.suitability`: :func:`recompute_unsuitable`, which operators the search
  does not offer ``recompute`` at all.
"""

from lightning_comp.execution.recompute.recomputer import Recomputer
from lightning_comp.execution.recompute.suitability import MAX_BUFFER_BYTES, recompute_unsuitable

__all__ = ["MAX_BUFFER_BYTES", "Recomputer", "recompute_unsuitable"]
