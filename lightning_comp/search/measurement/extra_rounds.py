"""The budget of extra measured rounds when the first rounds cannot tell two configurations apart."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from lightning_comp.search.config import SearchConfig

__all__ = ["ExtraRounds"]


class ExtraRounds:
    """Extra rounds worth a fraction (``extra_profile_time``) of the first rounds' time, at least half a second.

    Args:
        config: the search's settings.
        first_seconds: how long the first rounds took (warm-up included).
        first_rounds: how many rounds that was.
    """

    MAX_CHUNK = 16  # rounds added at a time (tiny models: many rounds fit the budget; re-check between chunks)
    MIN_SECONDS = 0.5  # small models get at least this much: their rounds are short and noisy, and cheap

    def __init__(self, config: SearchConfig, first_seconds: float, first_rounds: int) -> None:
        self.per_round = first_seconds / max(first_rounds, 1)
        fraction = config.extra_profile_time
        self.left = max(first_seconds * fraction, self.MIN_SECONDS) if fraction > 0 else 0.0
        self.chunk = max(config.profile_steps, 2)

    def next_rounds(self) -> int:
        """How many rounds to add now (0: the budget is spent)."""
        affordable = int(self.left // self.per_round) if self.per_round > 0 else self.MAX_CHUNK
        return max(0, min(self.chunk, affordable, self.MAX_CHUNK))

    @contextmanager
    def spending(self) -> Iterator[None]:
        """Charge the block's time to the budget (and double the next chunk)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.left -= time.perf_counter() - started
            self.chunk = min(self.chunk * 2, self.MAX_CHUNK)
