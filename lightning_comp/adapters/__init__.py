"""Adapters: the one place each for the private torch and the private Lightning attributes the package touches.

=========================  ==================================================================================
module                     what it adapts
=========================  ==================================================================================
``torch_internals``        autocast regions Dynamo traces, saved-tensor hooks in force, parameter swaps, CPU
                           feature probes, module base classes, ``torch.compile``'s wrapper, autograd node names
``lightning_internals``    the fit loop's limits, validation schedule, dataloaders, callbacks, fused-optimizer
                           unscaling, compiled models, DDP communication hooks
=========================  ==================================================================================

Each symbol has its own test (``tests/unit/test_torch_internals.py``, ``tests/unit/test_lightning_internals.py``).
"""
