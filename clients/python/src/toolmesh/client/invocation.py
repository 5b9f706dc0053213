"""Calling tools: every answer is a CallResult, with or without an outcome."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from toolmesh.client.call_link import CallLink
from toolmesh.client.confirmations import Delivery, PendingConfirmations
from toolmesh.client.views import Invocation, outcome_json
from toolmesh.core import correlation, jsontext, telemetry
from toolmesh.core.bearer import Bearer, TokenSource, renew_in
from toolmesh.core.channels import open_channel
from toolmesh.core.errors import ERROR_TABLE, Code, code_for_reason
from toolmesh.core.limits import MAX_ARGUMENTS_BYTES
from toolmesh.core.outcome import Outcome
from toolmesh.core.progress import ToolProgress
from toolmesh.core.rpcstatus import error_code, error_info, grpc_status, token_expired
from toolmesh.core.stream_link import StreamBroken
from toolmesh.core.wire import (
    ATTACHMENT_ID_METADATA,
    RETRY_SAFE_UNTIL_METADATA,
    TOOL_REQUEST_ID_METADATA,
    outcome_from_pb,
    progress_from_pb,
)
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc


@dataclass(frozen=True, slots=True)
class CallResult:
    """What one tool call gave its caller: a formal outcome (`outcome` set), or none.

    With an outcome, the tool's result or its error (domain or runtime) is in
    `outcome`, and `joined` / `replayed` say whether an identical invocation
    answered it. Without one, `code` says why none arrived (for example
    CALLER_DEADLINE_EXCEEDED or TRANSPORT_FAILED) and `detail` adds what is known;
    the error table says whether an exact retry is safe.

    `tool_request_id` names the invocation, for `get_invocation`: None when the
    call was refused before it became one (TOOL_NOT_FOUND, TOOL_ARGS_INVALID:
    nothing was recorded, nothing ran), or when no answer at all arrived
    before the caller gave up. `attachment_id` names this call's attachment to
    it, which its delivery confirmation names (None when unknown).

    `retry_safe_until` (no outcome only; RFC 3339, UTC): until when an exact retry surely joins
    or replays the invocation, as the service said (its replay window, 10 minutes by default,
    counted from when this call attached); None when the service named no invocation. A later
    exact retry of an unconfirmed invocation is refused (RETRY_WINDOW_PASSED, nothing runs)
    while the ledger still knows it, then runs anew.
    """

    tool_request_id: str | None
    outcome: Outcome | None
    code: Code | None = None
    detail: str = ""
    # The call joined an identical running invocation, or replayed a finished one.
    joined: bool = False
    replayed: bool = False
    attachment_id: str | None = None
    retry_safe_until: str | None = None

    @property
    def outcome_received(self) -> bool:
        """Whether a formal outcome arrived (a result or an error of the tool call)."""
        return self.outcome is not None

    def _attachment(self) -> dict[str, bool]:
        return {"joined": self.joined, "replayed": self.replayed}

    def to_json(self) -> dict[str, Any]:
        """The structured response the CLI prints: `ok`, `outcomeReceived`, ids, and `result` or `error`."""
        if self.outcome is None:
            code = self.code or Code.TRANSPORT_FAILED
            return {
                "ok": False,
                "outcomeReceived": False,
                "toolRequestId": self.tool_request_id,
                **self._attachment(),
                "retrySafeUntil": self.retry_safe_until,
                "error": {
                    "code": code.value,
                    "kind": "runtime",
                    "message": f"{ERROR_TABLE[code].message} {self.detail}".strip(),
                    "retryable": ERROR_TABLE[code].retryable,
                    "details": None,
                },
            }
        return {
            "ok": self.outcome.ok,
            "outcomeReceived": True,
            "toolRequestId": self.tool_request_id,
            **self._attachment(),
            **outcome_json(self.outcome),
        }


log = logging.getLogger("toolmesh.client")

LOOKUP_TIMEOUT_S = 10.0
# A callback told of progress (a ToolProgress) or of the invocation's id (a str); sync or async.
ProgressCallback = Callable[[ToolProgress], object]
StartedCallback = Callable[[str], object]


async def _tell(callback: Callable[[Any], object] | None, value: object) -> None:
    """Call a caller's callback, awaiting what it returns when that is awaitable.

    A callback that raises is logged (its type alone) and the call goes on: it is the caller's
    own code, and the call's outcome is still to come.
    """
    if callback is None:
        return
    try:
        returned = callback(value)
        if inspect.isawaitable(returned):
            await returned
    except Exception as exc:
        log.warning("a call's callback raised", extra={"exception": type(exc).__name__})


_ANNOUNCED = (TOOL_REQUEST_ID_METADATA, ATTACHMENT_ID_METADATA, RETRY_SAFE_UNTIL_METADATA)


def _announced(metadata: grpc.aio.Metadata | None) -> tuple[str | None, str | None, str | None]:
    """The invocation's id, the call's attachment id and its retrySafeUntil, when sent ahead."""
    found: dict[str, str] = {}
    for key, value in metadata or ():
        if key in _ANNOUNCED and isinstance(value, str):
            found[key] = value
    return (
        found.get(TOOL_REQUEST_ID_METADATA),
        found.get(ATTACHMENT_ID_METADATA),
        found.get(RETRY_SAFE_UNTIL_METADATA),
    )


def _named_in(metadata: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The invocation and attachment a no-outcome error names (OUTCOME_UNAVAILABLE does)."""
    return metadata.get("toolRequestId") or None, metadata.get("attachmentId") or None


