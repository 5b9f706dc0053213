"""The error table over gRPC: statuses both ways, and google.rpc.Status with ErrorInfo (AIP-193)."""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from toolmesh.core.errors import DOMAIN, ERROR_TABLE, Code, Status, ToolmeshError, code_for_reason

_GRPC_CODES: Mapping[Status, grpc.StatusCode] = {Status(code.value[0]): code for code in grpc.StatusCode}


def grpc_code(status: Status) -> grpc.StatusCode:
    """The grpc.StatusCode of a table status."""
    return _GRPC_CODES[status]


def status_of(code: grpc.StatusCode) -> Status:
    """The table status of a grpc.StatusCode."""
    return Status(code.value[0])


def to_grpc_status(error: ToolmeshError) -> grpc.Status:
    return grpc_status(error.code, error.message, error.metadata)


def grpc_status(code: Code, message: str, metadata: Mapping[str, str]) -> grpc.Status:
    """The status (with ErrorInfo) a call failing with `code` carries."""
    info = error_details_pb2.ErrorInfo(reason=code.value, domain=DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=ERROR_TABLE[code].status, message=message, details=[detail])
    status_for_grpc: grpc.Status = rpc_status.to_status(status)
    return status_for_grpc


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo of a failed call, when the server attached one."""
    try:
        status = rpc_status.from_call(error)
    except ValueError:
        return None
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


def error_code(error: grpc.RpcError) -> Code | None:
    """The table code a failed call carries, or None when it carries none we know."""
    info = error_info(error)
    if info is None or info.domain != DOMAIN:
        return None
    return code_for_reason(info.reason)
