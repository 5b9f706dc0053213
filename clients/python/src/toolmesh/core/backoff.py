"""Waiting between attempts to reach a service again: growing, jittered, bounded."""

from __future__ import annotations

import random

from toolmesh.core.limits import RECONNECT_BACKOFF_FIRST_MS, RECONNECT_BACKOFF_MAX_MS


class Backoff:
    """Delays that double from `first_s` up to `max_s`, each drawn from its upper half (jitter).

    Bounded so that a service that comes back is reached within about `max_s`,
    however long it was gone; jittered so that many clients do not come back at once.
    """

    def __init__(
        self,
        first_s: float = RECONNECT_BACKOFF_FIRST_MS / 1000,
        max_s: float = RECONNECT_BACKOFF_MAX_MS / 1000,
    ) -> None:
        self._first_s = first_s
        self._max_s = max_s
        self._next_s = first_s

    def reset(self) -> None:
        """The service answered: the next wait starts from the first delay again."""
        self._next_s = self._first_s

    def next(self) -> float:
        """Seconds to wait before the next attempt."""
        delay = self._next_s * (0.5 + random.random() / 2)
        self._next_s = min(self._next_s * 2, self._max_s)
        return delay
