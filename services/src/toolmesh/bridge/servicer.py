"""BridgeService over gRPC: a thin adapter onto Router and Declarations.

The host-facing methods (`host_events`, `submit`, `submit_many`, `declare`, `answer_read_check`,
`report_progress`, `start_requests`) are shared with the
web port (toolmesh.bridge.web), which serves them over Connect and gRPC-Web; ExchangeHostWork
(toolmesh.bridge.host_work) carries `start_requests` and `submit` on a stream, for gRPC hosts only.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Container
from dataclasses import replace
from functools import partial

from toolmesh.auth.grants import Role
from toolmesh.auth.guard import caller, scope
from toolmesh.bridge.cancels import HeldRequests
from toolmesh.bridge.declarations import Declarations
from toolmesh.bridge.dispatch_stream import DispatchStream
from toolmesh.bridge.host_work import HostWorkStream, HostWorkStreams
from toolmesh.bridge.outcomes import OutcomeRecorder, accept
from toolmesh.bridge.router import EndReason, Heartbeat, Router, StartVerdict, ToolRequestCancelled
from toolmesh.core import correlation, telemetry
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.limits import MAX_CALLS_PER_MESSAGE, MAX_SUBMIT_RESULTS_BYTES
from toolmesh.core.outbox import BATCH_BYTES
from toolmesh.core.progress import ProgressVerdict, ToolProgress
from toolmesh.core.wire import outcome_from_pb, outcome_to_pb, request_from_pb, request_to_pb, tool_from_pb
from toolmesh.runtime import store_errors
from toolmesh.runtime.relay import relay
from toolmesh.runtime.rpc_types import ServicerContext
from toolmesh.runtime.server import Service
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc

_PROGRESS_STATUS = {
    ProgressVerdict.ACCEPTED: bridge_pb2.PROGRESS_REPORT_STATUS_ACCEPTED,
    ProgressVerdict.INVALID: bridge_pb2.PROGRESS_REPORT_STATUS_INVALID,
    ProgressVerdict.REQUEST_UNKNOWN: bridge_pb2.PROGRESS_REPORT_STATUS_REQUEST_UNKNOWN,
    ProgressVerdict.REQUEST_ENDED: bridge_pb2.PROGRESS_REPORT_STATUS_REQUEST_ENDED,
}
_START_VERDICTS = {
    StartVerdict.START: bridge_pb2.TOOL_START_VERDICT_START,
    StartVerdict.TIMED_OUT: bridge_pb2.TOOL_START_VERDICT_TIMED_OUT,
    StartVerdict.CANCELLED: bridge_pb2.TOOL_START_VERDICT_CANCELLED,
    StartVerdict.ENDED: bridge_pb2.TOOL_START_VERDICT_ENDED,
    StartVerdict.UNKNOWN: bridge_pb2.TOOL_START_VERDICT_UNKNOWN,
    StartVerdict.ALREADY_STARTED: bridge_pb2.TOOL_START_VERDICT_ALREADY_STARTED,
}
_CANCEL_REASONS = {
    EndReason.TIMED_OUT: bridge_pb2.CANCEL_REASON_TIMEOUT,
    EndReason.CANCELLED: bridge_pb2.CANCEL_REASON_CANCELLED,
}


async def host_events(
    router: Router, request: bridge_pb2.OpenHostSessionRequest, *, host_work_served: bool = False
) -> AsyncIterator[bridge_pb2.OpenHostSessionResponse]:
    """A host session's stream: opened, then requests, cancellations and heartbeats until it ends.

    `host_work_served`: this port serves ExchangeHostWork (the gRPC port; not the web port).
    """
    host = router.open_host(
        request.session_id,
        request.host_name,
        request.handler_names,
        request.has_generic_handler,
        request.replaces_host_session_id,
        grant=caller(),
        acknowledges_starts=request.acknowledges_starts,
    )
    batched = request.reads_tool_request_batches
    try:
        yield bridge_pb2.OpenHostSessionResponse(
            opened=bridge_pb2.HostSessionOpened(
                host_session_id=host.host_session_id,
                heartbeat_interval_ms=round(router.heartbeat_s * 1000),
                server_time_unix_ms=_now_ms(),
                starts_acknowledged=host.acknowledges_starts,
                host_work_served=host_work_served,
                tool_requests_batched=batched,
            )
        )
        while True:
            event = await host.next_event()
            if event is None:
                return  # another host session of the host took over, and this one answered all it held
            if isinstance(event, Heartbeat):
                # The clock as it leaves, not as it was queued: the host takes it for "now".
                heartbeat = bridge_pb2.Heartbeat(read_check=event.read_check, server_time_unix_ms=_now_ms())
                yield bridge_pb2.OpenHostSessionResponse(heartbeat=heartbeat)
            elif isinstance(event, ToolRequestCancelled):
                yield bridge_pb2.OpenHostSessionResponse(
                    cancelled=bridge_pb2.ToolRequestCancelled(
                        tool_request_id=event.tool_request_id, reason=_CANCEL_REASONS[event.reason]
                    )
                )
            else:
                # Those queued behind it go with it: one message, one write and one read for all.
                more = host.ready_requests(MAX_CALLS_PER_MESSAGE - 1, BATCH_BYTES) if batched else []
                if more:
                    batch = bridge_pb2.ToolRequestBatch(requests=[request_to_pb(r) for r in (event, *more)])
                    yield bridge_pb2.OpenHostSessionResponse(tool_requests=batch)
                else:
                    yield bridge_pb2.OpenHostSessionResponse(tool_request=request_to_pb(event))
    finally:
        router.close_host(host)


async def submit(
    router: Router,
    recorder: OutcomeRecorder | None,
    request: bridge_pb2.SubmitToolResultRequest,
    sessions: Container[str] | None,
) -> bridge_pb2.SubmitToolResultResponse:
    """A host's outcome, decoded once and taken by `outcomes.accept` (adopted through `recorder`
    when another replica sent the request). `sessions`: those the host may serve (None: all);
    another's host session is unknown to it."""
    outcome = outcome_from_pb(request.outcome)
    telemetry.record_outcome(outcome)
    await accept(
        router, recorder, request.host_session_id, request.tool_request_id, outcome, sessions=sessions
    )
    return bridge_pb2.SubmitToolResultResponse()


