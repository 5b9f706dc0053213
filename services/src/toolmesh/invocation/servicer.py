"""InvocationService over gRPC: a thin adapter onto Invoker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from toolmesh.auth.grants import Role
from toolmesh.auth.guard import caller, scope
from toolmesh.contracts.ledger import CancelVerdict, rfc3339
from toolmesh.core.progress import ToolProgress
from toolmesh.core.wire import (
    ATTACHMENT_ID_METADATA,
    RETRY_SAFE_UNTIL_METADATA,
    TOOL_REQUEST_ID_METADATA,
    progress_to_pb,
)
from toolmesh.invocation.call_stream import CallStream
from toolmesh.invocation.invoker import Invoker
from toolmesh.invocation.messages import (
    call_from_pb,
    deliveries_from_pb,
    record_to_pb,
    response_to_pb,
    timestamp,
)
from toolmesh.invocation.run_events import Started, run_events
from toolmesh.runtime.relay import relay
from toolmesh.runtime.rpc_types import ServicerContext
from toolmesh.runtime.server import Service
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc

# A call still waiting this long has its invocation's id sent ahead of the outcome.
EARLY_ID_AFTER_S = 0.05


class EarlyId:
    """Sends the invocation's id as initial metadata, once a call has waited EARLY_ID_AFTER_S for it.

    So that a caller whose own deadline passes still knows which invocation to
    reconcile. Not at once: an extra HTTP/2 frame on every call costs about a
    tenth of a fast call's CPU (`python -m bench.early_id`), and a call that
    ends sooner than this gets its id with the outcome anyway. A caller with
    less time left than that hears it sooner.
    """

    def __init__(self, context: ServicerContext) -> None:
        self._context = context
        self._timer: asyncio.TimerHandle | None = None
        self._sending: asyncio.Task[None] | None = None

    async def waiting(self, tool_request_id: str, attachment_id: str, safe_until: float) -> None:
        """The call now waits on `tool_request_id`: announce it (with the call's attachment and
        until when its exact retry joins or replays it) if the wait lasts."""
        left = self._context.time_remaining()
        delay = EARLY_ID_AFTER_S if left is None else min(EARLY_ID_AFTER_S, left / 4)
        # The time is written out only if sent: most calls end first, and formatting it costs.
        self._timer = asyncio.get_running_loop().call_later(
            delay, self._send, tool_request_id, attachment_id, safe_until
        )

    def _send(self, tool_request_id: str, attachment_id: str, safe_until: float) -> None:
        metadata = (
            (TOOL_REQUEST_ID_METADATA, tool_request_id),
            (ATTACHMENT_ID_METADATA, attachment_id),
            (RETRY_SAFE_UNTIL_METADATA, rfc3339(safe_until)),
        )
        self._sending = asyncio.ensure_future(self._context.send_initial_metadata(metadata))

    async def settled(self) -> None:
        """The outcome is ready (or the call failed): no announcement from now on; finish one under way."""
        if self._timer is not None:
            self._timer.cancel()
        if self._sending is not None:
            with contextlib.suppress(Exception):
                await self._sending


_CANCEL_RESULTS = {
    CancelVerdict.CANCELLED: invocation_pb2.CANCEL_INVOCATION_RESULT_CANCELLED,
    CancelVerdict.ENDED: invocation_pb2.CANCEL_INVOCATION_RESULT_ENDED,
    CancelVerdict.JOINED: invocation_pb2.CANCEL_INVOCATION_RESULT_JOINED,
}


class InvocationServicer(invocation_pb2_grpc.InvocationServiceServicer):
    def __init__(self, invoker: Invoker) -> None:
        self._invoker = invoker

    async def InvokeTool(
        self, request: invocation_pb2.InvokeToolRequest, context: ServicerContext
    ) -> invocation_pb2.InvokeToolResponse:
        announcer = EarlyId(context)
        try:
            result = await self._invoker.invoke(
                call_from_pb(request),
                request.idempotency_key,
                deliveries_from_pb(request.confirmed_tool_request_ids, request.confirmed_attachments),
                on_invocation=announcer.waiting,
                sessions=scope(Role.CALL),
                caller=caller(),
            )
        finally:
            await announcer.settled()
        return response_to_pb(result)

    async def InvokeTools(
        self, request_iterator: AsyncIterator[invocation_pb2.InvokeToolsRequest], context: ServicerContext
    ) -> AsyncIterator[invocation_pb2.InvokeToolsResponse]:
        async for response in relay(
            CallStream(self._invoker, scope(Role.CALL), caller=caller()), request_iterator
        ):
            yield response

    async def ConfirmDelivery(
        self, request: invocation_pb2.ConfirmDeliveryRequest, context: ServicerContext
    ) -> invocation_pb2.ConfirmDeliveryResponse:
        deliveries = deliveries_from_pb(request.tool_request_ids, request.attachments)
        await self._invoker.confirm_delivery(deliveries, scope(Role.CALL))
        return invocation_pb2.ConfirmDeliveryResponse()

    async def GetInvocation(
        self, request: invocation_pb2.GetInvocationRequest, context: ServicerContext
    ) -> invocation_pb2.GetInvocationResponse:
        record = await self._invoker.get_invocation(request.tool_request_id, scope(Role.CALL))
        return invocation_pb2.GetInvocationResponse(invocation=record_to_pb(record))

    async def RunTool(
        self, request: invocation_pb2.RunToolRequest, context: ServicerContext
    ) -> AsyncIterator[invocation_pb2.RunToolResponse]:
        call = request.call
        events = run_events(
            self._invoker,
            call_from_pb(call),
            call.idempotency_key,
            deliveries_from_pb(call.confirmed_tool_request_ids, call.confirmed_attachments),
            scope(Role.CALL),
        )
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, Started):
                    started = invocation_pb2.RunToolStarted(
                        tool_request_id=event.tool_request_id,
                        attachment_id=event.attachment_id,
                        retry_safe_until=timestamp(event.retry_safe_until),
                    )
                    yield invocation_pb2.RunToolResponse(started=started)
                elif isinstance(event, ToolProgress):
                    yield invocation_pb2.RunToolResponse(progress=progress_to_pb(event))
                else:
                    yield invocation_pb2.RunToolResponse(outcome=response_to_pb(event))

    async def CancelInvocation(
        self, request: invocation_pb2.CancelInvocationRequest, context: ServicerContext
    ) -> invocation_pb2.CancelInvocationResponse:
        verdict = await self._invoker.cancel_invocation(request.tool_request_id, scope(Role.CALL))
        return invocation_pb2.CancelInvocationResponse(result=_CANCEL_RESULTS[verdict])


def invocation_service(invoker: Invoker) -> Service:
    servicer = InvocationServicer(invoker)
    return Service(
        descriptor=invocation_pb2.DESCRIPTOR.services_by_name["InvocationService"],
        servicer=servicer,
        add_to_server=invocation_pb2_grpc.add_InvocationServiceServicer_to_server,
        on_shutdown=invoker.drain,
    )
