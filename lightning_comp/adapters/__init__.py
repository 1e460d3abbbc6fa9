"""Adapters: the one place each for the private torch and the private Lightning attributes the package touches.

Nothing outside this package reads, calls or patches a private torch, torchao or Lightning symbol. Each symbol has its
own test against the installed version (``tests/unit/test_torch_internals.py``,
``tests/unit/test_lightning_internals.py``), so an upgrade that moves one fails there, by name.
"""
