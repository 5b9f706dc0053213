"""The error table over gRPC: statuses both ways, and google.rpc.Status with ErrorInfo (AIP-193)."""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from toolmesh.core.errors import DOMAIN, ERROR_TABLE, Code, Status, ToolmeshError, code_for_reason

# The trailer that carries a google.rpc.Status (grpc_status.rpc_status reads the same one).
STATUS_DETAILS_KEY = "grpc-status-details-bin"
_GRPC_CODES: Mapping[Status, grpc.StatusCode] = {Status(code.value[0]): code for code in grpc.StatusCode}


def grpc_code(status: Status) -> grpc.StatusCode:
    """The grpc.StatusCode of a table status."""
    return _GRPC_CODES[status]


def status_of(code: grpc.StatusCode) -> Status:
    """The table status of a grpc.StatusCode."""
    return Status(code.value[0])


def to_grpc_status(error: ToolmeshError) -> grpc.Status:
    return grpc_status(error.code, error.message, error.metadata, error.retry_delay_s)


# What an error's trailers may hold: a request's own (unbounded) id quoted back in full made
# trailers the caller's gRPC refused (its metadata limit is 16 KiB), so the error arrived untyped.
MAX_METADATA_VALUE_CHARS = 256
MAX_MESSAGE_CHARS = 1024


def grpc_status(
    code: Code, message: str, metadata: Mapping[str, str], retry_delay_s: float | None = None
) -> grpc.Status:
    """The status (with ErrorInfo, and RetryInfo given a delay) a call failing with `code` carries;
    long texts are cut."""
    message = _cut(message, MAX_MESSAGE_CHARS)
    metadata = {key: _cut(value, MAX_METADATA_VALUE_CHARS) for key, value in metadata.items()}
    info = error_details_pb2.ErrorInfo(reason=code.value, domain=DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    details = [detail]
    if retry_delay_s is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromNanoseconds(max(0, round(retry_delay_s * 1e9)))
        retry_detail = any_pb2.Any()
        retry_detail.Pack(retry)
        details.append(retry_detail)
    status = status_pb2.Status(code=ERROR_TABLE[code].status, message=message, details=details)
    status_for_grpc: grpc.Status = rpc_status.to_status(status)
    return status_for_grpc


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def rich_status(error: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    """The google.rpc.Status a failed call carries, unless its code or message contradict the call's own.

    As grpc_status.rpc_status.from_call, which takes a grpc.Call: an AioRpcError is not one.
    """
    for key, value in error.trailing_metadata() or ():
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)
            if status.code != error.code().value[0] or status.message != error.details():
                return None
            return status
    return None


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo of a failed call, when the server attached one."""
    status = rich_status(error)
    if status is None:
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):  # False for a detail of another type
            return info
    return None


def retry_delay_s(error: grpc.aio.AioRpcError) -> float | None:
    """The delay a failed call's RetryInfo asks for before the same call is sent again, if any."""
    status = rich_status(error)
    if status is None:
        return None
    for detail in status.details:
        retry = error_details_pb2.RetryInfo()
        if detail.Unpack(retry):
            return float(retry.retry_delay.ToNanoseconds()) / 1e9
    return None


def error_code(error: grpc.aio.AioRpcError) -> Code | None:
    """The table code a failed call carries, or None when it carries none we know."""
    info = error_info(error)
    if info is None or info.domain != DOMAIN:
        return None
    return code_for_reason(info.reason)


def token_expired(error: grpc.aio.AioRpcError) -> bool:
    """Whether a stream ended because the token it was opened with expired (open it again)."""
    info = error_info(error)
    return (
        info is not None
        and code_for_reason(info.reason) is Code.UNAUTHENTICATED
        and info.metadata.get("reason") == "expired"
    )
