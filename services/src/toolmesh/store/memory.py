"""The embedded, in-process store: the default when nothing else is configured.

Every operation here is synchronous underneath (nothing awaits between its
read and its write), so each is atomic within the process, as a Redis
script is atomic on the server.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from toolmesh.store.base import VersionConflict, Versioned, until_set
from toolmesh.store.ledger import (
    FIRST_ATTACHMENT,
    Delivered,
    KeyReused,
    LeaseRefused,
    LeaseTerms,
    MarkVerdict,
    StartMark,
    StoredInvocation,
)

# Sweep expired keys after this many writes, so memory stays bounded even
# for keys that are never read again.
_SWEEP_EVERY = 256

V = TypeVar("V")
T = TypeVar("T")
_NOTHING: Any = object()
# Shared: an empty frozenset is a new object each time (about 200 bytes).
_NONE: frozenset[str] = frozenset()


@dataclass(slots=True)
class _Entry(Generic[V]):
    value: V
    version: int
    expires_at: float | None


class Table(Generic[V]):
    """Keys with values, versions, expiry and change events, in process memory."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._entries: dict[str, _Entry[V]] = {}
        self._expiry_heap: list[tuple[float, str]] = []
        # The keys someone watches: their change event, and how many watch them. A key's
        # entry goes when its last watcher leaves, so keys watched once do not pile up.
        self._changed: dict[str, asyncio.Event] = {}
        self._watchers: dict[str, int] = {}
        self._writes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def live(self, key: str) -> _Entry[V] | None:
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
            _, key = heapq.heappop(self._expiry_heap)
            entry = self._entries.get(key)
            if entry is not None and entry.expires_at is not None and entry.expires_at <= now:
                del self._entries[key]
                self._notify(key)

    def write(self, key: str, value: V, ttl_s: float | None, *, notify: bool = True) -> int:
        """Set the key (a new version); `ttl_s` None keeps it until deleted or overwritten."""
        previous = self.live(key)
        version = 1 if previous is None else previous.version + 1
        expires_at = None if ttl_s is None else self._clock() + ttl_s
        self._entries[key] = _Entry(value, version, expires_at)
        if expires_at is not None:
            heapq.heappush(self._expiry_heap, (expires_at, key))
        self._writes += 1
        if self._writes % _SWEEP_EVERY == 0:
            self._sweep()
        if notify:
            self._notify(key)
        return version

    def remove(self, key: str) -> None:
        if self._entries.pop(key, None) is not None:
            self._notify(key)

    def changed(self, key: str) -> asyncio.Event:
        """An event set at the key's next change (taken before reading, so no change is missed)."""
        return self._changed.setdefault(key, asyncio.Event())

    @property
    def watched_keys(self) -> int:
        """How many keys hold watch state (a change event or a watcher count)."""
        return len(self._changed.keys() | self._watchers.keys())

    def expires_in(self, key: str) -> float | None:
        entry = self._entries.get(key)
        if entry is None or entry.expires_at is None:
            return None
        return max(0.0, entry.expires_at - self._clock())

    async def watch(self, key: str, state: Callable[[], T]) -> AsyncGenerator[T, None]:
        """`state()` now, then after each change of the key (its expiry included), when it differs."""
        last: T = _NOTHING
        self._watchers[key] = self._watchers.get(key, 0) + 1
        try:
            while True:
                changed = self.changed(key)
                current = state()
                if current != last:
                    last = current
                    yield current
                await until_set(changed, self.expires_in(key))
        finally:
            self._leave(key)

    def _leave(self, key: str) -> None:
        left = self._watchers[key] - 1
        if left:
            self._watchers[key] = left
            return
        del self._watchers[key]
        self._changed.pop(key, None)  # nobody waits on it any more

    def clear(self) -> None:
        self._entries.clear()
        self._expiry_heap.clear()


