"""Messages waiting to go out on a stream, taken in batches.

A stream writer sends one message at a time and waits for each; whatever
became ready meanwhile goes out together in the next message. Under load that
turns many small messages (each a gRPC operation and a wake-up on both ends)
into a few larger ones, at no cost to a lone message.

A write takes little time, though, and concurrent calls become ready a few
turns of the event loop apart (each arrives as its own gRPC completion and
takes a few steps to its send): with 64 calls in flight, an outbox that took
what was there at once sent 1.1 calls per message. So an outbox told
`more_coming` (the owner's word that other items are on their way: calls in
flight that are not in the outbox yet) lets the event loop run up to
GATHER_TURNS more turns before it takes, while more are coming: a flush at
the end of the turns in which the items of concurrent calls arrive. A lone
item (nothing more coming) goes at once.

An item put with `within_s` (an answer nobody waits on at once) does not wake a
take: it goes with the next item put without one, or once `within_s` has
passed. On a quiet stream that saves a message each way per call.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from toolmesh.core.limits import MAX_CALLS_PER_MESSAGE

T = TypeVar("T")

# Well under the transport's message limit (limits.MAX_MESSAGE_BYTES),
# which a single item always fits.
BATCH_BYTES = 1024 * 1024
# Turns of the event loop a take lets run while more items are coming (see above): with 64 calls
# in flight, about 3.5 calls per message instead of 1.1.
GATHER_TURNS = 8


class Outbox(Generic[T]):
    """Items in order, taken in batches of at most `batch_bytes` and `batch_items` (one item at least)."""

    def __init__(
        self,
        size_of: Callable[[T], int],
        batch_bytes: int = BATCH_BYTES,
        batch_items: int = MAX_CALLS_PER_MESSAGE,
        more_coming: Callable[[], bool] | None = None,
    ) -> None:
        """`more_coming`: whether items not put yet are on their way (then a take gathers them)."""
        self._size_of = size_of
        self._more_coming = more_coming
        self._batch_bytes = batch_bytes
        self._batch_items = batch_items
        self._items: deque[tuple[T, int]] = deque()
        self._bytes = 0
        self._ready = asyncio.Event()
        self._closed = False
        # Wakes a take for the items put with `within_s` when none without came first.
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        """The sizes of the items waiting, added up."""
        return self._bytes

    def put(self, item: T, *, within_s: float | None = None) -> None:
        """Add `item`; with `within_s`, it may wait that long for another item to go with it."""
        size = self._size_of(item)
        self._items.append((item, size))
        self._bytes += size
        if within_s is None:
            self._ready.set()
        elif self._timer is None and not self._ready.is_set():
            self._timer = asyncio.get_running_loop().call_later(within_s, self._wake)

    def _wake(self) -> None:
        self._timer = None
        self._ready.set()

    def _forget_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def clear(self) -> None:
        """Drop every item waiting."""
        self._items.clear()
        self._bytes = 0
        self._forget_timer()

    def close(self) -> None:
        """No more items: `take` returns what is left, then an empty batch."""
        self._closed = True
        self._ready.set()

    async def take(self) -> list[T]:
        """The items ready now, oldest first, up to the budgets (at least one).

        Waits while there are none; [] once closed and empty. With `more_coming`, first lets the
        event loop run while it says so (up to GATHER_TURNS turns, or a full batch).
        """
        await self._ready.wait()
        if self._more_coming is not None:
            turns = 0
            while (
                turns < GATHER_TURNS
                and not self._closed
                and len(self._items) < self._batch_items
                and self._more_coming()
            ):
                await asyncio.sleep(0)
                turns += 1
            if not self._items and not self._closed:  # dropped meanwhile (clear): wait for more
                self._ready.clear()
                return await self.take()
        batch: list[T] = []
        total = 0
        while self._items and len(batch) < self._batch_items:
            item, size = self._items[0]
            if batch and total + size > self._batch_bytes:
                break
            self._items.popleft()
            batch.append(item)
            total += size
        self._bytes -= total
        if not self._items and not self._closed:
            self._ready.clear()
            self._forget_timer()  # its items went with these
        return batch
