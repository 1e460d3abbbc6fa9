"""Executing a precision plan on a model: hooks, cast boundaries, weight casts, saved tensors, recomputation,
optimizer state and master weights, loss scaling.

=====================  ====================================================================================
module                 what it holds
=====================  ====================================================================================
``saved_hooks``        handing saved tensors on to the saved-tensor hooks already in force
``weight_casts``       16-bit weight copies re-cast in backward instead of kept
``saved_tensors``      storing what operators save for backward at their planned saved precision
``recompute``          (a package) recipes instead of stored outputs for ``saved="recompute"`` operators,
                       recomputed in backward
``parameter_groups``   which operator owns each parameter (the unit of the ``state`` and ``master`` dimensions)
``optimizer_states``   8-bit/bf16 Adam moments and bf16 master weights: formats, the managed step, loading
``compiled_regions``   autocast regions TorchDynamo traces; eager runs; compiled-model detection
``cast_boundaries``    where a low operator's output may stay low, found by tracing one step
``calibration``        what the first step of each kind found of the cast boundaries, kept per plan
``hooks``              the pre- and post-hook of one operator (the hot path), and the note they add to an
                       exception its forward raises
``planned_operators``  each operator with its planned precisions and lowering; a tracing step's provisional ones
``hook_registry``      the hooks of each operator, and which operators need hooks at all
``executor``           :class:`PlanExecutor`: puts a plan into effect on a model; :class:`StepKind`
``emulation``          a plan on a device where its 16-bit precision is emulated: warn, or decline FP16
``loss_scaling``       the FP16 loss scaler's life cycle, a scaled optimizer step
``plugin_state``       what the precision plugin keeps in a checkpoint
=====================  ====================================================================================
"""

from lightning_comp.execution.executor import PlanExecutor, StepKind

__all__ = ["PlanExecutor", "StepKind"]
