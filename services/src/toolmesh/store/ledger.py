"""The invocation ledger's storage port: each step of a call is one atomic operation.

A tool call costs the ledger three of them on its path: `claim` when it
starts (taking its session's place among calls in flight, the lease), `finish`
when its outcome is known (giving the place back), `confirm` when the caller
has it.
In memory each is one synchronous step; on Redis each is one script (one
round trip), so replicas sharing a Redis see one ledger.

The port stores what the ledger gives it as bytes (the record's own encoding
is the ledger's business) plus the few facts the atomic steps decide on:
whether the invocation finished, whether its delivery was confirmed, which
identity pointer names it, how long it is kept.

Attachments: every call that attaches to an invocation (the one that made it,
each joiner, each replay) gets an attachment id, unique within the invocation.
A finished invocation stays replayable to exact retries (its identity pointer
kept, within the replay window) until every attachment's delivery is
confirmed: one caller's confirmation does not release it for another that
attached and has not confirmed (it may have given up and be about to retry).
An attachment never confirmed does not pin it longer than the replay window.

Start fence: each invocation has a dispatch generation (1 when claimed) and, once a host was
allowed to start it, a start mark. A bridge marks the start of the delivery it holds
(`mark_started`, compare-and-set on that delivery's generation) before it lets a host start it;
the invocation service moves the generation on (`redispatch`) before it sends the request
again through another bridge replica, only while no start is marked. So at most one delivery
of an invocation ever starts, and a bridge cut off from the others cannot start an old one. A
mark needs the invocation stored: one whose claim is not in yet is ABSENT, and cannot start.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

# The attachment id of the call that made an invocation; later ones count up from it.
FIRST_ATTACHMENT = "1"


@dataclass(frozen=True, slots=True)
class StoredInvocation:
    tool_request_id: str
    # The ledger's record as last written (by claim or finish).
    record: bytes
    # Every attachment's delivery was confirmed (or one confirmation named them all).
    delivered: bool
    # From a claim that attached to this invocation: the attachment it made ("" otherwise).
    attachment_id: str = ""
    # Its dispatch generation (see `LedgerStore.redispatch`; claims answer 1 for theirs).
    generation: int = 1
    # When a host was allowed to start it (`LedgerStore.mark_started`), in Unix ms on the store's
    # clock; 0: no start marked. Claims that attach answer 0.
    started_at_ms: int = 0
    # What `keep_late` kept beside the finished record (b"": nothing). Claims answer b"".
    late: bytes = b""


class Delivered(NamedTuple):
    """A delivery confirmation: the caller of this attachment has the invocation's outcome."""

    tool_request_id: str
    # "" confirms every attachment at once (ConfirmDelivery's id-only form).
    attachment_id: str = ""


class StartMark(NamedTuple):
    """A bridge's start of the delivery of `generation` of an invocation (see `mark_started`).

    `marker` names who marks it (a bridge process): a mark it asks for again, after its reply was
    lost, finds its own mark and wins again; "" never matches one."""

    tool_request_id: str
    generation: int
    marker: str = ""


class MarkVerdict(enum.Enum):
    """What `mark_started` did with one StartMark."""

    # Marked: the delivery may start.
    WON = "won"
    # Another start was marked, or a redispatch moved the generation on: it must not start.
    LOST = "lost"
    # The invocation has ended: nothing to start.
    ENDED = "ended"
    # The invocation is not stored: its claim has not been made yet (a request the invocation
    # service sends while its claim is on its way), or it never will be, or it expired.
    ABSENT = "absent"


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    """One of at most `limit` places held under `key` (a Store lease key), for `ttl_s` or until the
    invocation ends: taken by the claim that starts a new invocation, in the same atomic step, as
    the invocation's tool request id; given back by whichever finish or cancellation ends it."""

    key: str
    limit: int
    ttl_s: float


class LeaseRefused(Exception):
    """`limit` unexpired places are held under the lease key: nothing was claimed."""


class KeyReused(Exception):
    """The idempotency key belongs to an invocation with other arguments."""

    def __init__(self, tool_request_id: str) -> None:
        super().__init__(tool_request_id)
        self.tool_request_id = tool_request_id


class ClaimNotReplicated(Exception):
    """Durable claims (toolmesh.store.durability): the claim was stored on the primary, but no replica
    confirmed it in time, so a failover could lose it. `stored` is what the claim returned: None when
    it stored a new invocation (nothing runs it: the ledger ends it), else the one it attached to."""

    def __init__(self, stored: StoredInvocation | None) -> None:
        super().__init__("no replica confirmed the claim in time")
        self.stored = stored