class Leases:
    """Each key's held leases and when each lapses; a key goes when it holds none."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[str, dict[str, float]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def take(self, key: str, lease_id: str, limit: int, ttl_s: float) -> bool:
        now = self._clock()
        held = {lease: until for lease, until in self._held.get(key, {}).items() if until > now}
        if len(held) >= limit and lease_id not in held:
            self._held[key] = held
            return False
        held[lease_id] = now + ttl_s
        self._held[key] = held
        return True

    def give_back(self, key: str, lease_id: str) -> None:
        held = self._held.get(key)
        if held is None:
            return
        held.pop(lease_id, None)
        if not held:
            del self._held[key]


class InMemoryStore:
    """The Store interface over one in-process Table."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._table: Table[bytes] = Table(clock)

    def __len__(self) -> int:
        return len(self._table)

    @property
    def watched_keys(self) -> int:
        """How many keys hold watch state: it goes when their last watcher leaves."""
        return self._table.watched_keys

    async def get(self, key: str) -> Versioned | None:
        return self._versioned(key)

    async def put(
        self, key: str, value: bytes, *, expected_version: int | None = None, ttl_s: float | None = None
    ) -> int:
        if expected_version is not None:
            entry = self._table.live(key)
            actual = 0 if entry is None else entry.version
            if actual != expected_version:
                raise VersionConflict(key, expected_version, actual)
        return self._table.write(key, value, ttl_s)

    async def create(self, key: str, value: bytes, *, ttl_s: float | None = None) -> Versioned | None:
        entry = self._table.live(key)
        if entry is not None:
            return Versioned(entry.value, entry.version)
        self._table.write(key, value, ttl_s)
        return None

    async def delete(self, key: str) -> None:
        self._table.remove(key)

    async def delete_if_value(self, key: str, value: bytes) -> bool:
        entry = self._table.live(key)
        if entry is None or entry.value != value:
            return False
        self._table.remove(key)
        return True

    def watch(self, key: str) -> AsyncGenerator[Versioned | None, None]:
        return self._table.watch(key, lambda: self._versioned(key))

    def _versioned(self, key: str) -> Versioned | None:
        entry = self._table.live(key)
        return None if entry is None else Versioned(entry.value, entry.version)

    async def close(self) -> None:
        self._table.clear()


@dataclass(frozen=True, slots=True)
class _Invocation:
    record: bytes
    finished: bool
    delivered: bool
    # How long the record is kept once finished (and again from its confirmation).
    keep_s: float
    # The identity pointer naming it ("" for a call with an idempotency key).
    identity: str
    # Finished with an outcome retries may be given again (see LedgerStore.finish).
    replayable: bool = True
    # How many attachments it has had; the last one's id is this number.
    attachments: int = 1
    # The attachments whose delivery is not confirmed.
    unconfirmed: frozenset[str] = frozenset((FIRST_ATTACHMENT,))
    # A call joined it while it ran: a cancellation leaves it alone.
    joined: bool = False
    # A cancellation finished it (a later finish says so).
    cancelled: bool = False
    # The lease key its claim took a place under ("" for none), given back when it finishes.
    lease: str = ""
    # Its dispatch generation, and when a start was marked (Unix ms; 0: none): LedgerStore.redispatch.
    generation: int = 1
    started_at_ms: int = 0
    # Who marked that start (StartMark.marker).
    started_by: str = ""
    # What LedgerStore.keep_late kept (b"": nothing).
    late: bytes = b""

    def attached(self) -> _Invocation:
        """With one more attachment (unconfirmed, unless all were confirmed already); joined, when
        it still runs."""
        count = self.attachments + 1
        unconfirmed = self.unconfirmed if self.delivered else self.unconfirmed | {str(count)}
        joined = self.joined or not self.finished
        return replace(self, attachments=count, unconfirmed=unconfirmed, joined=joined)


@dataclass(frozen=True, slots=True)
class _KeyClaim:
    tool_request_id: str
    identity: str


