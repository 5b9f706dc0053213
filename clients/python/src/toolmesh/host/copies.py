"""A result's copies, handed to the other bridge replicas while its own replica leaves it unanswered.

A replica that is frozen (SIGSTOP, a stuck event loop) or cut off answers
nothing, and the host waits its attempt's share of the time before it leaves
that replica for another (leaving ends the requests the host runs there, so it
is not done at the first hiccup). A host that dies meanwhile takes its result
with it, although another replica was up all along. So once a receipt is
COPY_AFTER_S late, with nothing heard from the replica since the result went
out, a copy goes to every other replica as well. A replica that shares the
ledger records it while the invocation runs (the first outcome written wins,
and a copy is the same outcome, so the two can never disagree); the wait for
the first receipt goes on beside it. Private to toolmesh.host.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.rpc.error_details_pb2 import ErrorInfo

from toolmesh.core.bearer import Metadata
from toolmesh.core.errors import Code, code_for_reason
from toolmesh.core.races import any_true
from toolmesh.core.rpcstatus import error_info
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc

# A receipt this late, with nothing heard from its replica meanwhile, sends the copies. A replica
# that runs answers in milliseconds; a copy sent needlessly costs the other replica a ledger read.
COPY_AFTER_S = 0.5


async def hand_in_copies(
    stubs: Sequence[bridge_pb2_grpc.BridgeServiceAsyncStub],
    request: bridge_pb2.SubmitToolResultRequest,
    timeout_s: float,
    metadata: Metadata,
) -> bool:
    """Send `request` to every replica of `stubs` at once: whether one of them has the outcome.

    Taken, or refused as already answered with this outcome (REQUEST_ENDED, ended "answered").
    Any other answer, or none within `timeout_s`, says nothing: the result's own replica may
    still take it.
    """
    return await any_true(_hand_in(stub, request, timeout_s, metadata) for stub in stubs)


async def _hand_in(
    stub: bridge_pb2_grpc.BridgeServiceAsyncStub,
    request: bridge_pb2.SubmitToolResultRequest,
    timeout_s: float,
    metadata: Metadata,
) -> bool:
    try:
        await stub.SubmitToolResult(request, timeout=timeout_s, metadata=metadata)
    except grpc.aio.AioRpcError as error:
        return answered_before(error_info(error))
    except grpc.aio.UsageError:
        return False  # the host is closing its channels
    return True


def answered_before(info: ErrorInfo | None) -> bool:
    """Whether a submit's refusal (its ErrorInfo) says the request ended with this very outcome.

    A send of it before this one got through (REQUEST_ENDED, ended "answered").
    """
    return (
        info is not None
        and code_for_reason(info.reason) is Code.REQUEST_ENDED
        and info.metadata.get("ended") == "answered"
    )