async def submit_many(
    router: Router,
    recorder: OutcomeRecorder | None,
    request: bridge_pb2.SubmitToolResultsRequest,
    sessions: Container[str] | None,
) -> bridge_pb2.SubmitToolResultsResponse:
    """Several outcomes of one host session, each taken as `submit` takes one, in order, and answered
    on its own: a refused one (its ToolmeshError as a ToolResultRefusal) never costs the others.

    Raises ToolmeshError(LIMIT_EXCEEDED), taking none, over MAX_CALLS_PER_MESSAGE results or
    MAX_SUBMIT_RESULTS_BYTES of outcomes."""
    results = request.results
    if len(results) > MAX_CALLS_PER_MESSAGE:
        raise ToolmeshError(
            Code.LIMIT_EXCEEDED,
            f"At most {MAX_CALLS_PER_MESSAGE} results per call.",
            {"limit": "max_results_per_submit", "value": str(MAX_CALLS_PER_MESSAGE)},
        )
    if sum(result.outcome.ByteSize() for result in results) > MAX_SUBMIT_RESULTS_BYTES:
        raise ToolmeshError(
            Code.LIMIT_EXCEEDED,
            f"At most {MAX_SUBMIT_RESULTS_BYTES} bytes of outcomes per call; send fewer at once.",
            {"limit": "max_submit_results_bytes", "value": str(MAX_SUBMIT_RESULTS_BYTES)},
        )
    answers = []
    for result in results:
        answer = bridge_pb2.ToolResultAnswer(tool_request_id=result.tool_request_id)
        try:
            outcome = outcome_from_pb(result.outcome)
            telemetry.record_outcome(outcome)
            await accept(
                router, recorder, request.host_session_id, result.tool_request_id, outcome, sessions=sessions
            )
        except ToolmeshError as error:
            store_errors.count("SubmitToolResults", error)
            answer.refusal.reason = error.code.value
            answer.refusal.message = error.message
            answer.refusal.metadata.update(error.metadata)
        answers.append(answer)
    return bridge_pb2.SubmitToolResultsResponse(answers=answers)


def _now_ms() -> int:
    return math.floor(time.time() * 1000)


async def start_requests(
    router: Router, request: bridge_pb2.StartToolRequestsRequest, sessions: Container[str] | None
) -> bridge_pb2.StartToolRequestsResponse:
    """`sessions`: as for `submit`."""
    ids = request.tool_request_ids
    verdicts = await router.start_requests(request.host_session_id, ids, sessions)
    return bridge_pb2.StartToolRequestsResponse(
        starts=[
            bridge_pb2.ToolStart(tool_request_id=tool_request_id, verdict=_START_VERDICTS[verdict])
            for tool_request_id, verdict in zip(ids, verdicts, strict=True)
        ]
    )


def answer_read_check(
    router: Router, request: bridge_pb2.AnswerReadCheckRequest, sessions: Container[str] | None
) -> bridge_pb2.AnswerReadCheckResponse:
    """`sessions`: as for `submit`."""
    router.answer_read_check(request.host_session_id, request.read_check, sessions)
    return bridge_pb2.AnswerReadCheckResponse(server_time_unix_ms=_now_ms())


def report_progress(
    router: Router, request: bridge_pb2.ReportToolProgressRequest, sessions: Container[str] | None
) -> bridge_pb2.ReportToolProgressResponse:
    """`sessions`: as for `submit`."""
    progress = ToolProgress(
        tool_request_id=request.tool_request_id,
        progress=request.progress,
        total=request.total if request.HasField("total") else None,
        message=request.message or None,
    )
    verdict, truncated = router.report_progress(request.host_session_id, progress, sessions)
    return bridge_pb2.ReportToolProgressResponse(
        status=_PROGRESS_STATUS[verdict], message_truncated=truncated
    )


