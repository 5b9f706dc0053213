"""Whether a host reads its stream, from its answers to read checks.

A host can hold its stream open and read nothing (its event loop is stuck,
its process stopped, or it never reads): the transport takes megabytes before
the bridge's writes wait, so a request sent there is lost until its deadline.
The bridge asks instead. A Heartbeat with a read check goes out when the
session opens, with heartbeats and when a request waits on the host; the
stream is in order, so an answer (AnswerReadCheck) says the host has read
everything sent before it.

- A host that answered the last check, or whose check went out less than
  READ_CHECK_AFTER_MS ago, reads: requests go to such hosts first.
- A host that has not answered yet (it opened a moment ago, or does not
  answer checks at all, as hosts built before them) gets requests only when
  no host that reads serves the session.
- A host that answered before and leaves a check unanswered for
  READ_CHECK_TIMEOUT_MS has stopped reading: the router takes it for gone. A
  result it submits for a request sent after the check answers the check
  too (it read past it), so a host too busy to answer promptly but still
  working is not taken for gone.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from toolmesh.core.limits import READ_CHECK_AFTER_MS

READ_CHECK_AFTER_S = READ_CHECK_AFTER_MS / 1000


class Reading(enum.IntEnum):
    """How much a host is known to read its stream; the router prefers the higher."""

    UNKNOWN = 0  # no answer yet, or its latest check waits longer than it should
    READS = 1


@dataclass(eq=False, slots=True)
class ReadChecks:
    """One host's read checks: the one waiting for its answer, and whether it ever answered."""

    answered: bool = False
    # The check sent and not answered yet (0: none), and when it went out.
    waiting: int = 0
    sent_at: float = 0.0
    # Fires when the waiting check is overdue; and the early check a waiting request asks for.
    overdue: asyncio.TimerHandle | None = None
    early: asyncio.TimerHandle | None = None

    def reading(self, now: float) -> Reading:
        if self.answered and (self.waiting == 0 or now - self.sent_at < READ_CHECK_AFTER_S):
            return Reading.READS
        return Reading.UNKNOWN

    def sent(self, check: int, now: float, overdue: asyncio.TimerHandle) -> None:
        self.waiting, self.sent_at, self.overdue = check, now, overdue

    def answer(self, check: int) -> bool:
        """Take an answer; whether it was to the waiting check (older ones change nothing)."""
        if check == 0 or check != self.waiting:
            return False
        self.waiting = 0
        self.answered = True
        if self.overdue is not None:
            self.overdue.cancel()
            self.overdue = None
        return True

    def cancel(self) -> None:
        for timer in (self.overdue, self.early):
            if timer is not None:
                timer.cancel()
