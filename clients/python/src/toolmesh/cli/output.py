"""How the CLI reports failed RPCs and picks its exit code."""

from __future__ import annotations

import json
import sys

import grpc

from toolmesh.core.errors import ERROR_TABLE, Code
from toolmesh.core.rpcstatus import error_code

EXIT_USAGE = 2
# EX_TEMPFAIL: no outcome arrived; the same command may be retried as it is.
EXIT_NO_OUTCOME = 75


def exit_code_for(code: Code | None) -> int:
    """2 for a code that a retry as it is cannot fix; 75 for a retryable or unknown one."""
    if code is not None and not ERROR_TABLE[code].retryable:
        return EXIT_USAGE
    return EXIT_NO_OUTCOME


def print_rpc_error(error: grpc.aio.AioRpcError) -> int:
    """Print a failed RPC as one JSON object on stderr (code, gRPC status, message); returns the exit code."""
    code = error_code(error)
    name = code.value if code is not None else Code.TRANSPORT_FAILED.value
    print(
        json.dumps(
            {
                "ok": False,
                "error": {"code": name, "grpcStatus": error.code().name, "message": error.details()},
            }
        ),
        file=sys.stderr,
    )
    return exit_code_for(code)