class LedgerStore(Protocol):
    # True when every operation completes without suspending (the store is this process's
    # memory): a caller's cancellation cannot then cut one short, so nobody needs to shield it.
    synchronous: bool
    # True when a claim may wait for a replica to have it (durable claims,
    # toolmesh.store.durability): it may then answer ClaimNotReplicated.
    claims_replicated: bool

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
        """Store a running invocation under `identity` (its first attachment is FIRST_ATTACHMENT),
        unless the identity names one whose delivery is not confirmed: then store nothing, attach
        to that one and return it, with the new attachment's id (to join or replay).

        `confirmed` are confirmed first, as by `confirm`, in the same atomic step:
        a caller's confirmations carried on its next call apply before that call.

        Both the record and the identity pointer expire after `running_ttl_s`
        (an owner that died leaves nothing forever). Claiming again with the
        same `tool_request_id` stores it again, so a repeated request is harmless.

        `lease` is taken only when a new invocation is stored (a join or replay takes none);
        raises LeaseRefused, storing nothing, when it cannot be.

        With durable claims, returns once a replica has the claim; ClaimNotReplicated when none
        confirmed it in time.
        """
        ...

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
        """Store a running invocation under the idempotency `key` (already scoped to its session),
        unless the key names a stored invocation: then attach to it and return it (with the
        attachment's id), confirmed or not, unless it
        finished with an outcome not to replay (`finish` with `replay_s` None): then the key
        starts over with this invocation. `confirmed` and `lease` as for `claim`.

        Raises KeyReused when the key names an invocation of another identity.
        The key is kept `key_ttl_s`; no identity pointer is made.
        """
        ...

    async def finish(
        self, tool_request_id: str, record: bytes, identity: str, keep_s: float, replay_s: float | None
    ) -> str:
        """Store the finished record, kept `keep_s`, and wake whoever watches it; only if the
        invocation is stored and still running (the first finish wins: the bridge replica that
        got the host's outcome and the invocation replica may both record it). Returns "wrote";
        or, when it did not write, "cancelled" if `cancel` had ended the invocation, else "ended"
        (finished by another writer, or not stored). Writing gives back the lease its claim took.

        `identity` is the pointer that names the invocation ("" for none). With
        `replay_s` the pointer names this invocation for that long (exact retries
        replay it, or are told they came too late: the ledger decides) and the record is
        kept at least as long (`keep_s` from its confirmation on); with None it is dropped
        if it still names this invocation, and an idempotency key naming it no longer
        replays it (`claim_keyed` starts over).
        """
        ...

    async def cancel(
        self, tool_request_id: str, record: bytes, identity: str, keep_s: float, replay_s: float
    ) -> str | None:
        """Finish the invocation as `finish` does (its lease given back; with a replayable outcome,
        marked cancelled for a later `finish` to say so), only if it is stored,
        still running and no call has joined it (a `claim` or `claim_keyed` that returned it while it
        ran). Returns "cancelled" when it wrote, "ended" when it had finished, "joined" when a call
        joined it, None when it is not stored.
        """
        ...

    async def confirm(self, deliveries: Sequence[Delivered]) -> list[str]:
        """Confirm these attachments' deliveries of finished invocations. An invocation whose
        every attachment is confirmed (or named with attachment "") is delivered: kept `keep_s`
        from now, its pointer dropped.

        Unknown, expired and already confirmed ones are passed over; the ids of
        invocations still running are returned, unchanged.
        """
        ...

    async def release_lease(self, key: str, tool_request_id: str) -> None:
        """Give back the lease a claim took, for an invocation that ends without `finish` (its
        caller left before an outcome): nothing when it lapsed or was given back."""
        ...

    async def mark_started(self, marks: Sequence[StartMark]) -> list[MarkVerdict]:
        """Mark each invocation started by its delivery of `generation` (one verdict per mark, in
        order), each atomically: WON only while it runs, its dispatch generation is `generation` and
        no start is marked (the mark keeps the store's time and the mark's `marker`), or when the
        start marked on that generation is the same marker's (a mark asked again: a delivery is
        held by one bridge, which lets one host start it); else LOST, ENDED or ABSENT (not
        stored), changing nothing.
        On Redis, one round trip per slot the marks fall in (one on a single server)."""
        ...

    async def redispatch(self, tool_request_id: str, generation: int) -> int:
        """Move the invocation's dispatch generation on from `generation`, atomically, only while it
        runs, no start is marked and its generation is `generation`: the new generation. 0 when
        it did not (a start was marked, it ended or is not stored, or another moved it on)."""
        ...

    async def keep_late(self, tool_request_id: str, late: bytes) -> bool:
        """Keep `late` beside the finished invocation, as long as its record (a host's outcome that
        came after the invocation had ended with TOOL_TIMEOUT: the ledger decides which), once:
        the first kept stays. False, changing nothing, when it is not stored, still runs, or has
        one kept already."""
        ...

    async def get(self, tool_request_id: str) -> StoredInvocation | None: ...

    def watch(self, tool_request_id: str) -> AsyncGenerator[StoredInvocation | None, None]:
        """Yield the invocation as stored, then again after each finish (None once it is gone).

        Waits through a store outage and reads again once the store is back.
        """
        ...
