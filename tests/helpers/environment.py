"""The test process's environment: an Inductor cache of its own for each emulated CPU class.

Imports nothing of torch: ``tests/conftest.py`` sets the cache directory before torch is imported.
"""

from __future__ import annotations

import getpass
import os
import tempfile

__all__ = ["inductor_cache_for_capability"]


def inductor_cache_for_capability(env: dict[str, str]) -> dict[str, str]:
    """``env`` with an Inductor cache of its own where it sets ``ATEN_CPU_CAPABILITY``.

    Inductor's on-disk cache does not tell kernels built for one ATen CPU capability from another's: a process that
    emulates the AVX2 class and a native one sharing it load each other's kernels (NaN from compiled bf16 layers under
    the emulation, heap corruption natively; seen with torch 2.13).
    """
    capability = env.get("ATEN_CPU_CAPABILITY")
    if not capability or "TORCHINDUCTOR_CACHE_DIR" in env:
        return env
    user = getpass.getuser()
    return {**env, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_{capability}")}
