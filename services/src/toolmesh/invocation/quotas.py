"""Quotas on calls: how many of a session's calls wait at once, how fast one caller may call.

Calls in flight per session are counted in the store as leases, so the quota
holds across invocation replicas sharing a Redis (and a replica that dies
gives its leases back when they lapse). A new invocation holds its place
until it ends, also when its caller left; a call that joins or replays one
takes none. The ledger's claim takes the place in the same store step, and its
finish (or cancellation, or the finish of an owner found lost) gives it back:
no round trip of its own on a call's path. Calls per second are a token bucket
per caller (the token's subject) in each replica's memory: a rate changes too
fast for a round trip to the store per call to pay, and a balancer spreading a
caller over N replicas gives it at most N times the rate (set it accordingly).
Without authentication there is no caller to count: the rate is not applied.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from toolmesh.core.errors import ToolmeshError
from toolmesh.rules.limits import DEFAULT_LIMITS, Limits
from toolmesh.store.base import Store
from toolmesh.store.ledger import LeaseTerms

# Callers whose buckets are remembered; the least recently seen are forgotten first
# (a forgotten bucket starts full again, which is what an idle caller's would be).
MAX_CALLERS = 100_000
# A lease outlives its call's deadline by this much, for a replica that died mid-call.
LEASE_GRACE_S = 30.0


class _Bucket:
    __slots__ = ("at", "tokens")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens = tokens
        self.at = at


class Quotas:
    """The per-session and per-caller quotas of one invocation replica."""

    def __init__(
        self,
        store: Store | None,
        limits: Limits = DEFAULT_LIMITS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._limits = limits
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    @property
    def limits(self) -> Limits:
        return self._limits

    def take_call(self, caller: str | None) -> None:
        """Count one call of `caller` (None: unauthenticated, not counted); QUOTA_EXCEEDED past its rate."""
        if caller is None:
            return
        rate = self._limits.calls_per_second_per_caller
        burst = self._limits.calls_burst_per_caller
        now = self._clock()
        bucket = self._buckets.pop(caller, None) or _Bucket(float(burst), now)
        bucket.tokens = min(float(burst), bucket.tokens + (now - bucket.at) * rate)
        bucket.at = now
        self._buckets[caller] = bucket
        if len(self._buckets) > MAX_CALLERS:
            self._buckets.popitem(last=False)
        if bucket.tokens < 1:
            wait_s = (1 - bucket.tokens) / rate
            raise self._limits.used_up(
                "calls_per_second_per_caller",
                f"The caller makes more than {rate} calls per second.",
                math.ceil(wait_s * 1000) / 1000,
            )
        bucket.tokens -= 1

    def in_flight(self, session_id: str, timeout_ms: int) -> Lease:
        """A place among the session's calls in flight, for a call with that timeout (not taken yet)."""
        terms = None
        if self._store is not None:
            terms = LeaseTerms(
                f"quota:in_flight:{session_id}",
                self._limits.calls_in_flight_per_session,
                timeout_ms / 1000 + LEASE_GRACE_S,
            )
        return Lease(terms, self._limits, session_id)


class Lease:
    """One new invocation's place among its session's calls in flight: the ledger's claim takes it
    (with `terms`), its finish gives it back."""

    def __init__(self, terms: LeaseTerms | None, limits: Limits, session_id: str) -> None:
        # None: no store counts the session's calls (the place is not kept).
        self.terms = terms
        self._limits = limits
        self._session_id = session_id

    def refused(self) -> ToolmeshError:
        """QUOTA_EXCEEDED: the claim found the session's places taken."""
        limit = self._limits.calls_in_flight_per_session
        return self._limits.used_up(
            "calls_in_flight_per_session",
            f"The session has {limit} calls waiting for their outcome already.",
            1.0,
            sessionId=self._session_id,
        )
