"""Who may call which RPC, for which session: the one table.

Public RPCs are served where callers and hosts connect, each to a token with
one of the rule's roles. When the request names its session in one field, the
token must name that session too, checked before the servicer runs. When it
does not (ids only, or a stream of calls each naming its own), the servicer
limits what it does to the caller's sessions (toolmesh.auth.guard.scope):
another session's invocation is not found, another session's call on a
stream is refused alone.

Internal RPCs are served only on the internal listener, to other toolmesh
services (their service credential: toolmesh.auth.service), never where callers and hosts connect.

An RPC in neither table is served nowhere (a test checks every RPC is here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from toolmesh.auth.grants import Role

CALL, HOST, ADMIN = Role.CALL, Role.HOST, Role.ADMIN
READERS = frozenset({CALL, HOST, ADMIN})


@dataclass(frozen=True, slots=True)
class Rule:
    roles: frozenset[Role]
    # The request field naming the session, or None: the servicer scopes by session itself.
    session_field: str | None


PUBLIC: Mapping[str, Rule] = MappingProxyType(
    {
        "toolmesh.v1.RegistryService/PutTools": Rule(frozenset({ADMIN, HOST}), "session_id"),
        "toolmesh.v1.RegistryService/ListTools": Rule(READERS, "session_id"),
        "toolmesh.v1.RegistryService/GetTool": Rule(READERS, "session_id"),
        "toolmesh.v1.RegistryService/WatchTools": Rule(READERS, "session_id"),
        "toolmesh.v1.InvocationService/InvokeTool": Rule(frozenset({CALL}), "session_id"),
        # Each call on the stream names its session: checked call by call.
        "toolmesh.v1.InvocationService/InvokeTools": Rule(frozenset({CALL}), None),
        # Ids only: another session's ids are left alone / not found.
        "toolmesh.v1.InvocationService/ConfirmDelivery": Rule(frozenset({CALL}), None),
        "toolmesh.v1.InvocationService/GetInvocation": Rule(frozenset({CALL}), None),
        "toolmesh.v1.InvocationService/CancelInvocation": Rule(frozenset({CALL}), None),
        "toolmesh.v1.InvocationService/RunTool": Rule(frozenset({CALL}), "call.session_id"),
        "toolmesh.v1.BridgeService/OpenHostSession": Rule(frozenset({HOST}), "session_id"),
        # The host session's own session must be one the token names.
        "toolmesh.v1.BridgeService/SubmitToolResult": Rule(frozenset({HOST}), None),
        "toolmesh.v1.BridgeService/SubmitToolResults": Rule(frozenset({HOST}), None),
        "toolmesh.v1.BridgeService/DeclareHostTools": Rule(frozenset({HOST}), None),
        "toolmesh.v1.BridgeService/AnswerReadCheck": Rule(frozenset({HOST}), None),
        "toolmesh.v1.BridgeService/ReportToolProgress": Rule(frozenset({HOST}), None),
        "toolmesh.v1.BridgeService/StartToolRequests": Rule(frozenset({HOST}), None),
        # Its first message names the host session, whose session the token must name.
        "toolmesh.v1.BridgeService/ExchangeHostWork": Rule(frozenset({HOST}), None),
    }
)

INTERNAL: frozenset[str] = frozenset(
    {
        # The invocation service's tool lookups and watches, and the bridge keeping
        # the tools its hosts declare in their sessions' lists.
        "toolmesh.v1.RegistryService/GetTool",
        "toolmesh.v1.RegistryService/WatchTools",
        "toolmesh.v1.RegistryService/ListTools",
        "toolmesh.v1.RegistryService/PutTools",
        # Runs any session's tool: only the invocation service may, after its checks.
        "toolmesh.v1.BridgeService/DispatchToolRequest",
        "toolmesh.v1.BridgeService/DispatchToolRequests",
    }
)