def _safe_until_in(metadata: Mapping[str, str]) -> str | None:
    """Until when an exact retry is safe, as a no-outcome error says (OUTCOME_UNAVAILABLE does)."""
    return metadata.get("retrySafeUntil") or None


def _confirmations_fields(deliveries: list[Delivery]) -> dict[str, Any]:
    """The request fields that carry `deliveries`: ids alone, and single attachments."""
    return {
        "confirmed_tool_request_ids": [d.tool_request_id for d in deliveries if not d.attachment_id],
        "confirmed_attachments": [
            invocation_pb2.DeliveredAttachment(
                tool_request_id=d.tool_request_id, attachment_id=d.attachment_id
            )
            for d in deliveries
            if d.attachment_id
        ],
    }


def _carried_by(request: invocation_pb2.InvokeToolRequest) -> list[Delivery]:
    carried = [Delivery(tool_request_id) for tool_request_id in request.confirmed_tool_request_ids]
    carried.extend(Delivery(d.tool_request_id, d.attachment_id) for d in request.confirmed_attachments)
    return carried


def _answered(response: invocation_pb2.InvokeToolResponse) -> CallResult:
    return CallResult(
        response.tool_request_id or None,
        outcome_from_pb(response.outcome),
        joined=response.joined,
        replayed=response.replayed,
        attachment_id=response.attachment_id or None,
    )


def _callers_fault(code: Code | None) -> TypeGuard[Code]:
    """A failed call the client raises rather than returns: the request itself is wrong."""
    return code is not None and ERROR_TABLE[code].caller_fault


