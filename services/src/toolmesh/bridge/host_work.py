"""One ExchangeHostWork stream on the bridge: a host session's start asks and results in, answers out.

A gRPC host carries on it what it would send as StartToolRequests and
SubmitToolResult calls, one each per tool request; here they cost a stream
message, several at once under load. Each ask and result goes to the very
functions those RPCs call (the servicer hands them in: `start_requests` and
`submit` of toolmesh.bridge.servicer), so their meaning is theirs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Container

from toolmesh.bridge.router import HostSession, Router
from toolmesh.core.errors import Code, ToolmeshError, typed_error
from toolmesh.core.limits import MAX_CALLS_PER_MESSAGE
from toolmesh.core.outbox import Outbox
from toolmesh.v1 import bridge_pb2

log = logging.getLogger("toolmesh.bridge")

LIMIT_NAME = "host_work_streams_per_host_session"
# How soon a refused second stream may try again: the first one ends with its host session.
_RETRY_DELAY_S = 1.0
# How long a result's receipt may wait for the next answer to go with it (proto: ExchangeHostWork).
# The host holds the result until then; nothing else waits on it. Calls one after another then cost
# a message each way less: the receipt goes with the next call's START.
RECEIPT_WAIT_S = 0.02

_Answer = bridge_pb2.ToolStart | bridge_pb2.ToolResultReceipt
Start = Callable[[bridge_pb2.StartToolRequestsRequest], Awaitable[bridge_pb2.StartToolRequestsResponse]]
Submit = Callable[[bridge_pb2.SubmitToolResultRequest], Awaitable[bridge_pb2.SubmitToolResultResponse]]


class HostWorkStreams:
    """The host sessions that have an ExchangeHostWork stream open on this replica: one each."""

    def __init__(self) -> None:
        self._open: set[str] = set()

    def take(self, host_session_id: str) -> None:
        """Raise QUOTA_EXCEEDED when the host session has one open already."""
        if host_session_id in self._open:
            raise ToolmeshError(
                Code.QUOTA_EXCEEDED,
                "The host session has a host work stream open already.",
                {
                    "limit": LIMIT_NAME,
                    "value": "1",
                    "retryDelayMs": str(round(_RETRY_DELAY_S * 1000)),
                    "hostSessionId": host_session_id,
                },
                retry_delay_s=_RETRY_DELAY_S,
            )
        self._open.add(host_session_id)

    def give_back(self, host_session_id: str) -> None:
        self._open.discard(host_session_id)


class HostWorkStream:
    """`start` and `submit`: StartToolRequests' and SubmitToolResult's own work, for the caller's
    `sessions` (those its token lets it serve, None: all), which also scope the host session."""

    def __init__(
        self,
        router: Router,
        streams: HostWorkStreams,
        sessions: Container[str] | None,
        *,
        start: Start,
        submit: Submit,
    ) -> None:
        self._router = router
        self._streams = streams
        self._sessions = sessions
        self._start = start
        self._submit_one = submit
        self._host: HostSession | None = None
        self._answers: Outbox[_Answer] = Outbox(
            _answer_size,
            more_coming=lambda: bool(self._submitting),  # other results' receipts (Outbox)
        )
        # Results being taken (a ledger write may be under way): their receipts are still to come.
        self._submitting: set[asyncio.Task[None]] = set()
        self._reading = True

    async def read(self, messages: AsyncIterator[bridge_pb2.ExchangeHostWorkRequest]) -> None:
        """Take every message; when the host stops sending, end once every result is answered.

        Raises ToolmeshError (INVALID_REQUEST, HOST_SESSION_UNKNOWN, QUOTA_EXCEEDED: see the
        proto) and takes nothing after it.
        """
        try:
            async for message in messages:
                await self._take(message)
        finally:
            self._reading = False
            self._end_when_answered()

    async def responses(self) -> AsyncIterator[bridge_pb2.ExchangeHostWorkResponse]:
        """Every answer ready at once in one message, until the stream may end."""
        while taken := await self._answers.take():
            response = bridge_pb2.ExchangeHostWorkResponse()
            for answer in taken:
                if isinstance(answer, bridge_pb2.ToolStart):
                    response.starts.append(answer)
                else:
                    response.receipts.append(answer)
            yield response

    def close(self) -> None:
        """The stream ended: its host session may open another. Results being taken go on."""
        if self._host is not None:
            self._streams.give_back(self._host.host_session_id)
            self._host.on_close.discard(self._host_closed)

    async def _take(self, message: bridge_pb2.ExchangeHostWorkRequest) -> None:
        if len(message.start_tool_request_ids) + len(message.results) > MAX_CALLS_PER_MESSAGE:
            raise ToolmeshError(
                Code.INVALID_REQUEST,
                f"At most {MAX_CALLS_PER_MESSAGE} ids and results per message.",
                {"limit": str(MAX_CALLS_PER_MESSAGE)},
            )
        host = self._host
        if host is None:
            host = self._router.host(message.host_session_id, self._sessions)
            self._streams.take(host.host_session_id)
            self._host = host
            host.on_close.add(self._host_closed)
        elif message.host_session_id != host.host_session_id:
            raise ToolmeshError(
                Code.INVALID_REQUEST,
                "Every message of the stream names the host session of its first.",
                {"field": "host_session_id"},
            )
        if message.start_tool_request_ids:
            asks = bridge_pb2.StartToolRequestsRequest(
                host_session_id=host.host_session_id, tool_request_ids=message.start_tool_request_ids
            )
            # The fence's compare-and-set in the ledger, when starts are fenced (bridge.router).
            for start in (await self._start(asks)).starts:
                self._answers.put(start)
        for result in message.results:
            task = asyncio.create_task(self._submit(host.host_session_id, result))
            self._submitting.add(task)
            task.add_done_callback(self._submitted)

    async def _submit(self, host_session_id: str, result: bridge_pb2.ToolResultSubmission) -> None:
        receipt = bridge_pb2.ToolResultReceipt(tool_request_id=result.tool_request_id)
        request = bridge_pb2.SubmitToolResultRequest(
            host_session_id=host_session_id, tool_request_id=result.tool_request_id, outcome=result.outcome
        )
        wait: float | None = RECEIPT_WAIT_S
        try:
            await self._submit_one(request)
        except Exception as exc:
            error = typed_error(exc, "toolmesh.v1.BridgeService/ExchangeHostWork", log)
            receipt.refusal.reason = error.code.value
            receipt.refusal.message = error.message
            receipt.refusal.metadata.update(error.metadata)
            wait = None  # the host acts on a refusal: at once
        # No longer coming, before the receipt is put: else the outbox waits turns for it (Outbox).
        self._submitting.discard(asyncio.current_task())
        self._answers.put(receipt, within_s=wait)

    def _submitted(self, task: asyncio.Task[None]) -> None:
        self._submitting.discard(task)  # when it was cancelled before its receipt
        self._end_when_answered()

    def _host_closed(self) -> None:
        """The host session ended: the stream ends once the results taken by then are answered."""
        self._reading = False
        self._end_when_answered()

    def _end_when_answered(self) -> None:
        if not self._reading and not self._submitting:
            self._answers.close()


def _answer_size(answer: _Answer) -> int:
    return answer.ByteSize()
