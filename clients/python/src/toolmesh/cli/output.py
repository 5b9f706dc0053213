"""How the CLI reports failed RPCs and picks its exit code.

Exit codes come from the error table alone:
- 0: the command did what it was asked (for `tool-call`: an outcome arrived, whatever it says);
- 1: the service answered that what the command names does not exist (a
  code whose status is NOT_FOUND, e.g. INVOCATION_NOT_FOUND);
- 2: a malformed command, or an RPC failed with another code the table marks
  not `retryable` (running the same command again fails the same way);
- 75 (EX_TEMPFAIL): the same command may succeed when run again as it is: no
  outcome arrived (`tool-call`), or the RPC failed with a code the table marks
  `retryable`, or with no code of ours at all (the transport failed);
- 130: interrupted (Ctrl-C).
"""

from __future__ import annotations

import json
import sys

import grpc

from toolmesh.client.config import ENV_VARS
from toolmesh.core.errors import ERROR_TABLE, Code, Status
from toolmesh.core.rpcstatus import error_code

EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_NO_OUTCOME = 75
EXIT_INTERRUPTED = 130


def exit_code_for(code: Code | None) -> int:
    """The exit code of a command whose RPC failed with `code` (None: no code of ours).

    75 (retry as it is) for a retryable code or none; 1 for "not found"; 2 for
    another code a retry cannot fix.
    """
    if code is None or ERROR_TABLE[code].retryable:
        return EXIT_NO_OUTCOME
    if ERROR_TABLE[code].status is Status.NOT_FOUND:
        return EXIT_NOT_FOUND
    return EXIT_USAGE


def unreachable(service: str, target: str) -> str:
    """What to say when `service` at `target` did not answer: where, and how to start it."""
    return (
        f"Could not reach the {service} service at {target}. Is toolmesh running? Start it with "
        f"./scripts/up or `toolmesh up`, or give its address (--{service} or {ENV_VARS[service]})."
    )


def was_unreachable(error: grpc.aio.AioRpcError) -> bool:
    """Whether the call failed because nothing answered at the address (no code of ours, UNAVAILABLE)."""
    return error_code(error) is None and error.code() is grpc.StatusCode.UNAVAILABLE


def print_rpc_error(error: grpc.aio.AioRpcError, service: str, target: str) -> int:
    """Print a failed RPC as one JSON object on stderr (code, gRPC status, message); returns the exit code.

    A service that did not answer is named with its address and how to start it.
    """
    code = error_code(error)
    name = code.value if code is not None else Code.TRANSPORT_FAILED.value
    shown: dict[str, object] = {"code": name, "grpcStatus": error.code().name, "message": error.details()}
    if was_unreachable(error):
        shown |= {"message": unreachable(service, target), "address": target, "cause": error.details()}
    print(json.dumps({"ok": False, "error": shown}), file=sys.stderr)
    return exit_code_for(code)


def usage_error(command: str, problem: str) -> int:
    """Print `toolmesh COMMAND: PROBLEM` on stderr; returns the usage exit code (2)."""
    print(f"toolmesh {command}: {problem}", file=sys.stderr)
    return EXIT_USAGE
