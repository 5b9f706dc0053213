"""How the CLI reports failed RPCs and picks its exit code.

Exit codes come from the error table alone:
- 0: the command did what it was asked (for `tool-call`: an outcome arrived, whatever it says);
- 75 (EX_TEMPFAIL): the same command may succeed when run again as it is: no
  outcome arrived (`tool-call`), or the RPC failed with a code the table marks
  `retryable`, or with no code of ours at all (the transport failed);
- 2: anything else: a malformed command, or an RPC failed with a code the
  table marks not `retryable` (running the same command again fails the same way).
"""

from __future__ import annotations

import json
import sys

import grpc

from toolmesh.core.errors import ERROR_TABLE, Code
from toolmesh.core.rpcstatus import error_code

EXIT_USAGE = 2
EXIT_NO_OUTCOME = 75


def exit_code_for(code: Code | None) -> int:
    """The exit code of a command whose RPC failed with `code` (None: no code of ours).

    75 (retry as it is) for a retryable code or none; 2 for one a retry cannot fix.
    """
    if code is None or ERROR_TABLE[code].retryable:
        return EXIT_NO_OUTCOME
    return EXIT_USAGE


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
