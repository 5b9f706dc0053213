"""Calling tools: every answer is a CallResult, with or without an outcome."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from toolmesh.core import jsontext
from toolmesh.core.errors import ERROR_TABLE, Code
from toolmesh.core.outcome import ErrorKind, Outcome
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.wire import outcome_from_pb
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc


@dataclass(frozen=True, slots=True)
class CallResult:
    """A formal outcome (`outcome` set), or none: `code` says why none arrived."""

    tool_request_id: str | None
    outcome: Outcome | None
    code: Code | None = None
    detail: str = ""

    @property
    def outcome_received(self) -> bool:
        return self.outcome is not None

    def to_json(self) -> dict[str, Any]:
        """The structured response the CLI prints."""
        if self.outcome is None:
            code = self.code or Code.TRANSPORT_FAILED
            return {
                "ok": False,
                "outcomeReceived": False,
                "toolRequestId": self.tool_request_id,
                "error": {
                    "code": code.value,
                    "message": f"{ERROR_TABLE[code].message} {self.detail}".strip(),
                    "retryable": ERROR_TABLE[code].retryable,
                    "details": None,
                },
            }
        if self.outcome.failure is None:
            assert self.outcome.result_json is not None
            return {
                "ok": True,
                "outcomeReceived": True,
                "toolRequestId": self.tool_request_id,
                "result": jsontext.parse(self.outcome.result_json),
            }
        failure = self.outcome.failure
        return {
            "ok": False,
            "outcomeReceived": True,
            "toolRequestId": self.tool_request_id,
            "error": {
                "code": failure.code,
                "kind": "domain" if failure.kind is ErrorKind.DOMAIN else "runtime",
                "message": failure.message,
                "retryable": failure.retryable,
                "details": failure.details,
            },
        }


class InvocationClient:
    def __init__(self, target: str, *, channel: grpc.aio.Channel | None = None) -> None:
        self._own_channel = channel is None
        self._channel = channel or grpc.aio.insecure_channel(target)
        self._stub = invocation_pb2_grpc.InvocationServiceStub(self._channel)

    async def invoke(
        self,
        session_id: str,
        tool_name: str,
        arguments: Any = None,
        *,
        turn_id: str,
        arguments_json: str | None = None,
        timeout: float | None = None,
    ) -> CallResult:
        """Call a tool. Pass `arguments` as a value, or `arguments_json` as text sent as it is.

        `timeout` is the caller's own deadline. When it passes, or the
        connection fails, the result has no outcome and an exact retry is safe.
        A malformed request (INVALID_REQUEST) raises the gRPC error.
        """
        text = (
            arguments_json
            if arguments_json is not None
            else jsontext.dumps({} if arguments is None else arguments)
        )
        request = invocation_pb2.InvokeToolRequest(
            session_id=session_id, turn_id=turn_id, tool_name=tool_name, arguments_json=text
        )
        try:
            response = await self._stub.InvokeTool(request, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            code = error_code(error)
            if code is Code.INVALID_REQUEST:
                raise
            if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED and code is None:
                return CallResult(None, None, Code.CALLER_DEADLINE_EXCEEDED)
            return CallResult(None, None, code or Code.TRANSPORT_FAILED, error.details() or "")
        return CallResult(response.tool_request_id, outcome_from_pb(response.outcome))

    async def close(self) -> None:
        if self._own_channel:
            await self._channel.close()

    async def __aenter__(self) -> InvocationClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