class InvocationClient:
    """Calls tools on an invocation service: for agents, gateways and the CLI.

    With `multiplex`, all calls share one InvokeTools stream instead of each
    being its own InvokeTool call: for callers that keep many calls open at
    once (the service then holds no gRPC call per waiting call). Results and
    errors are the same either way. Close it (`close()` or `async with`) so that
    pending delivery confirmations are sent.

    Args:
        target: The invocation service's address, `host:port`.
        channel: A channel to use instead of opening one (the client then does not close it).
        multiplex: Send every call on one InvokeTools stream.
        credentials: TLS for a channel it opens (toolmesh.core.tls.client_credentials).
        token: The caller's token: text, or a callback (sync or async) asked before each call.
    """

    def __init__(
        self,
        target: str,
        *,
        channel: grpc.aio.Channel | None = None,
        multiplex: bool = False,
        credentials: grpc.ChannelCredentials | None = None,
        token: TokenSource | None = None,
    ) -> None:
        self._own_channel = channel is None
        self._channel = channel or open_channel(target, credentials)
        self._stub = invocation_pb2_grpc.InvocationServiceStub(self._channel)
        self._bearer = Bearer(token)
        self._confirmations = PendingConfirmations(self._send_confirmations)
        self._multiplex = multiplex
        self._link: CallLink | None = None
        # When to open a new stream for the next calls: ahead of the current one's token expiry.
        self._renew_link_at = math.inf

    async def invoke(
        self,
        session_id: str,
        tool_name: str,
        arguments: Any = None,
        *,
        turn_id: str,
        arguments_json: str | None = None,
        timeout: float | None = None,
        idempotency_key: str = "",
        confirm_delivery: bool = True,
        on_progress: ProgressCallback | None = None,
        on_started: StartedCallback | None = None,
    ) -> CallResult:
        """Call a tool. Pass `arguments` as a value, or `arguments_json` as text sent as it is.

        `on_started(tool_request_id)` is told the invocation's id once the
        service names it, before its outcome (not for a replayed outcome nor a
        call refused before it became an invocation): the id to give
        `cancel_invocation`. `on_progress(progress)` gets each progress report
        of the handler (a ToolProgress), best effort. Either callback may be
        sync or async (awaited); one that raises is logged and the call goes
        on. With either, the call goes as a RunTool stream, and without them
        exactly as before. Progress changes nothing about the outcome.

        `timeout` is the caller's own deadline. When it passes, or the
        connection fails, the result has no outcome and an exact retry is safe:
        it joins or replays the same invocation. The service never begins the
        call once that deadline has passed (InvokeToolRequest.deadline_unix_ms). Once an outcome arrived, its
        delivery is confirmed (unless `confirm_delivery` is false): on the next
        call, or alone within a fraction of a second, or at `close()`; a later
        identical call then runs anew. A request at fault (a code the error
        table marks `caller_fault`: INVALID_REQUEST, IDEMPOTENCY_KEY_REUSED, or
        a token that does not allow the call: UNAUTHENTICATED, PERMISSION_DENIED)
        raises the gRPC error: nothing ran, and sending it again as it is cannot help.
        """
        text = (
            arguments_json
            if arguments_json is not None
            else jsontext.dumps({} if arguments is None else arguments)
        )
        request = invocation_pb2.InvokeToolRequest(
            session_id=session_id,
            turn_id=turn_id,
            tool_name=tool_name,
            arguments_json=text,
            idempotency_key=idempotency_key,
            # So that the service never begins the call once this caller gave up (a service paused
            # with the call in its socket): gRPC's relative deadline restarts when it reads it.
            deadline_unix_ms=0 if timeout is None else math.ceil((time.time() + timeout) * 1000),
            **_confirmations_fields(self._confirmations.take()),
        )
        with (
            telemetry.span("toolmesh.call_tool", SpanKind.CLIENT) as span,
            correlation.ids(session_id=session_id, turn_id=turn_id, tool_name=tool_name),
        ):
            if on_progress is not None or on_started is not None:
                result = await self._run(request, timeout, on_progress, on_started)
            else:
                call = self._call_on_stream if self._multiplex else self._call
                result = await call(request, timeout)
            if result.tool_request_id:
                span.set_attribute(telemetry.TOOL_REQUEST_ID, result.tool_request_id)
            if result.outcome is None:
                span.set_attribute(telemetry.OUTCOME_CODE, (result.code or Code.TRANSPORT_FAILED).value)
                span.set_status(Status(StatusCode.ERROR, "no outcome"))
                if result.tool_request_id and result.attachment_id:
                    # Its retry's outcome confirms this attachment too, or it would hold the outcome.
                    self._confirmations.unanswered(result.tool_request_id, result.attachment_id)
                return result
            telemetry.record_outcome(result.outcome)
        if confirm_delivery and result.tool_request_id:
            self._confirmations.add(result.tool_request_id, result.attachment_id or "")
        return result

    async def _call(self, request: invocation_pb2.InvokeToolRequest, timeout: float | None) -> CallResult:
        try:
            with telemetry.client_call("toolmesh.v1.InvocationService/InvokeTool") as metadata:
                call = self._stub.InvokeTool(
                    request, timeout=timeout, metadata=await self._bearer.metadata(metadata)
                )
                response = await call
        except grpc.aio.AioRpcError as error:
            # The service names the invocation before its outcome: a call that gets none still knows it.
            return self._no_outcome(request, error, *_announced(error.initial_metadata()))
        return _answered(response)

    async def _run(
        self,
        request: invocation_pb2.InvokeToolRequest,
        timeout: float | None,
        on_progress: ProgressCallback | None,
        on_started: StartedCallback | None,
    ) -> CallResult:
        """The call as a RunTool stream: its started and progress events go to the callbacks."""
        started: str | None = None
        attachment_id: str | None = None
        safe_until: str | None = None
        try:
            with telemetry.client_call("toolmesh.v1.InvocationService/RunTool") as metadata:
                stream = self._stub.RunTool(
                    invocation_pb2.RunToolRequest(call=request),
                    timeout=timeout,
                    metadata=await self._bearer.metadata(metadata),
                )
                try:
                    async for event in stream:
                        kind = event.WhichOneof("event")
                        if kind == "started":
                            started = event.started.tool_request_id
                            attachment_id = event.started.attachment_id or None
                            if event.started.HasField("retry_safe_until"):
                                safe_until = event.started.retry_safe_until.ToJsonString()
                            await _tell(on_started, started)
                        elif kind == "progress":
                            await _tell(on_progress, progress_from_pb(event.progress))
                        elif kind == "outcome":
                            return _answered(event.outcome)
                except asyncio.CancelledError:
                    stream.cancel()  # the caller gave up: the invocation goes on, as after a unary call
                    raise
        except grpc.aio.AioRpcError as error:
            return self._no_outcome(request, error, started, attachment_id, safe_until)
        self._confirmations.give_back(_carried_by(request))
        ended = "The stream ended without an outcome."
        return CallResult(
            started,
            None,
            Code.TRANSPORT_FAILED,
            ended,
            attachment_id=attachment_id,
            retry_safe_until=safe_until,
        )

    def _no_outcome(
        self,
        request: invocation_pb2.InvokeToolRequest,
        error: grpc.aio.AioRpcError,
        tool_request_id: str | None,
        attachment_id: str | None,
        safe_until: str | None = None,
    ) -> CallResult:
        """A call that ended in `error` without an outcome, naming the invocation when it is known.

        Raises `error` when the request was at fault. The ids are those the service sent before
        the error, else those its ErrorInfo names.
        """
        self._confirmations.give_back(_carried_by(request))
        code = error_code(error)
        if _callers_fault(code):
            raise error
        if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED and code is None:
            code = Code.CALLER_DEADLINE_EXCEEDED
            return CallResult(
                tool_request_id, None, code, attachment_id=attachment_id, retry_safe_until=safe_until
            )
        info = error_info(error)
        metadata = info.metadata if info is not None else {}
        named, named_attachment = _named_in(metadata)
        return CallResult(
            tool_request_id or named,
            None,
            code or Code.TRANSPORT_FAILED,
            error.details() or "",
            attachment_id=attachment_id or named_attachment,
            retry_safe_until=safe_until or _safe_until_in(metadata),
        )

    async def _call_on_stream(
        self, request: invocation_pb2.InvokeToolRequest, timeout: float | None, *, renewed: bool = False
    ) -> CallResult:
        if request.ByteSize() > MAX_ARGUMENTS_BYTES:
            # Too large for the service to take (it says TOOL_ARGS_INVALID), perhaps for the
            # transport too, which would end the stream and every call on it: send it alone.
            return await self._call(request, timeout)
        link = self._link
        if link is None or link.closed or time.monotonic() >= self._renew_link_at:
            # A new stream ahead of its token's expiry: the old one answers the calls it has.
            token = await self._bearer.token()
            link = self._link = CallLink(self._stub, Bearer.with_token(token))
            renewal = renew_in(token)
            self._renew_link_at = math.inf if renewal is None else time.monotonic() + renewal
        try:
            with telemetry.client_span("toolmesh.v1.InvocationService/InvokeTools") as carrier:
                streamed = await link.call(request, carrier, timeout)
        except StreamBroken as broken:
            if broken.error is not None and token_expired(broken.error) and not renewed:
                # Its stream outlived its token: the call goes on in the ledger, and an exact retry
                # on a new stream joins or replays it.
                self._renew_link_at = 0.0
                return await self._call_on_stream(request, timeout, renewed=True)
            return self._stream_failed(request, broken)
        except TimeoutError as failure:
            return self._stream_failed(request, failure)
        if streamed.HasField("response"):
            return _answered(streamed.response)
        self._confirmations.give_back(_carried_by(request))
        error = streamed.error
        code = code_for_reason(error.reason)
        if _callers_fault(code):
            # As InvokeTool would: the caller's bug, raised as the gRPC error.
            status = grpc_status(code, error.message, error.metadata)
            trailing = grpc.aio.Metadata(*status.trailing_metadata)
            raise grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), trailing, status.details)
        named, attachment_id = _named_in(error.metadata)
        return CallResult(
            named,
            None,
            code or Code.TRANSPORT_FAILED,
            error.message,
            attachment_id=attachment_id,
            retry_safe_until=_safe_until_in(error.metadata),
        )

    def _stream_failed(
        self, request: invocation_pb2.InvokeToolRequest, failure: TimeoutError | StreamBroken
    ) -> CallResult:
        self._confirmations.give_back(_carried_by(request))
        if isinstance(failure, TimeoutError):
            return CallResult(None, None, Code.CALLER_DEADLINE_EXCEEDED)
        if failure.error is not None and _callers_fault(error_code(failure.error)):
            raise failure.error from None  # the stream itself was refused: as InvokeTool would be
        return CallResult(None, None, Code.TRANSPORT_FAILED, f"The stream ended ({failure.status}).")

    async def confirm_delivery(self, *delivered: CallResult | str) -> bool:
        """Confirm the delivery of these outcomes now, with any confirmations still pending.

        Pass the CallResults of calls made with `confirm_delivery=False`: each
        confirms its own call's attachment (and those of this client's calls to
        the same invocation that got no outcome), so the outcome stays
        replayable to other callers attached to it until they confirm too. A
        tool request id alone confirms every caller's attachment at once.

        Returns False when the service could not be told: harmless, the outcomes
        are then replayed to an exact retry until the ledger's replay window ends.
        """
        for item in delivered:
            if isinstance(item, str):
                self._confirmations.add(item)
            elif item.tool_request_id is not None:
                self._confirmations.add(item.tool_request_id, item.attachment_id or "")
        return await self._send_confirmations(self._confirmations.take())

    async def flush_confirmations(self) -> None:
        """Send the pending delivery confirmations now; a failure to send is not raised.

        See `confirm_delivery` for why an unsent confirmation is harmless.
        """
        await self._confirmations.flush()

    async def _send_confirmations(self, deliveries: list[Delivery]) -> bool:
        if not deliveries:
            return True
        fields = _confirmations_fields(deliveries)
        request = invocation_pb2.ConfirmDeliveryRequest(
            tool_request_ids=fields["confirmed_tool_request_ids"], attachments=fields["confirmed_attachments"]
        )
        try:
            with telemetry.client_call("toolmesh.v1.InvocationService/ConfirmDelivery") as metadata:
                await self._stub.ConfirmDelivery(
                    request,
                    timeout=5.0,
                    metadata=await self._bearer.metadata(metadata),
                )
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            # Not told (UsageError: the client was closed meanwhile, a call ending as it closed).
            return False
        return True

    async def get_invocation(self, tool_request_id: str) -> Invocation:
        """The ledger's view of one invocation: state, outcome, delivery and times.

        `to_json()` gives the shape `toolmesh invocations show` prints; `message`, the wire message.

        For reconciling after a call ended without an outcome. This client's
        pending confirmations are sent first, so the view includes them. Raises
        grpc.aio.AioRpcError: NOT_FOUND (INVOCATION_NOT_FOUND) when the ledger
        does not know the id or no longer keeps it, INVALID_ARGUMENT for a
        malformed id, or the transport's status.
        """
        await self._confirmations.flush()
        with telemetry.client_call("toolmesh.v1.InvocationService/GetInvocation") as metadata:
            response: invocation_pb2.GetInvocationResponse = await self._stub.GetInvocation(
                invocation_pb2.GetInvocationRequest(tool_request_id=tool_request_id),
                timeout=LOOKUP_TIMEOUT_S,
                metadata=await self._bearer.metadata(metadata),
            )
        return Invocation.from_pb(response.invocation)

    async def cancel_invocation(self, tool_request_id: str) -> bool:
        """Stop a running invocation: it ends with TOOL_CANCELLED and its handler is told to stop.

        Returns True when this cancelled it (every caller waiting on it gets
        TOOL_CANCELLED); False when nothing changed: it had already ended, or
        another call has joined it and still waits for its outcome. Raises
        grpc.aio.AioRpcError for a caller's fault: NOT_FOUND
        (INVOCATION_NOT_FOUND: unknown, expired, or of a session the token
        does not name), INVALID_ARGUMENT for a malformed id, PERMISSION_DENIED
        or UNAUTHENTICATED; and for the transport's own failures.
        """
        with telemetry.client_call("toolmesh.v1.InvocationService/CancelInvocation") as metadata:
            response: invocation_pb2.CancelInvocationResponse = await self._stub.CancelInvocation(
                invocation_pb2.CancelInvocationRequest(tool_request_id=tool_request_id),
                timeout=LOOKUP_TIMEOUT_S,
                metadata=await self._bearer.metadata(metadata),
            )
        return response.result == invocation_pb2.CANCEL_INVOCATION_RESULT_CANCELLED

    async def close(self) -> None:
        """Send the pending confirmations, end the InvokeTools stream, and close an owned channel."""
        await self._confirmations.close()
        if self._link is not None:
            await self._link.aclose()
        if self._own_channel:
            await self._channel.close()

    async def __aenter__(self) -> InvocationClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
