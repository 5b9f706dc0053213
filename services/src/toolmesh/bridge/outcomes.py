"""Outcomes recorded where they happen: the bridge replica that gets a host's outcome writes it
in the shared ledger too, so that a call whose invocation replica died loses nothing.

The ledger's finish is conditional (only a running invocation is finished, the
first writer wins), so the invocation replica may write the same outcome too.
It does, as it answers: the bridge's copy is the backup, written COPY_AFTER_S
later, by when the invocation's own finish has usually landed, so the copy is
one read (finished: nothing to write) and stays off the call's way to its
caller, where it would queue before the invocation's finish in Redis. The copies
that fall due together go out together, from one timer: under load their reads
share a write to Redis, and no call pays a task waiting on a timeout.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Container, Coroutine
from typing import Any

from toolmesh.bridge.acceptance import check_outcome, from_host
from toolmesh.bridge.router import HostSession, Router
from toolmesh.contracts.cancels import CancelBoard
from toolmesh.contracts.ledger import InvocationRecord, InvocationState, Ledger
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome

log = logging.getLogger("toolmesh.bridge")


# How long after a host's outcome the bridge writes its copy (see the module's docstring), and how
# much earlier one may go, with those due before it: the copies of 50 ms go out together.
COPY_AFTER_S = 0.25
COPY_EARLY_S = 0.05


class OutcomeRecorder:
    """Writes outcomes in `ledger` beside sending them back, without holding up the stream."""

    def __init__(
        self,
        ledger: Ledger,
        copy_after_s: float = COPY_AFTER_S,
        recorded_elsewhere: CancelBoard | None = None,
    ) -> None:
        """`recorded_elsewhere`: where an adopted outcome's id is posted, for the invocation replica
        waiting on it through another bridge replica (None: it learns at its deadline)."""
        self.ledger = ledger
        self._copy_after_s = copy_after_s
        self._recorded_elsewhere = recorded_elsewhere
        self._writes: set[asyncio.Task[None]] = set()
        # The copies to write, in the order they fall due (when, on the monotonic clock; id; outcome).
        self._due: collections.deque[tuple[float, str, Outcome]] = collections.deque()
        # The timer that writes the first of them when it falls due (None: none waits).
        self._timer: asyncio.TimerHandle | None = None
        self._closing = False

    def record(self, tool_request_id: str, outcome: Outcome) -> None:
        if self._closing:
            self._in_background(self._write(tool_request_id, outcome))
            return
        self._due.append((time.monotonic() + self._copy_after_s, tool_request_id, outcome))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._copy_after_s, self._write_due)

    def _write_due(self, *, every: bool = False) -> None:
        """Start the copies that have fallen due (`every`: all of them), in this one turn of the
        loop; the timer again for the next one."""
        self._timer = None
        now = time.monotonic()
        while self._due and (every or self._due[0][0] <= now + COPY_EARLY_S):
            _, tool_request_id, outcome = self._due.popleft()
            self._in_background(self._write(tool_request_id, outcome))
        if self._due:
            self._timer = asyncio.get_running_loop().call_later(self._due[0][0] - now, self._write_due)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, tool_request_id: str, outcome: Outcome) -> None:
        try:
            await self._copy(tool_request_id, outcome)
        except ToolmeshError as error:
            log.warning(
                "outcome not recorded", extra={"tool_request_id": tool_request_id, "code": error.code.value}
            )

    async def _copy(self, tool_request_id: str, outcome: Outcome) -> None:
        """Finish the invocation with `outcome` unless it has finished (or is gone); a host's outcome
        for one that timed out is kept beside it (`take_late`)."""
        try:
            record = await self.ledger.get(tool_request_id)
        except ToolmeshError as error:
            if error.code is not Code.STORE_UNAVAILABLE:
                raise
            # Kept and written later by the ledger itself, which reads the record then.
            await self.ledger.finish(tool_request_id, outcome)
            return
        if record is None:
            return
        if not record.finished:
            await self.ledger.finish(tool_request_id, outcome, claimed=record)
        elif from_host(outcome) and record.outcome != outcome:
            # The host's answer came after the invocation timed out (this replica read it late).
            await self._kept_late(record, outcome, {"tool_request_id": tool_request_id})

    async def adopt(self, host: HostSession, tool_request_id: str, outcome: Outcome) -> None:
        """Record the outcome a host hands in for a request this replica does not hold: one another
        replica sent it, which died while the handler ran, and the host reconnected here.

        Taken only while the ledger has the invocation running, for the host's own session; else
        ToolmeshError(REQUEST_UNKNOWN, or REQUEST_ENDED when it has ended), as for any submit.
        """
        metadata = {"host_session_id": host.host_session_id, "tool_request_id": tool_request_id}
        unknown = ToolmeshError(Code.REQUEST_UNKNOWN, "", metadata)
        await self._adopt((host.session_id,), tool_request_id, outcome, unknown, metadata)

    async def adopt_copy(
        self, sessions: Container[str] | None, host_session_id: str, tool_request_id: str, outcome: Outcome
    ) -> None:
        """Record the copy of its outcome a host of another replica hands in here: its own replica
        left the result unanswered (frozen or cut off), and the host may not live until it answers.

        Taken as `adopt` takes one, for a session the submitter may serve (`sessions`, None: all);
        else ToolmeshError(HOST_SESSION_UNKNOWN), the answer for any host session this replica does
        not hold, or REQUEST_ENDED when it has ended.
        """
        metadata = {"host_session_id": host_session_id, "tool_request_id": tool_request_id}
        unknown = ToolmeshError(Code.HOST_SESSION_UNKNOWN, "", metadata)
        await self._adopt(sessions, tool_request_id, outcome, unknown, metadata)

    async def _adopt(
        self,
        sessions: Container[str] | None,
        tool_request_id: str,
        outcome: Outcome,
        unknown: ToolmeshError,
        metadata: dict[str, str],
    ) -> None:
        """As `adopt`, for a request of `sessions` (None: any); `unknown` is raised for any other."""
        record = await self.ledger.get(tool_request_id)
        if record is None or (sessions is not None and record.session_id not in sessions):
            raise unknown
        if record.finished:
            if await self._kept_late(record, outcome, metadata):
                return
            ended = "answered" if record.outcome == outcome else record.state.value
            raise ToolmeshError(Code.REQUEST_ENDED, f"It ended ({ended}).", {**metadata, "ended": ended})
        check_outcome(outcome, metadata)
        await self.ledger.finish(tool_request_id, outcome, claimed=record)
        log.info(
            "recorded an outcome handed in through a replica that did not send its request", extra=metadata
        )
        if self._recorded_elsewhere is not None:
            self._in_background(self._post(self._recorded_elsewhere, tool_request_id))

    async def take_late(
        self, host: HostSession, tool_request_id: str, outcome: Outcome, refused: ToolmeshError
    ) -> None:
        """Take the outcome a host hands in for a request this replica ended with TOOL_TIMEOUT: kept
        beside the timeout in the ledger (Ledger.keep_late), or, when the invocation still runs
        there (its timeout not written yet: the store was out, or its replica died), recorded
        as its outcome (the first writer wins). Else `refused` is raised."""
        metadata = {"host_session_id": host.host_session_id, "tool_request_id": tool_request_id}
        record = await self.ledger.get(tool_request_id)
        if record is None or record.session_id != host.session_id:
            raise refused
        if not record.finished:
            check_outcome(outcome, metadata)
            await self.ledger.finish(tool_request_id, outcome, claimed=record)
            return
        if not await self._kept_late(record, outcome, metadata):
            raise refused

    async def _kept_late(self, record: InvocationRecord, outcome: Outcome, metadata: dict[str, str]) -> bool:
        """Whether `outcome` is kept beside `record` as its late outcome (it timed out); a repeat of
        the one kept (its answer lost) counts as kept."""
        if record.state is not InvocationState.TIMED_OUT:
            return False
        if record.late_outcome is not None:
            return record.late_outcome == outcome
        check_outcome(outcome, metadata)
        if await self.ledger.keep_late(record, outcome):
            log.info("kept an outcome handed in after its request timed out", extra=metadata)
            return True
        # Another came first, between the read and the write: kept only if it was this one.
        again = await self.ledger.get(record.tool_request_id)
        return again is not None and again.late_outcome == outcome

    async def _post(self, board: CancelBoard, tool_request_id: str) -> None:
        try:
            await board.post(tool_request_id)
        except ToolmeshError as error:
            # Recorded all the same: the invocation replica reads it when its own wait ends.
            log.warning(
                "a recorded outcome was not posted to the invocation replicas",
                extra={"tool_request_id": tool_request_id, "code": error.code.value},
            )

    async def aclose(self) -> None:
        """Write the copies still waiting and wait for the writes under way, then stop the ledger's
        later writes."""
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        self._write_due(every=True)
        if self._writes:
            await asyncio.wait(set(self._writes))
        await self.ledger.aclose()


async def accept(
    router: Router,
    recorder: OutcomeRecorder | None,
    host_session_id: str,
    tool_request_id: str,
    outcome: Outcome,
    *,
    sessions: Container[str] | None,
) -> None:
    """Take a host's outcome: the router settles a request this replica sent; with `recorder` (a
    shared ledger), one it never sent was sent by a replica that died while the host ran it, and
    is recorded in the ledger while its invocation runs (OutcomeRecorder.adopt; from a host
    session this replica does not hold, OutcomeRecorder.adopt_copy), and one that timed out is
    kept beside its TOOL_TIMEOUT there (OutcomeRecorder.take_late).

    `sessions`: those the host may serve (None: all). Raises ToolmeshError as Router.submit does.
    """
    if recorder is None or router.knows(tool_request_id):
        try:
            router.submit(host_session_id, tool_request_id, outcome, sessions)
        except ToolmeshError as refused:
            # Its own host session's, or one its host opened since (the other has ended).
            if recorder is None or not router.timed_out(tool_request_id):
                raise
            host = router.submitting_host(host_session_id, tool_request_id, sessions)
            await recorder.take_late(host, tool_request_id, outcome, refused)
        return
    if not router.holds(host_session_id):
        # A copy from a host of another replica, whose own replica left it unanswered.
        await recorder.adopt_copy(sessions, host_session_id, tool_request_id, outcome)
        return
    host = router.submitting_host(host_session_id, tool_request_id, sessions)
    await recorder.adopt(host, tool_request_id, outcome)
