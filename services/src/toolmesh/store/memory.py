"""The embedded, in-process store: the default when nothing else is configured."""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from toolmesh.store.base import VersionConflict, Versioned

# Sweep expired keys after this many writes, so memory stays bounded even
# for keys that are never read again.
_SWEEP_EVERY = 256


@dataclass(slots=True)
class _Entry:
    value: bytes
    version: int
    expires_at: float | None


class InMemoryStore:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._expiry_heap: list[tuple[float, str, int]] = []
        self._changed: dict[str, asyncio.Event] = {}
        self._writes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _live(self, key: str) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at is not None and entry.expires_at <= self._clock():
            del self._entries[key]
            self._notify(key)
            return None
        return entry

    def _notify(self, key: str) -> None:
        event = self._changed.pop(key, None)
        if event is not None:
            event.set()

    def _sweep(self) -> None:
        now = self._clock()
        while self._expiry_heap and self._expiry_heap[0][0] <= now:
            _, key, _ = heapq.heappop(self._expiry_heap)
            entry = self._entries.get(key)
            if entry is not None and entry.expires_at is not None and entry.expires_at <= now:
                del self._entries[key]
                self._notify(key)

    def _write(self, key: str, value: bytes, ttl_s: float | None, previous: _Entry | None) -> int:
        version = 1 if previous is None else previous.version + 1
        expires_at = None if ttl_s is None else self._clock() + ttl_s
        self._entries[key] = _Entry(value, version, expires_at)
        if expires_at is not None:
            heapq.heappush(self._expiry_heap, (expires_at, key, version))
        self._writes += 1
        if self._writes % _SWEEP_EVERY == 0:
            self._sweep()
        self._notify(key)
        return version

    async def get(self, key: str) -> Versioned | None:
        entry = self._live(key)
        return None if entry is None else Versioned(entry.value, entry.version)

    async def put(
        self, key: str, value: bytes, *, expected_version: int | None = None, ttl_s: float | None = None
    ) -> int:
        entry = self._live(key)
        if expected_version is not None:
            actual = 0 if entry is None else entry.version
            if actual != expected_version:
                raise VersionConflict(key, expected_version, actual)
        return self._write(key, value, ttl_s, entry)

    async def create(self, key: str, value: bytes, *, ttl_s: float | None = None) -> Versioned | None:
        entry = self._live(key)
        if entry is not None:
            return Versioned(entry.value, entry.version)
        self._write(key, value, ttl_s, None)
        return None

    async def delete(self, key: str) -> None:
        if self._entries.pop(key, None) is not None:
            self._notify(key)

    async def watch(self, key: str) -> AsyncIterator[Versioned | None]:
        while True:
            # Take the event before reading, so a change in between is not missed.
            changed = self._changed.setdefault(key, asyncio.Event())
            yield await self.get(key)
            await changed.wait()

    async def close(self) -> None:
        self._entries.clear()
        self._expiry_heap.clear()
