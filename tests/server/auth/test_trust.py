"""Who may do what, over real servers with real certificates (trustme) and signed tokens.

Each test is an attack that worked before: it is now refused with a typed
error (an ErrorInfo reason of the error table), or at the TLS handshake.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import json
import os
import ssl
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import jwt
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2

from toolmesh.assembly.system import LocalSystem, start_local_system, start_registry
from toolmesh.assistant import AssistantError, ToolServices
from toolmesh.assistant.errors import TurnCode
from toolmesh.assistant.grpc_channel import GrpcToolChannel
from toolmesh.auth.grants import Role
from toolmesh.auth.service import SERVICE_TOKEN_HEADER
from toolmesh.auth.tokens import FailedAuthentications, JwksUrl, SharedSecret, Verifier
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.rpcstatus import error_code, error_info
from toolmesh.core.tools import ToolSpec
from toolmesh.host import HostError, ToolContext, ToolHost
from toolmesh.runtime.security import Security
from toolmesh.v1 import (
    bridge_pb2,
    bridge_pb2_grpc,
    invocation_pb2,
    invocation_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    tool_pb2,
)
from toolmesh_testing import SUPPORT, environment_without_settings, run_cli, start_host_process
from trust_testing import SECRET, Pki, rsa_jwk, token

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

VICTIM = "victim"
ATTACKER = "attacker"
OBJECT = '{"type":"object"}'
TOOLS = [ToolSpec("echo", "", OBJECT), ToolSpec("wait", "", OBJECT)]


@dataclass
class Secured:
    system: LocalSystem
    pki: Pki
    host: ToolHost
    release: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: asyncio.Event = field(default_factory=asyncio.Event)
    runs: list[str] = field(default_factory=list)

    def channel(self, target: str, *, client_cert: bool = False) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(target, self.pki.client_credentials(client_cert))

    def caller(self, session: str, **options: Any) -> InvocationClient:
        return InvocationClient(
            self.system.invocation_target,
            credentials=self.pki.client_credentials(),
            token=token(Role.CALL, session),
            **options,
        )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def secured(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Secured]:
    pki = Pki.make(tmp_path_factory.mktemp("pki"))
    system = await start_local_system(security=pki.server_security(), heartbeat_s=0.5)
    credentials = pki.client_credentials()
    host = ToolHost(system.bridge_target, VICTIM, credentials=credentials, token=token(Role.HOST, VICTIM))
    secured = Secured(system, pki, host)

    async def wait(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        secured.runs.append(ctx.tool_request_id)
        secured.waiting.set()
        await secured.release.wait()
        return {"waited": True}

    host.on_tool("echo", lambda args, ctx: args)
    host.on_tool("wait", wait)
    admin = token(Role.ADMIN, "*")
    async with RegistryClient(system.registry_target, credentials=credentials, token=admin) as registry:
        await registry.put_tools(VICTIM, TOOLS)
        await registry.put_tools(ATTACKER, TOOLS)
    await host.start(timeout=10)
    yield secured
    await host.stop()
    await system.stop(grace=0.5)


def metadata(role: Role | None, *sessions: str) -> tuple[tuple[str, str], ...]:
    return () if role is None else (("authorization", f"Bearer {token(role, *sessions)}"),)


async def failure(call: Any) -> grpc.aio.AioRpcError:
    """The error a unary call, or the first read of a stream, fails with."""
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        if hasattr(call, "read"):
            await asyncio.wait_for(call.read(), 10)
        else:
            await asyncio.wait_for(call, 10)
    return failed.value


def assert_refused(error: grpc.aio.AioRpcError, code: Code) -> None:
    assert error_code(error) is code, (error.code(), error.details())
    assert (
        error.code()
        is {
            Code.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
            Code.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
            Code.WRONG_LISTENER: grpc.StatusCode.PERMISSION_DENIED,
            Code.INVOCATION_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
            Code.HOST_SESSION_UNKNOWN: grpc.StatusCode.NOT_FOUND,
            Code.REQUEST_UNKNOWN: grpc.StatusCode.NOT_FOUND,
        }[code]
    )


# Each public RPC, made with the given metadata.
PUBLIC_CALLS: dict[str, tuple[str, Callable[[Any, Any], Any]]] = {
    "PutTools": (
        "registry",
        lambda s, md: s.PutTools(registry_pb2.PutToolsRequest(session_id=VICTIM), metadata=md),
    ),
    "ListTools": (
        "registry",
        lambda s, md: s.ListTools(registry_pb2.ListToolsRequest(session_id=VICTIM), metadata=md),
    ),
    "GetTool": (
        "registry",
        lambda s, md: s.GetTool(registry_pb2.GetToolRequest(session_id=VICTIM, name="echo"), metadata=md),
    ),
    "WatchTools": (
        "registry",
        lambda s, md: s.WatchTools(registry_pb2.WatchToolsRequest(session_id=VICTIM), metadata=md),
    ),
    "InvokeTool": (
        "invocation",
        lambda s, md: s.InvokeTool(
            invocation_pb2.InvokeToolRequest(
                session_id=VICTIM, turn_id="t", tool_name="echo", arguments_json="{}"
            ),
            metadata=md,
        ),
    ),
    "InvokeTools": ("invocation", lambda s, md: s.InvokeTools(iter([]), metadata=md)),
    "ConfirmDelivery": (
        "invocation",
        lambda s, md: s.ConfirmDelivery(
            invocation_pb2.ConfirmDeliveryRequest(tool_request_ids=["tr_x"]), metadata=md
        ),
    ),
    "GetInvocation": (
        "invocation",
        lambda s, md: s.GetInvocation(
            invocation_pb2.GetInvocationRequest(tool_request_id="tr_x"), metadata=md
        ),
    ),
    "CancelInvocation": (
        "invocation",
        lambda s, md: s.CancelInvocation(
            invocation_pb2.CancelInvocationRequest(tool_request_id="tr_x"), metadata=md
        ),
    ),
    "RunTool": (
        "invocation",
        lambda s, md: s.RunTool(
            invocation_pb2.RunToolRequest(
                call=invocation_pb2.InvokeToolRequest(
                    session_id=VICTIM, turn_id="t", tool_name="echo", arguments_json="{}"
                )
            ),
            metadata=md,
        ),
    ),
    "ReportToolProgress": (
        "bridge",
        lambda s, md: s.ReportToolProgress(
            bridge_pb2.ReportToolProgressRequest(host_session_id="hs_x", tool_request_id="tr_x"), metadata=md
        ),
    ),
    "StartToolRequests": (
        "bridge",
        lambda s, md: s.StartToolRequests(
            bridge_pb2.StartToolRequestsRequest(host_session_id="hs_x", tool_request_ids=["tr_x"]),
            metadata=md,
        ),
    ),
    "SubmitToolResults": (
        "bridge",
        lambda s, md: s.SubmitToolResults(
            bridge_pb2.SubmitToolResultsRequest(
                host_session_id="hs_x",
                results=[
                    bridge_pb2.SubmittedToolResult(
                        tool_request_id="tr_x", outcome=tool_pb2.ToolOutcome(result_json="{}")
                    )
                ],
            ),
            metadata=md,
        ),
    ),
    "ExchangeHostWork": (
        "bridge",
        lambda s, md: s.ExchangeHostWork(
            iter(
                [bridge_pb2.ExchangeHostWorkRequest(host_session_id="hs_x", start_tool_request_ids=["tr_x"])]
            ),
            metadata=md,
        ),
    ),
    "OpenHostSession": (
        "bridge",
        lambda s, md: s.OpenHostSession(bridge_pb2.OpenHostSessionRequest(session_id=VICTIM), metadata=md),
    ),
    "SubmitToolResult": (
        "bridge",
        lambda s, md: s.SubmitToolResult(
            bridge_pb2.SubmitToolResultRequest(
                host_session_id="hs_x", tool_request_id="tr_x", outcome=tool_pb2.ToolOutcome(result_json="{}")
            ),
            metadata=md,
        ),
    ),
}
STUBS = {
    "registry": registry_pb2_grpc.RegistryServiceStub,
    "invocation": invocation_pb2_grpc.InvocationServiceStub,
    "bridge": bridge_pb2_grpc.BridgeServiceStub,
}


@pytest.mark.parametrize("rpc", sorted(PUBLIC_CALLS))
async def test_every_public_rpc_without_a_valid_token_is_unauthenticated(secured: Secured, rpc: str) -> None:
    service, make_call = PUBLIC_CALLS[rpc]
    async with secured.channel(getattr(secured.system, f"{service}_target")) as channel:
        stub = STUBS[service](channel)
        forged = token(Role.ADMIN, "*", secret=b"x" * 40)
        expired = token(Role.ADMIN, "*", ttl_s=-120)
        for sent, reason in [
            ((), "missing"),
            ((("authorization", f"Bearer {forged}"),), "bad_signature"),
            ((("authorization", f"Bearer {expired}"),), "expired"),
            ((("authorization", "Basic dXNlcjpwYXNz"),), "malformed"),
        ]:
            error = await failure(make_call(stub, sent))
            assert_refused(error, Code.UNAUTHENTICATED)
            info = error_info(error)
            assert info is not None and info.metadata["reason"] == reason


async def test_a_host_token_for_another_session_cannot_serve_the_victims_session(secured: Secured) -> None:
    async with secured.channel(secured.system.bridge_target) as channel:
        stub = bridge_pb2_grpc.BridgeServiceStub(channel)
        request = bridge_pb2.OpenHostSessionRequest(session_id=VICTIM, host_name="attacker")
        assert_refused(
            await failure(stub.OpenHostSession(request, metadata=metadata(Role.HOST, ATTACKER))),
            Code.PERMISSION_DENIED,
        )
        # A caller's token is not a host's, even for the right session.
        assert_refused(
            await failure(stub.OpenHostSession(request, metadata=metadata(Role.CALL, VICTIM))),
            Code.PERMISSION_DENIED,
        )
    errors: list[HostError] = []
    impostor = ToolHost(
        secured.system.bridge_target,
        VICTIM,
        credentials=secured.pki.client_credentials(),
        token=token(Role.HOST, ATTACKER),
    )
    impostor.on_any(lambda args, ctx: pytest.fail("the impostor received a request"))
    impostor.on_error(errors.append)
    try:
        with pytest.raises(ToolmeshError) as refused:
            await impostor.start(timeout=10)
        assert refused.value.code is Code.PERMISSION_DENIED
        assert [error.code for error in errors] == [Code.PERMISSION_DENIED]
    finally:
        await impostor.stop()
    async with secured.caller(VICTIM) as client:
        result = await client.invoke(VICTIM, "echo", {"to": "the real host"}, turn_id="t")
    assert result.outcome is not None and result.outcome.result_json == '{"to":"the real host"}'


async def test_tools_are_put_by_an_admin_or_the_sessions_own_host_and_read_by_its_roles(
    secured: Secured,
) -> None:
    async with secured.channel(secured.system.registry_target) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        empty = registry_pb2.PutToolsRequest(session_id=VICTIM)
        for role, session in [(Role.CALL, VICTIM), (Role.HOST, ATTACKER), (Role.ADMIN, "team-*")]:
            error = await failure(stub.PutTools(empty, metadata=metadata(role, session)))
            assert_refused(error, Code.PERMISSION_DENIED)
        listed = await stub.ListTools(
            registry_pb2.ListToolsRequest(session_id=VICTIM), metadata=metadata(Role.CALL, VICTIM)
        )
        assert {tool.name for tool in listed.tools} == {"echo", "wait"}  # nothing was emptied
        # The session's own host declares one more tool; an admin puts the list back.
        more = [*listed.tools, tool_pb2.ToolDefinition(name="extra", input_schema_json=OBJECT)]
        for role, tools, revision in [
            (Role.HOST, more, listed.revision + 1),
            (Role.ADMIN, listed.tools, listed.revision + 2),
        ]:
            put = registry_pb2.PutToolsRequest(session_id=VICTIM, tools=tools)
            assert (await stub.PutTools(put, metadata=metadata(role, VICTIM))).revision == revision
        reads: list[Callable[[Any], Any]] = [
            lambda md: stub.ListTools(registry_pb2.ListToolsRequest(session_id=VICTIM), metadata=md),
            lambda md: stub.GetTool(registry_pb2.GetToolRequest(session_id=VICTIM, name="echo"), metadata=md),
            lambda md: stub.WatchTools(registry_pb2.WatchToolsRequest(session_id=VICTIM), metadata=md),
        ]
        for make_call in reads:
            assert_refused(await failure(make_call(metadata(Role.CALL, ATTACKER))), Code.PERMISSION_DENIED)


async def test_another_sessions_invocations_cannot_be_called_read_or_confirmed(secured: Secured) -> None:
    async with secured.caller(VICTIM) as victim, secured.caller(ATTACKER) as attacker:
        first = await victim.invoke(VICTIM, "echo", {"secret": 1}, turn_id="t", confirm_delivery=False)
        assert first.tool_request_id and first.outcome is not None
        with pytest.raises(grpc.aio.AioRpcError) as lookup:
            await attacker.get_invocation(first.tool_request_id)
        assert_refused(lookup.value, Code.INVOCATION_NOT_FOUND)  # not found, as for an unknown id
        assert await attacker.confirm_delivery(first.tool_request_id)  # accepted, and changes nothing
        with pytest.raises(grpc.aio.AioRpcError) as replay:
            await attacker.invoke(VICTIM, "echo", {"secret": 1}, turn_id="t")
        assert_refused(replay.value, Code.PERMISSION_DENIED)
        seen = await victim.get_invocation(first.tool_request_id)
        assert seen.session_id == VICTIM and not seen.delivered
        again = await victim.invoke(VICTIM, "echo", {"secret": 1}, turn_id="t")
        assert again.replayed and again.tool_request_id == first.tool_request_id


async def test_another_sessions_invocations_cannot_be_cancelled_run_or_reported_on(secured: Secured) -> None:
    async with (
        secured.caller(VICTIM) as victim,
        secured.caller(ATTACKER) as attacker,
        secured.channel(secured.system.bridge_target) as channel,
    ):
        secured.waiting.clear()
        started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        running = asyncio.ensure_future(
            victim.invoke(VICTIM, "wait", {"cancel": 1}, turn_id="t", on_started=started.set_result)
        )
        tool_request_id = await asyncio.wait_for(started, 10)
        await asyncio.wait_for(secured.waiting.wait(), 10)
        with pytest.raises(grpc.aio.AioRpcError) as cancel:
            await attacker.cancel_invocation(tool_request_id)
        assert_refused(cancel.value, Code.INVOCATION_NOT_FOUND)  # as for an unknown id: nothing stopped
        with pytest.raises(grpc.aio.AioRpcError) as run:
            await attacker.invoke(VICTIM, "echo", {}, turn_id="t", on_progress=lambda progress: None)
        assert_refused(run.value, Code.PERMISSION_DENIED)
        bridge = bridge_pb2_grpc.BridgeServiceStub(channel)
        report = bridge_pb2.ReportToolProgressRequest(
            host_session_id=secured.host.host_session_id, tool_request_id=tool_request_id, progress=1
        )
        foreign = await failure(bridge.ReportToolProgress(report, metadata=metadata(Role.HOST, ATTACKER)))
        assert_refused(foreign, Code.HOST_SESSION_UNKNOWN)
        start = bridge_pb2.StartToolRequestsRequest(
            host_session_id=secured.host.host_session_id, tool_request_ids=[tool_request_id]
        )
        foreign = await failure(bridge.StartToolRequests(start, metadata=metadata(Role.HOST, ATTACKER)))
        assert_refused(foreign, Code.HOST_SESSION_UNKNOWN)
        # A caller's token is not a host's, even for the right session.
        foreign = await failure(bridge.StartToolRequests(start, metadata=metadata(Role.CALL, VICTIM)))
        assert_refused(foreign, Code.PERMISSION_DENIED)
        results = bridge_pb2.SubmitToolResultsRequest(
            host_session_id=secured.host.host_session_id,
            results=[
                bridge_pb2.SubmittedToolResult(
                    tool_request_id=tool_request_id, outcome=tool_pb2.ToolOutcome(result_json='{"forged":1}')
                )
            ],
        )
        # Another session's host token: the victim's host session is unknown to it, result by result.
        (answer,) = (await bridge.SubmitToolResults(results, metadata=metadata(Role.HOST, ATTACKER))).answers
        assert answer.tool_request_id == tool_request_id
        assert answer.refusal.reason == Code.HOST_SESSION_UNKNOWN.value
        foreign = await failure(bridge.SubmitToolResults(results, metadata=metadata(Role.CALL, VICTIM)))
        assert_refused(foreign, Code.PERMISSION_DENIED)
        # Nor on the host work stream: another session's host session is unknown to it.
        asks = bridge_pb2.ExchangeHostWorkRequest(
            host_session_id=secured.host.host_session_id, start_tool_request_ids=[tool_request_id]
        )
        for role, session, code in [
            (Role.HOST, ATTACKER, Code.HOST_SESSION_UNKNOWN),
            (Role.CALL, VICTIM, Code.PERMISSION_DENIED),
        ]:
            exchange = bridge.ExchangeHostWork(iter([asks]), metadata=metadata(role, session))
            assert_refused(await failure(exchange), code)
        assert not running.done()
        # The victim's own token may cancel it.
        assert await victim.cancel_invocation(tool_request_id) is True
        cancelled = await asyncio.wait_for(running, 10)
    assert cancelled.outcome is not None and cancelled.outcome.code == Code.TOOL_CANCELLED


async def test_a_call_for_another_session_on_a_stream_is_refused_alone(secured: Secured) -> None:
    async with secured.caller(VICTIM) as victim, secured.caller(ATTACKER, multiplex=True) as attacker:
        secured.waiting.clear()
        running = asyncio.ensure_future(victim.invoke(VICTIM, "wait", {"n": 1}, turn_id="t"))
        await asyncio.wait_for(secured.waiting.wait(), 10)
        with pytest.raises(grpc.aio.AioRpcError) as joined:
            await attacker.invoke(VICTIM, "wait", {"n": 1}, turn_id="t")  # would join the victim's call
        assert_refused(joined.value, Code.PERMISSION_DENIED)
        own = await attacker.invoke(ATTACKER, "echo", {}, turn_id="t")  # the stream goes on
        assert own.outcome is not None and own.outcome.code == "TOOL_HOST_UNAVAILABLE"
        secured.release.set()
        finished = await asyncio.wait_for(running, 10)
        secured.release.clear()
    assert finished.outcome is not None and finished.outcome.ok and not finished.joined
    assert finished.tool_request_id is not None and secured.runs.count(finished.tool_request_id) == 1


async def test_a_host_cannot_submit_to_another_sessions_host_session(secured: Secured) -> None:
    async with secured.channel(secured.system.bridge_target) as channel:
        stub = bridge_pb2_grpc.BridgeServiceStub(channel)
        request = bridge_pb2.SubmitToolResultRequest(
            host_session_id=secured.host.host_session_id,
            tool_request_id="tr_forged",
            outcome=tool_pb2.ToolOutcome(result_json="{}"),
        )
        foreign = await failure(stub.SubmitToolResult(request, metadata=metadata(Role.HOST, ATTACKER)))
        assert_refused(foreign, Code.HOST_SESSION_UNKNOWN)
        own = await failure(stub.SubmitToolResult(request, metadata=metadata(Role.HOST, VICTIM)))
        assert_refused(own, Code.REQUEST_UNKNOWN)  # past authorization: the request id is what is wrong


async def test_internal_rpcs_are_served_only_on_the_internal_listener_to_services(
    secured: Secured,
) -> None:
    tool_request = bridge_pb2.ToolRequest(
        session_id="nobody",
        turn_id="t",
        tool_request_id="tr_internal",
        tool_name="echo",
        arguments_json="{}",
        timeout_ms=1000,
    )
    dispatch = bridge_pb2.DispatchToolRequestRequest(request=tool_request)
    async with secured.channel(secured.system.bridge_target) as channel:
        public = bridge_pb2_grpc.BridgeServiceStub(channel)
        for role in (Role.HOST, Role.ADMIN, Role.CALL):
            assert_refused(
                await failure(public.DispatchToolRequest(dispatch, metadata=metadata(role, "*"))),
                Code.WRONG_LISTENER,
            )
        stream = public.DispatchToolRequests(
            iter([bridge_pb2.DispatchToolRequestsRequest(requests=[tool_request])])
        )
        assert_refused(await failure(stream), Code.WRONG_LISTENER)
    internal = secured.system.bridge_internal_target
    async with secured.channel(internal) as channel:  # TLS, but no client certificate
        with pytest.raises(grpc.aio.AioRpcError) as handshake:
            await bridge_pb2_grpc.BridgeServiceStub(channel).DispatchToolRequest(dispatch, timeout=10)
        assert handshake.value.code() is grpc.StatusCode.UNAVAILABLE
    async with secured.channel(internal, client_cert=True) as channel:  # a tenant's certificate
        stub = bridge_pb2_grpc.BridgeServiceStub(channel)
        refused = await failure(stub.DispatchToolRequest(dispatch, metadata=metadata(Role.ADMIN, "*")))
        assert_refused(refused, Code.UNAUTHENTICATED)  # tests/server/auth/test_internal_listener.py
    service_token = secured.system.security.service_token
    assert service_token is not None
    service = secured.pki.files("server").channel_credentials()  # names the service identity
    async with grpc.aio.secure_channel(internal, service) as channel:
        stub = bridge_pb2_grpc.BridgeServiceStub(channel)
        as_service = ((SERVICE_TOKEN_HEADER, service_token),)
        response = await stub.DispatchToolRequest(dispatch, metadata=as_service, timeout=10)
        assert response.outcome.error.code == "TOOL_HOST_UNAVAILABLE"  # served: nobody hosts that session
        opened = stub.OpenHostSession(
            bridge_pb2.OpenHostSessionRequest(session_id=VICTIM), metadata=as_service
        )
        assert_refused(await failure(opened), Code.WRONG_LISTENER)


def reason(response: httpx.Response) -> str:
    """The ErrorInfo reason of a Connect error response."""
    (detail,) = response.json()["details"]
    info = error_details_pb2.ErrorInfo.FromString(base64.b64decode(detail["value"] + "=="))
    return info.reason


async def test_the_web_port_for_pages_applies_the_same_policy_over_https(secured: Secured) -> None:
    """Connect (JSON) calls of the host RPCs on the bridge's web port, as a page makes them."""
    url = secured.system.web_url
    assert url.startswith("https://")
    submit = {
        "hostSessionId": secured.host.host_session_id,
        "toolRequestId": "tr_web",
        "outcome": {"resultJson": "{}"},
    }
    async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(secured.pki.ca_file))) as web:

        async def call(method: str, body: dict[str, Any], role: Role | None, session: str = VICTIM) -> Any:
            headers = {"content-type": "application/json"}
            if role is not None:
                headers["authorization"] = f"Bearer {token(role, session)}"
            return await web.post(f"{url}/toolmesh.v1.BridgeService/{method}", json=body, headers=headers)

        missing = await call("SubmitToolResult", submit, None)
        assert missing.status_code == 401 and reason(missing) == Code.UNAUTHENTICATED
        foreign = await call("SubmitToolResult", submit, Role.HOST, ATTACKER)
        assert foreign.status_code == 404 and reason(foreign) == Code.HOST_SESSION_UNKNOWN
        declared = await call(
            "DeclareHostTools", {"hostSessionId": secured.host.host_session_id}, Role.HOST, ATTACKER
        )
        assert declared.status_code == 404 and reason(declared) == Code.HOST_SESSION_UNKNOWN
        own = await call("SubmitToolResult", submit, Role.HOST, VICTIM)
        assert own.status_code == 404 and reason(own) == Code.REQUEST_UNKNOWN  # past authorization
    async with httpx.AsyncClient() as plain:
        with pytest.raises(httpx.HTTPError):
            await plain.post(
                url.replace("https://", "http://") + "/toolmesh.v1.BridgeService/SubmitToolResult"
            )