class MemoryLedgerStore:
    """The LedgerStore port in process memory: each operation is one synchronous step."""

    # No operation awaits anything (each is one step): see LedgerStore.synchronous.
    synchronous = True
    claims_replicated = False

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # Places among calls in flight, which claims take and finishes give back (LeaseTerms).
        self._leases = Leases(clock)
        self._invocations: Table[_Invocation] = Table(clock)
        # identity -> the tool request id of the running or unconfirmed invocation.
        self._identities: Table[str] = Table(clock)
        # (session, idempotency key) -> the invocation that claimed it.
        self._keys: Table[_KeyClaim] = Table(clock)

    def __len__(self) -> int:
        return len(self._invocations) + len(self._identities) + len(self._keys) + len(self._leases)

    @property
    def watched_keys(self) -> int:
        """How many invocations hold watch state: it goes when their last watcher leaves."""
        return self._invocations.watched_keys

    def _stored(self, tool_request_id: str) -> StoredInvocation | None:
        entry = self._invocations.live(tool_request_id)
        if entry is None:
            return None
        invocation = entry.value
        return StoredInvocation(
            tool_request_id,
            invocation.record,
            invocation.delivered,
            generation=invocation.generation,
            started_at_ms=invocation.started_at_ms,
            late=invocation.late,
        )

    def _store_running(
        self, tool_request_id: str, record: bytes, identity: str, ttl_s: float, lease: LeaseTerms | None
    ) -> None:
        """Store a new invocation, its lease taken first (LeaseRefused, nothing stored, when it cannot be)."""
        if lease is not None and not self._leases.take(lease.key, tool_request_id, lease.limit, lease.ttl_s):
            raise LeaseRefused(lease.key)
        running = _Invocation(record, False, False, ttl_s, identity, lease="" if lease is None else lease.key)
        self._invocations.write(tool_request_id, running, ttl_s)

    def _attach(
        self, tool_request_id: str, entry_ttl: float | None, invocation: _Invocation
    ) -> StoredInvocation:
        attached = invocation.attached()
        # An attachment changes nothing a watcher waits for: no change event, same expiry.
        self._invocations.write(tool_request_id, attached, entry_ttl, notify=False)
        return StoredInvocation(
            tool_request_id, attached.record, attached.delivered, str(attached.attachments)
        )

    async def claim(
        self,
        tool_request_id: str,
        record: bytes,
        identity: str,
        running_ttl_s: float,
        *,
        confirmed: Sequence[Delivered] = (),
        lease: LeaseTerms | None = None,
    ) -> StoredInvocation | None:
        self._confirm(confirmed)
        pointer = self._identities.live(identity)
        if pointer is not None and pointer.value != tool_request_id:
            other = self._invocations.live(pointer.value)
            if other is not None and not other.value.delivered:
                return self._attach(pointer.value, self._invocations.expires_in(pointer.value), other.value)
        self._store_running(tool_request_id, record, identity, running_ttl_s, lease)
        self._identities.write(identity, tool_request_id, running_ttl_s)
        return None

    async def claim_keyed(
        self,
        tool_request_id: str,
        record: bytes,
        key: str,
        identity: str,
        *,
        running_ttl_s: float,
        key_ttl_s: float,
        confirmed: Sequence[Delivered] = (),
        lease: LeaseTerms | None = None,
    ) -> StoredInvocation | None:
        self._confirm(confirmed)
        claimed = self._keys.live(key)
        if claimed is not None and claimed.value.tool_request_id != tool_request_id:
            if claimed.value.identity != identity:
                raise KeyReused(claimed.value.tool_request_id)
            named = claimed.value.tool_request_id
            entry = self._invocations.live(named)
            if entry is not None and entry.value.replayable:
                return self._attach(named, self._invocations.expires_in(named), entry.value)
        self._store_running(tool_request_id, record, "", running_ttl_s, lease)
        self._keys.write(key, _KeyClaim(tool_request_id, identity), key_ttl_s)
        return None

    async def cancel(
        self, tool_request_id: str, record: bytes, identity: str, keep_s: float, replay_s: float
    ) -> str | None:
        running = self._invocations.live(tool_request_id)
        if running is None:
            return None
        if running.value.finished:
            return "ended"
        if running.value.joined:
            return "joined"
        self._finish(
            tool_request_id, running.value, record, identity, keep_s=keep_s, replay_s=replay_s, cancelled=True
        )
        return "cancelled"

    async def finish(
        self, tool_request_id: str, record: bytes, identity: str, keep_s: float, replay_s: float | None
    ) -> str:
        running = self._invocations.live(tool_request_id)
        if running is None:
            return "ended"
        if running.value.finished:
            return "cancelled" if running.value.cancelled else "ended"
        self._finish(tool_request_id, running.value, record, identity, keep_s=keep_s, replay_s=replay_s)
        return "wrote"

    def _finish(
        self,
        tool_request_id: str,
        running: _Invocation,
        record: bytes,
        identity: str,
        *,
        keep_s: float,
        replay_s: float | None,
        cancelled: bool = False,
    ) -> None:
        # Its attachments stay as the claims made them.
        finished = _Invocation(
            record,
            True,
            False,
            keep_s,
            identity,
            replay_s is not None,
            running.attachments,
            running.unconfirmed,
            cancelled=cancelled,
            generation=running.generation,
            started_at_ms=running.started_at_ms,
        )
        # It outlives its pointer: a retry the pointer leads here must find it.
        self._invocations.write(tool_request_id, finished, max(keep_s, replay_s or 0.0))
        if running.lease:
            self._leases.give_back(running.lease, tool_request_id)
        if not identity:
            return
        if replay_s is not None:
            self._identities.write(identity, tool_request_id, replay_s)
        else:
            self._drop_pointer(identity, tool_request_id)

    def _drop_pointer(self, identity: str, tool_request_id: str) -> None:
        pointer = self._identities.live(identity)
        if pointer is not None and pointer.value == tool_request_id:
            self._identities.remove(identity)

    async def confirm(self, deliveries: Sequence[Delivered]) -> list[str]:
        return self._confirm(deliveries)

    def _confirm(self, deliveries: Sequence[Delivered]) -> list[str]:
        running = []
        for tool_request_id, attachment_id in deliveries:
            entry = self._invocations.live(tool_request_id)
            if entry is None or entry.value.delivered:
                continue
            invocation = entry.value
            if not invocation.finished:
                running.append(tool_request_id)
                continue
            unconfirmed = invocation.unconfirmed - {attachment_id} if attachment_id else _NONE
            # Nobody waits for a delivery: no change event.
            if unconfirmed:
                confirmed = replace(invocation, unconfirmed=unconfirmed)
                self._invocations.write(
                    tool_request_id, confirmed, self._invocations.expires_in(tool_request_id), notify=False
                )
                continue
            delivered = replace(invocation, delivered=True, unconfirmed=_NONE)
            self._invocations.write(tool_request_id, delivered, invocation.keep_s, notify=False)
            if invocation.identity:
                self._drop_pointer(invocation.identity, tool_request_id)
        return running

    async def release_lease(self, key: str, tool_request_id: str) -> None:
        self._leases.give_back(key, tool_request_id)

    async def mark_started(self, marks: Sequence[StartMark]) -> list[MarkVerdict]:
        return [self._mark(mark) for mark in marks]

    def _mark(self, mark: StartMark) -> MarkVerdict:
        entry = self._invocations.live(mark.tool_request_id)
        if entry is None:
            return MarkVerdict.ABSENT
        if entry.value.finished:
            return MarkVerdict.ENDED
        invocation = entry.value
        if invocation.generation != mark.generation:
            return MarkVerdict.LOST
        if invocation.started_at_ms:
            own = mark.marker and invocation.started_by == mark.marker
            return MarkVerdict.WON if own else MarkVerdict.LOST
        started = replace(invocation, started_at_ms=math.floor(time.time() * 1000), started_by=mark.marker)
        self._invocations.write(
            mark.tool_request_id, started, self._invocations.expires_in(mark.tool_request_id), notify=False
        )
        return MarkVerdict.WON

    async def redispatch(self, tool_request_id: str, generation: int) -> int:
        entry = self._invocations.live(tool_request_id)
        if entry is None:
            return 0
        invocation = entry.value
        if invocation.finished or invocation.started_at_ms or invocation.generation != generation:
            return 0
        moved = replace(invocation, generation=generation + 1)
        self._invocations.write(
            tool_request_id, moved, self._invocations.expires_in(tool_request_id), notify=False
        )
        return moved.generation

    async def keep_late(self, tool_request_id: str, late: bytes) -> bool:
        entry = self._invocations.live(tool_request_id)
        if entry is None or not entry.value.finished or entry.value.late:
            return False
        kept = replace(entry.value, late=late)
        self._invocations.write(
            tool_request_id, kept, self._invocations.expires_in(tool_request_id), notify=False
        )
        return True

    async def get(self, tool_request_id: str) -> StoredInvocation | None:
        return self._stored(tool_request_id)

    def watch(self, tool_request_id: str) -> AsyncGenerator[StoredInvocation | None, None]:
        return self._invocations.watch(tool_request_id, lambda: self._stored(tool_request_id))
