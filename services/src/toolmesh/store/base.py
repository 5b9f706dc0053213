"""The one store interface behind toolmesh's state.

A small versioned key-value store with expiry and change notification. The
registry, the invocation ledger and host routing keep their records
in it as bytes, so that an in-memory store (the embedded default) and a shared
one (Redis, for replicas) can serve them alike, held to the same contract tests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Versioned:
    value: bytes
    # Moves on every write of the key; starts at 1 for a new key.
    version: int


class VersionConflict(Exception):
    """A conditional write found another version than the one expected."""

    def __init__(self, key: str, expected: int, actual: int) -> None:
        super().__init__(f"{key}: expected version {expected}, found {actual}")
        self.expected = expected
        self.actual = actual


class Store(Protocol):
    async def get(self, key: str) -> Versioned | None:
        """The key's value and version, or None when absent or expired."""
        ...

    async def put(
        self, key: str, value: bytes, *, expected_version: int | None = None, ttl_s: float | None = None
    ) -> int:
        """Write the key; return its new version.

        With `expected_version`, write only if the current version equals it
        (0 means "absent"), else raise VersionConflict. `ttl_s` makes the key
        expire; None keeps it until deleted or overwritten without a ttl.
        """
        ...

    async def create(self, key: str, value: bytes, *, ttl_s: float | None = None) -> Versioned | None:
        """Write the key only if it is absent. Return None when written, else the existing value."""
        ...

    async def delete(self, key: str) -> None: ...

    async def delete_if_value(self, key: str, value: bytes) -> bool:
        """Delete the key only if its value is `value`, in one atomic step; whether it was deleted."""
        ...

    def watch(self, key: str) -> AsyncGenerator[Versioned | None, None]:
        """Yield the key's current state, then its state after each change (its expiry included).

        A slow reader may miss intermediate versions but always sees the latest.
        A backend that can become unreachable waits through the outage and reads
        again when it is back.
        """
        ...

    async def close(self) -> None: ...


async def until_set(event: asyncio.Event, timeout_s: float | None) -> None:
    """Wait for `event`, or `timeout_s` (None: no limit), whichever comes first."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