async def test_a_plaintext_client_cannot_reach_a_tls_server(secured: Secured) -> None:
    async with grpc.aio.insecure_channel(secured.system.invocation_target) as channel:
        stub = invocation_pb2_grpc.InvocationServiceStub(channel)
        error = await failure(
            stub.GetInvocation(invocation_pb2.GetInvocationRequest(tool_request_id="tr_x"), timeout=10)
        )
    assert error.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_grant_lasts_one_call_only(secured: Secured) -> None:
    async with secured.channel(secured.system.registry_target) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        request = registry_pb2.ListToolsRequest(session_id=VICTIM)
        await stub.ListTools(request, metadata=metadata(Role.CALL, VICTIM))
        assert_refused(await failure(stub.ListTools(request)), Code.UNAUTHENTICATED)


async def test_a_token_callback_is_asked_before_each_call(secured: Secured) -> None:
    asked: list[int] = []

    async def fresh() -> str:
        asked.append(1)
        return token(Role.CALL, VICTIM)

    async with InvocationClient(
        secured.system.invocation_target, credentials=secured.pki.client_credentials(), token=fresh
    ) as client:
        for n in range(3):
            result = await client.invoke(VICTIM, "echo", {"n": n}, turn_id="t")
            assert result.outcome is not None and result.outcome.ok
    assert len(asked) >= 3


