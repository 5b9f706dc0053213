"""The caller's end of one InvokeTools stream: many tool calls on it, for callers that keep many open.

The invocation service's end is toolmesh.invocation.call_stream.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence

from toolmesh.core.stream_link import StreamLink
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc

CallStreamLink = StreamLink[
    invocation_pb2.StreamedToolCall,
    invocation_pb2.InvokeToolsRequest,
    invocation_pb2.InvokeToolsResponse,
    invocation_pb2.StreamedToolResult,
]


class CallLink:
    """One open InvokeTools stream and the calls waiting on it. Open a new one when `closed`."""

    def __init__(
        self, stub: invocation_pb2_grpc.InvocationServiceAsyncStub, metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        """`metadata` goes with the stream's opening (the caller's token)."""
        self._ids = itertools.count(1)
        self._link: CallStreamLink = StreamLink(
            lambda messages: stub.InvokeTools(messages, metadata=metadata),
            batch=lambda calls: invocation_pb2.InvokeToolsRequest(calls=calls),
            size_of=lambda call: call.ByteSize(),
            results_of=lambda response: response.results,
            key_of=lambda result: result.call_id,
        )

    @property
    def closed(self) -> bool:
        """Whether the stream has ended (broken or closed): new calls need a new link."""
        return self._link.closed

    async def call(
        self,
        request: invocation_pb2.InvokeToolRequest,
        trace_context: Mapping[str, str],
        timeout: float | None,
    ) -> invocation_pb2.StreamedToolResult:
        """Send one call on the stream and wait for its result.

        Raises TimeoutError after `timeout` seconds (a late result is dropped),
        and StreamBroken when the stream ends before the result arrives.
        """
        call_id = next(self._ids)
        result = self._link.expect(call_id)
        self._link.send(
            invocation_pb2.StreamedToolCall(call_id=call_id, request=request, trace_context=trace_context)
        )
        try:
            return await asyncio.wait_for(result, timeout)
        finally:
            self._link.forget(call_id)  # on time or not: a late result is dropped

    async def aclose(self) -> None:
        """End the stream; calls still waiting on it get StreamBroken."""
        await self._link.aclose()
