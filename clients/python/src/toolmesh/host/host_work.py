"""The host's end of one ExchangeHostWork stream: its start asks and results, without a call each.

Private to toolmesh.host (the engine opens one per host session whose bridge
serves it). Whatever is ready goes out together (core.outbox): the asks read in
one turn of the event loop, and the results that end meanwhile. The bridge's
end is toolmesh.bridge.host_work.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Hashable, Iterable, Sequence
from functools import partial

from toolmesh.core.deadlines import PAUSE_GRACE_S, Deadlines
from toolmesh.core.outbox import BATCH_BYTES
from toolmesh.core.stream_link import StreamBroken, StreamLink
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc

_Item = str | bridge_pb2.ToolResultSubmission
_Answer = bridge_pb2.ToolStart | bridge_pb2.ToolResultReceipt


class HostWorkLink:
    """One open ExchangeHostWork stream of host session `host_session_id`; once `closed`, none again."""

    def __init__(
        self,
        stub: bridge_pb2_grpc.BridgeServiceAsyncStub,
        host_session_id: str,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        """`metadata` goes with the stream's opening (the host's token)."""
        self.host_session_id = host_session_id
        self._link: StreamLink[
            _Item, bridge_pb2.ExchangeHostWorkRequest, bridge_pb2.ExchangeHostWorkResponse, _Answer
        ] = StreamLink(
            lambda messages: stub.ExchangeHostWork(messages, metadata=metadata),
            batch=self._message,
            size_of=_size_of,
            results_of=_answers_of,
            key_of=_key_of,
            # A receipt awaited is of a result already sent (the bridge may hold it back to ride
            # with the next START): it says no other item is on its way, and an ask that gathered
            # for it waited GATHER_TURNS turns on every call of a sequence.
            in_flight=_is_start,
        )
        # The receipts' waits, on one timer (10,000 results handed in at once each held a timer and
        # asyncio.wait's sets and callbacks, 1.3 KB more per call at the peak).
        self._waits: Deadlines[asyncio.Future[None]] = Deadlines(_wake)

    @property
    def closed(self) -> bool:
        """Whether the stream has ended (broken, or ended by the bridge)."""
        return self._link.closed

    def ask_to_start(self, tool_request_id: str) -> asyncio.Future[bridge_pb2.ToolStart]:
        """Send the ask; the future is the bridge's verdict, or fails with StreamBroken."""
        answer = self._link.expect(("start", tool_request_id))
        self._link.send(tool_request_id)
        return answer  # type: ignore[return-value]  # a start's key brings a ToolStart

    def can_carry(self, submission: bridge_pb2.ToolResultSubmission) -> bool:
        """Whether the result fits a message with others (a larger one goes as SubmitToolResult)."""
        return not self.closed and submission.ByteSize() <= BATCH_BYTES

    async def submit(self, submission: bridge_pb2.ToolResultSubmission, timeout: float) -> bool | None:
        """Hand in a result: whether the bridge took it.

        False when it refused it (nothing was taken); None when its receipt did not come (the
        stream broke, or `timeout` and then PAUSE_GRACE_S passed): it may have been taken.
        """
        key = ("receipt", submission.tool_request_id)
        receipt = self._link.expect(key)
        self._link.send(submission)
        try:
            # Not cancelled when the wait times out: read meanwhile, it settles, and is looked at.
            for wait_s in (timeout, PAUSE_GRACE_S):
                await self._settled(receipt, wait_s)
                if receipt.done():
                    break
            answer = receipt.result() if receipt.done() else None
        except StreamBroken:
            answer = None
        finally:
            self._link.forget(key)
        if answer is None:
            return None
        assert isinstance(answer, bridge_pb2.ToolResultReceipt)
        return not answer.HasField("refusal")

    async def _settled(self, receipt: asyncio.Future[_Answer], wait_s: float) -> None:
        """Until `receipt` settles or `wait_s` passes, leaving it as it is."""
        if receipt.done():
            return
        woke: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        settled = partial(_wake, woke)
        receipt.add_done_callback(settled)
        self._waits.add(woke, wait_s)
        try:
            await woke
        finally:
            self._waits.discard(woke)
            receipt.remove_done_callback(settled)

    async def finish(self, timeout: float) -> None:
        """Send nothing more; give the bridge up to `timeout` to answer and end the stream.

        The bridge may hold a receipt back briefly, for company: this gets it. Then as `aclose`.
        """
        await self._link.finish(timeout)

    async def aclose(self) -> None:
        """End the stream; every ask and result still waiting fails as broken."""
        await self._link.aclose()

    def _message(self, items: list[_Item]) -> bridge_pb2.ExchangeHostWorkRequest:
        message = bridge_pb2.ExchangeHostWorkRequest(host_session_id=self.host_session_id)
        for item in items:
            if isinstance(item, str):
                message.start_tool_request_ids.append(item)
            else:
                message.results.append(item)
        return message


def _size_of(item: _Item) -> int:
    return len(item) if isinstance(item, str) else item.ByteSize()


def _answers_of(response: bridge_pb2.ExchangeHostWorkResponse) -> Iterable[_Answer]:
    return itertools.chain(response.starts, response.receipts)


def _is_start(key: Hashable) -> bool:
    return isinstance(key, tuple) and key[0] == "start"


def _key_of(answer: _Answer) -> Hashable:
    kind = "start" if isinstance(answer, bridge_pb2.ToolStart) else "receipt"
    return (kind, answer.tool_request_id)


def _wake(woke: asyncio.Future[None], _: object = None) -> None:
    if not woke.done():
        woke.set_result(None)
