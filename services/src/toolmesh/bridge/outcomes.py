"""Outcomes recorded where they happen: the bridge replica that gets a host's outcome writes it
in the shared ledger too, so that a call whose invocation replica died loses nothing.

The ledger's finish is conditional (only a running invocation is finished, the
first writer wins), so the invocation replica may write the same outcome too.
It does, as it answers: the bridge's copy is the backup, written COPY_AFTER_S
later, by when the invocation's own finish has usually landed, so the copy is
one read (finished: nothing to write) and stays off the call's way to its
caller, where it would queue before the invocation's finish in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Container, Coroutine
from typing import Any

from toolmesh.bridge.acceptance import check_outcome
from toolmesh.bridge.router import HostSession, Router
from toolmesh.contracts.cancels import CancelBoard
from toolmesh.contracts.ledger import Ledger
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome

log = logging.getLogger("toolmesh.bridge")


# How long after a host's outcome the bridge writes its copy (see the module's docstring).
COPY_AFTER_S = 0.25


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
        # Set on close: the copies still waiting are written at once.
        self._closing = asyncio.Event()

    def record(self, tool_request_id: str, outcome: Outcome) -> None:
        self._in_background(self._write(tool_request_id, outcome))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, tool_request_id: str, outcome: Outcome) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._copy_after_s):
                await self._closing.wait()
        try:
            await self._copy(tool_request_id, outcome)
        except ToolmeshError as error:
            log.warning(
                "outcome not recorded", extra={"tool_request_id": tool_request_id, "code": error.code.value}
            )

    async def _copy(self, tool_request_id: str, outcome: Outcome) -> None:
        """Finish the invocation with `outcome` unless it has finished (or is gone)."""
        try:
            record = await self.ledger.get(tool_request_id)
        except ToolmeshError as error:
            if error.code is not Code.STORE_UNAVAILABLE:
                raise
            # Kept and written later by the ledger itself, which reads the record then.
            await self.ledger.finish(tool_request_id, outcome)
            return
        if record is not None and not record.finished:
            await self.ledger.finish(tool_request_id, outcome, claimed=record)

    async def adopt(self, host: HostSession, tool_request_id: str, outcome: Outcome) -> None:
        """Record the outcome a host hands in for a request this replica does not hold: one another
        replica sent it, which died while the handler ran, and the host reconnected here.

        Taken only while the ledger has the invocation running, for the host's own session; else
        ToolmeshError(REQUEST_UNKNOWN, or REQUEST_ENDED when it has ended), as for any submit.
        """
        metadata = {"host_session_id": host.host_session_id, "tool_request_id": tool_request_id}
        record = await self.ledger.get(tool_request_id)
        if record is None or record.session_id != host.session_id:
            raise ToolmeshError(Code.REQUEST_UNKNOWN, "", metadata)
        if record.finished:
            ended = "answered" if record.outcome == outcome else record.state.value
            raise ToolmeshError(Code.REQUEST_ENDED, f"It ended ({ended}).", {**metadata, "ended": ended})
        check_outcome(outcome, metadata)
        await self.ledger.finish(tool_request_id, outcome, claimed=record)
        log.info("recorded an outcome handed in after its bridge replica was lost", extra=metadata)
        if self._recorded_elsewhere is not None:
            self._in_background(self._post(self._recorded_elsewhere, tool_request_id))

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
        self._closing.set()
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
    is recorded in the ledger while its invocation runs (OutcomeRecorder.adopt).

    `sessions`: those the host may serve (None: all). Raises ToolmeshError as Router.submit does.
    """
    if recorder is None or router.knows(tool_request_id):
        router.submit(host_session_id, tool_request_id, outcome, sessions)
        return
    host = router.submitting_host(host_session_id, tool_request_id, sessions)
    await recorder.adopt(host, tool_request_id, outcome)