async def declare(
    declarations: Declarations, request: bridge_pb2.DeclareHostToolsRequest, sessions: Container[str] | None
) -> bridge_pb2.DeclareHostToolsResponse:
    """`sessions`: as for `submit`."""
    tools = [tool_from_pb(tool) for tool in request.tools]
    revision = await declarations.declare(request.host_session_id, tools, sessions)
    return bridge_pb2.DeclareHostToolsResponse(revision=revision)


class BridgeServicer(bridge_pb2_grpc.BridgeServiceServicer):
    def __init__(
        self,
        router: Router,
        declarations: Declarations,
        recorder: OutcomeRecorder | None = None,
        holds: HeldRequests | None = None,
    ) -> None:
        self._router = router
        self._declarations = declarations
        self._recorder = recorder
        self._holds = holds
        self._host_work = HostWorkStreams()

    async def OpenHostSession(
        self, request: bridge_pb2.OpenHostSessionRequest, context: ServicerContext
    ) -> AsyncIterator[bridge_pb2.OpenHostSessionResponse]:
        async for event in host_events(self._router, request, host_work_served=True):
            yield event

    async def SubmitToolResult(
        self, request: bridge_pb2.SubmitToolResultRequest, context: ServicerContext
    ) -> bridge_pb2.SubmitToolResultResponse:
        return await submit(self._router, self._recorder, request, scope(Role.HOST))

    async def SubmitToolResults(
        self, request: bridge_pb2.SubmitToolResultsRequest, context: ServicerContext
    ) -> bridge_pb2.SubmitToolResultsResponse:
        return await submit_many(self._router, self._recorder, request, scope(Role.HOST))

    async def DeclareHostTools(
        self, request: bridge_pb2.DeclareHostToolsRequest, context: ServicerContext
    ) -> bridge_pb2.DeclareHostToolsResponse:
        return await declare(self._declarations, request, scope(Role.HOST))

    async def AnswerReadCheck(
        self, request: bridge_pb2.AnswerReadCheckRequest, context: ServicerContext
    ) -> bridge_pb2.AnswerReadCheckResponse:
        return answer_read_check(self._router, request, scope(Role.HOST))

    async def ReportToolProgress(
        self, request: bridge_pb2.ReportToolProgressRequest, context: ServicerContext
    ) -> bridge_pb2.ReportToolProgressResponse:
        return report_progress(self._router, request, scope(Role.HOST))

    async def StartToolRequests(
        self, request: bridge_pb2.StartToolRequestsRequest, context: ServicerContext
    ) -> bridge_pb2.StartToolRequestsResponse:
        return await start_requests(self._router, request, scope(Role.HOST))

    async def ExchangeHostWork(
        self,
        request_iterator: AsyncIterator[bridge_pb2.ExchangeHostWorkRequest],
        context: ServicerContext,
    ) -> AsyncIterator[bridge_pb2.ExchangeHostWorkResponse]:
        sessions = scope(Role.HOST)
        stream = HostWorkStream(
            self._router,
            self._host_work,
            sessions,
            start=partial(start_requests, self._router, sessions=sessions),
            submit=partial(submit, self._router, self._recorder, sessions=sessions),
        )
        async for response in relay(stream, request_iterator):
            yield response

    async def DispatchToolRequest(
        self, request: bridge_pb2.DispatchToolRequestRequest, context: ServicerContext
    ) -> bridge_pb2.DispatchToolRequestResponse:
        tool_request = request_from_pb(request.request)
        with correlation.ids(
            session_id=tool_request.session_id,
            turn_id=tool_request.turn_id,
            tool_request_id=tool_request.tool_request_id,
            tool_name=tool_request.tool_name,
        ):
            # The host's span becomes a child of this one: the stream carries no
            # metadata, so the context travels inside the request.
            outcome = await self._router.dispatch(replace(tool_request, trace_context=telemetry.inject()))
            telemetry.record_outcome(outcome)
        return bridge_pb2.DispatchToolRequestResponse(outcome=outcome_to_pb(outcome))

    async def DispatchToolRequests(
        self,
        request_iterator: AsyncIterator[bridge_pb2.DispatchToolRequestsRequest],
        context: ServicerContext,
    ) -> AsyncIterator[bridge_pb2.DispatchToolRequestsResponse]:
        async for response in relay(
            DispatchStream(self._router, self._recorder, self._holds), request_iterator
        ):
            yield response


def bridge_service(
    router: Router,
    declarations: Declarations,
    recorder: OutcomeRecorder | None = None,
    holds: HeldRequests | None = None,
) -> Service:
    """`recorder`: the shared ledger outcomes are recorded in too (None: only sent back); `holds`:
    the held requests that cancellations posted in the store stop (toolmesh.bridge.cancels)."""
    servicer = BridgeServicer(router, declarations, recorder, holds)

    async def on_shutdown() -> None:
        router.shutdown()
        await declarations.aclose()

    return Service(
        descriptor=bridge_pb2.DESCRIPTOR.services_by_name["BridgeService"],
        servicer=servicer,
        add_to_server=bridge_pb2_grpc.add_BridgeServiceServicer_to_server,
        on_shutdown=on_shutdown,
    )
