"""Many deadlines on one timer of the event loop.

A request held until its deadline used to cost a timer of its own
(`loop.call_later`): about 390 bytes on asyncio's loop and 710 on uvloop's (a
libuv timer each), 4 to 7 MB for 10,000 held calls. Here a deadline costs a
heap entry and a dict entry, and the loop holds one timer, for the earliest.
Each one still fires at its own time (the timer is armed for it); one whose
expiry raises is reported to the loop's exception handler, as a timer's would
be, and stops none of the others.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

# uvloop's clock counts whole milliseconds and is read once per turn: its timer for a deadline
# may fire while the clock still reads up to a millisecond short of it (its own call_later too).
CLOCK_SLACK_S = 0.001
# A timer that fires may be the first thing a process does after a pause (SIGSTOP, a laptop lid, a
# starved loop) during which the other side answered: the answer waits, unread, in the socket,
# and the loop ran the due timer first. A wait for another process's word that times out looks
# again this much later, once, before it gives up.
PAUSE_GRACE_S = 0.5
# Entries of discarded deadlines are dropped from the heap once they outnumber the live ones by so
# much: a discard costs a dict removal, and the heap never holds more than about twice the live.
_COMPACT_OVER = 64


class Deadlines(Generic[K]):
    """`expire(key)` once `key`'s deadline comes (on the running loop's clock), unless discarded first."""

    def __init__(self, expire: Callable[[K], None]) -> None:
        self._expire = expire
        self._live: dict[K, int] = {}  # each key's entry, by its sequence number
        self._heap: list[tuple[float, int, K]] = []
        self._sequence = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for = math.inf

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def add(self, key: K, delay_s: float) -> None:
        """`key` expires `delay_s` from now (again: its earlier deadline no longer counts)."""
        loop = asyncio.get_running_loop()
        when = loop.time() + delay_s
        number = next(self._sequence)
        self._live[key] = number
        heapq.heappush(self._heap, (when, number, key))
        if when < self._armed_for:
            self._arm(loop, when)

    def discard(self, key: K) -> None:
        """`key` will not expire (nothing if it has expired or was never added)."""
        if self._live.pop(key, None) is None:
            return
        if len(self._heap) > 2 * len(self._live) + _COMPACT_OVER:
            self._heap = [entry for entry in self._heap if self._live.get(entry[2]) == entry[1]]
            heapq.heapify(self._heap)
        if not self._live:
            self._disarm()

    def close(self) -> None:
        """Forget every deadline; none expires."""
        self._live.clear()
        self._heap.clear()
        self._disarm()

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self._disarm()
        self._armed_for = when
        self._timer = loop.call_at(when, self._fire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()  # nothing, for the timer that is firing
        self._timer, self._armed_for = None, math.inf

    def _fire(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        now = loop.time() + CLOCK_SLACK_S
        heap, live = self._heap, self._live
        due: list[tuple[K, int]] = []
        while heap and (heap[0][0] <= now or live.get(heap[0][2]) != heap[0][1]):
            _, number, key = heapq.heappop(heap)
            if live.get(key) == number:
                due.append((key, number))
        if heap:
            self._arm(loop, heap[0][0])
        for key, number in due:
            # Called here, not from a callback of its own: a key discarded from now on (by the
            # expiry of another, or before) must not expire.
            if live.get(key) != number:
                continue
            del live[key]
            try:
                self._expire(key)
            except Exception as exc:  # reported as the loop reports a timer's, the others go on
                loop.call_exception_handler(
                    {"message": "a deadline's expiry failed", "exception": exc, "handle": self}
                )