async def test_the_assistant_reads_tools_with_its_token_and_only_its_sessions(
    secured: Secured, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOOLMESH_TOKEN", token(Role.CALL, VICTIM))
    monkeypatch.setenv("TOOLMESH_TLS_CA", str(secured.pki.ca_file))
    services = ToolServices.from_env(secured.system.registry_target, secured.system.invocation_target)
    assert services.tls and services.token
    for session, allowed in [(VICTIM, True), (ATTACKER, False)]:
        channel = GrpcToolChannel(session, services)
        try:
            if allowed:
                assert {tool.name for tool in (await channel.list_tools()).tools} == {"echo", "wait"}
            else:
                with pytest.raises(AssistantError) as refused:
                    await channel.list_tools()
                assert refused.value.code is TurnCode.DISCOVERY_FAILED
                assert "PERMISSION_DENIED" in str(refused.value)
        finally:
            await channel.close()


def cli_env(secured: Secured, **extra: str) -> dict[str, str]:
    env = environment_without_settings()
    return (
        env
        | {
            "TOOLMESH_REGISTRY_ADDR": secured.system.registry_target,
            "TOOLMESH_INVOCATION_ADDR": secured.system.invocation_target,
            "TOOLMESH_BRIDGE_ADDR": secured.system.bridge_target,
            "TOOLMESH_TLS_CA": str(secured.pki.ca_file),
        }
        | extra
    )


async def test_the_cli_sends_a_minted_token_and_reports_refusals(secured: Secured) -> None:
    minting = {"TOOLMESH_AUTH_SECRET": SECRET.decode()}
    code, minted, _ = await run_cli(
        "token", "--role", "call", "--session", VICTIM, "--ttl", "5m", env=cli_env(secured, **minting)
    )
    assert code == 0
    code, out, err = await run_cli(
        "tools", "list", "--thread-id", VICTIM, env=cli_env(secured, TOOLMESH_TOKEN=minted.strip())
    )
    assert code == 0, err
    assert '"echo"' in out
    code, _, err = await run_cli("tools", "list", "--thread-id", VICTIM, env=cli_env(secured))
    assert code == 2 and '"UNAUTHENTICATED"' in err
    code, out, err = await run_cli(
        "tool-call",
        "--thread-id",
        ATTACKER,
        "--tool",
        "echo",
        "--token",
        minted.strip(),
        env=cli_env(secured),
    )
    assert code == 2 and '"PERMISSION_DENIED"' in err, (out, err)
    code, out, err = await run_cli(
        "host",
        "--thread-id",
        VICTIM,
        "--handlers",
        "e2e_handlers:HANDLERS",
        "--token",
        token(Role.HOST, ATTACKER),
        env=cli_env(secured),
    )
    assert code == 2 and "PERMISSION_DENIED" in err, (out, err)


async def test_a_cli_host_and_a_cli_call_with_their_tokens_over_tls(secured: Secured, tmp_path: Path) -> None:
    session = "cli-session"
    admin = token(Role.ADMIN, session)
    async with RegistryClient(
        secured.system.registry_target, credentials=secured.pki.client_credentials(), token=admin
    ) as registry:
        await registry.put_tools(session, [ToolSpec("echo", "", OBJECT)])
    host_env = cli_env(secured, TOOLMESH_TOKEN=token(Role.HOST, session))
    host = await start_host_process(
        secured.system.bridge_target, session, "e2e_handlers:HANDLERS", tmp_path, host_env
    )
    try:
        code, out, err = await run_cli(
            "tool-call",
            "--thread-id",
            session,
            "--tool",
            "echo",
            "--args",
            '{"over": "tls"}',
            env=cli_env(secured, TOOLMESH_TOKEN=token(Role.CALL, session)),
        )
    finally:
        assert await host.stop() == 0
    assert code == 0, err
    assert json.loads(out)["result"]["echo"] == {"over": "tls"}


async def test_rotated_certificates_reach_new_connections(tmp_path: Path) -> None:
    first, second = Pki.make(tmp_path / "first"), Pki.make(tmp_path / "second")
    served = first.files("server")
    registry = await start_registry(security=Security(served))
    target = f"127.0.0.1:{registry.port}"

    async def lists_with(pki: Pki) -> bool:
        async with grpc.aio.secure_channel(target, pki.client_credentials()) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            try:
                await stub.ListTools(registry_pb2.ListToolsRequest(session_id="s"), timeout=10)
            except grpc.aio.AioRpcError as error:
                assert error.code() is grpc.StatusCode.UNAVAILABLE
                return False
            return True

    try:
        assert await lists_with(first) and not await lists_with(second)
        rotated = second.files("server")
        assert served.cert and served.key and rotated.cert and rotated.key
        served.cert.write_bytes(rotated.cert.read_bytes())
        served.key.write_bytes(rotated.key.read_bytes())
        for path in (served.cert, served.key):
            stamp = path.stat().st_mtime_ns + 1_000_000_000  # a later time, however coarse the clock
            os.utime(path, ns=(stamp, stamp))
        assert await lists_with(second) and not await lists_with(first)
    finally:
        await registry.stop(0)


async def test_listeners_off_loopback_without_protection_are_refused_at_startup(tmp_path: Path) -> None:
    for args in (
        ["-m", "toolmesh.bridge", "--listen", "0.0.0.0:0", "--internal-listen", "127.0.0.1:0"],
        ["-m", "toolmesh.bridge", "--listen", "127.0.0.1:0", "--internal-listen", "0.0.0.0:0"],
        ["-m", "toolmesh.cli.main", "up", "--host", "0.0.0.0"],
    ):
        process = await asyncio.create_subprocess_exec(
            sys.executable, *args, cwd=SUPPORT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        _, err = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 2, err
        assert b"refusing to serve" in err and b"--insecure" in err


@contextlib.contextmanager
def https_jwks(pki: Pki, document: dict[str, Any]) -> Iterator[str]:
    """A real HTTPS server on loopback serving one JWKS document."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(document).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    files = pki.files("server")
    assert files.cert is not None and files.key is not None
    context.load_cert_chain(files.cert, files.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/jwks.json"
    finally:
        server.shutdown()
        server.server_close()


async def test_jwks_url_keys_are_fetched_off_the_loop(tmp_path: Path) -> None:
    pki = Pki.make(tmp_path)
    private, jwk = rsa_jwk("k1")
    with https_jwks(pki, {"keys": [jwk]}) as url:
        trust = ssl.create_default_context(cafile=str(pki.ca_file))
        checking = Verifier(JwksUrl(url, ssl_context=trust))
        claims = {"iss": "toolmesh", "aud": "toolmesh", "exp": time.time() + 60, "sub": "idp-user"}
        token = jwt.encode(
            claims | {"roles": ["host"], "sessions": ["h"]}, private, algorithm="RS256", headers={"kid": "k1"}
        )
        grant = await asyncio.wait_for(checking.grant(token), 10)
        assert grant.roles == {Role.HOST}


async def test_failed_authentications_are_throttled_per_address_before_any_signature(tmp_path: Path) -> None:
    """Finding 11: invalid tokens at a high rate cost a signature check each. Past its failures, an
    address is refused AUTH_THROTTLED (RESOURCE_EXHAUSTED, RetryInfo) first; a verified token is not."""
    checks: list[str] = []

    class Counted(SharedSecret):
        async def key_for(self, token: str) -> tuple[Any, tuple[str, ...]]:
            checks.append(token)
            return await super().key_for(token)

    verifier = Verifier(Counted(SECRET), failures=FailedAuthentications(burst=3, per_s=0.01))
    system = await start_local_system(security=Security(verifier=verifier))
    good = token(Role.CALL, "s")
    forged = token(Role.CALL, "s", secret=b"x" * 40)
    try:
        async with grpc.aio.insecure_channel(system.registry_target) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)

            def list_tools(bearer: str) -> Any:
                return stub.ListTools(
                    registry_pb2.ListToolsRequest(session_id="s"),
                    metadata=(("authorization", f"Bearer {bearer}"),),
                )

            await list_tools(good)  # verified, and cached
            for _ in range(3):
                assert_refused(await failure(list_tools(forged)), Code.UNAUTHENTICATED)
            verified = len(checks)
            throttled = await failure(list_tools(forged))
            assert error_code(throttled) is Code.AUTH_THROTTLED
            assert throttled.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(checks) == verified  # refused before any signature check
            await list_tools(good)  # a token verified before still passes
    finally:
        await system.stop(0)
