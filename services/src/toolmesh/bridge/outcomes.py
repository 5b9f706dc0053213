"""Outcomes recorded where they happen: the bridge replica that gets a host's outcome writes it
in the shared ledger too, so that a call whose invocation replica died loses nothing.

The ledger's finish is conditional (only a running invocation is finished, the
first writer wins), so the invocation replica may write the same outcome too.
"""

from __future__ import annotations

import asyncio
import logging

from toolmesh.core.errors import ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.invocation.ledger import Ledger

log = logging.getLogger("toolmesh.bridge")


class OutcomeRecorder:
    """Writes outcomes in `ledger` beside sending them back, without holding up the stream."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._writes: set[asyncio.Task[None]] = set()

    def record(self, tool_request_id: str, outcome: Outcome) -> None:
        task = asyncio.create_task(self._write(tool_request_id, outcome))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, tool_request_id: str, outcome: Outcome) -> None:
        try:
            # Kept and written later by the ledger itself when the store is out.
            await self.ledger.finish(tool_request_id, outcome)
        except ToolmeshError as error:
            log.warning(
                "outcome not recorded", extra={"tool_request_id": tool_request_id, "code": error.code.value}
            )

    async def aclose(self) -> None:
        """Wait for the writes under way, then stop the ledger's later writes."""
        if self._writes:
            await asyncio.wait(set(self._writes))
        await self.ledger.aclose()
