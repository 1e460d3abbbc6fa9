"""The search on a model compiled with ``torch.compile``: it measures and trials eagerly.

Every plan the search puts into effect changes the operators' hooks, and TorchDynamo would compile a new graph for
each one (seconds to minutes apiece, and past ``torch._dynamo.config.recompile_limit`` it gives up compiling the
model for the rest of the run). So from the batch stage to the decision, compiled code runs eagerly
(:func:`lightning_comp.execution.compiled_regions.eager`); the FP32 warm-up before it and the training after it run
compiled, the latter with the chosen plan traced into the graph. The batch stage's times are therefore eager times.
"""

from __future__ import annotations

from contextlib import ExitStack

from lightning_comp.execution.compiled_regions import eager
from lightning_comp.search.state import Phase

__all__ = ["EagerWhileSearching"]


class EagerWhileSearching:
    """Holds compiled code eager while the search is in its measuring phase; a no-op for uncompiled models."""

    def __init__(self) -> None:
        self._held = ExitStack()
        self._active = False

    @property
    def active(self) -> bool:
        """Whether compiled code runs eagerly now because of the search."""
        return self._active

    def follow(self, phase: Phase, compiled: bool) -> None:
        """Hold compiled code eager if ``compiled`` and the search is measuring or trialling, else release."""
        wanted = compiled and phase in (Phase.MEASURING, Phase.SEARCHING)
        if wanted and not self._active:
            self._held.enter_context(eager())
            self._active = True
        elif not wanted:
            self.release()

    def release(self) -> None:
        """Let compiled code run compiled again."""
        if self._active:
            self._held.close()
            self._held = ExitStack()
            self._active = False
