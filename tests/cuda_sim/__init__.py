"""CUDA simulated on a CPU-only torch: the plan's execution checked under CUDA's own autocast rules on every CI run.

A CPU build of torch carries CUDA's autocast op lists, and fake tensors on device ``cuda`` run through them. With a
tiny C++ shim (``shim.cpp``, built for the installed torch and loaded *before* torch) backward runs too. The checks in
``checks/`` drive the plugin's own entry points on fake CUDA tensors for simulated sm70, sm75, sm80 and sm90, record
every aten op with its operator, dtypes and devices (``recorder.py``), and hold them to a table of the operands CUDA
kernels require to share a dtype and to "no device-to-host copy". On a machine with a GPU the same checks run against
the real device (``python -m tests.cuda_sim.run --real``).

Nothing here imports torch at import time: ``run.py`` must load the shim first.
"""
