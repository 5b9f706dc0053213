"""The internal listeners admit toolmesh services only: the attacks that worked, replayed on real ports.

Before, an internal listener checked no token and took any certificate the CA
signed: a local process without a token (tokens on, no TLS), or a tenant with
its own client certificate (mutual TLS), ran a victim's tool through
DispatchToolRequest (no schema, ledger or quota) and replaced its tool list
with PutTools. Each is now refused with a typed error; the services' own
credential still works, and so do ordinary calls through the public ports.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.auth.grants import Role
from toolmesh.auth.service import SERVICE_TOKEN_HEADER
from toolmesh.auth.tokens import SharedSecret, Verifier
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code, error_info
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolContext, ToolHost
from toolmesh.runtime.security import Security
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, registry_pb2, registry_pb2_grpc
from toolmesh_testing import (
    SUPPORT,
    environment_without_settings,
    refused_start,
    start_service_process,
    toolmesh_command,
)
from trust_testing import SECRET, SERVICE_TOKEN, SERVICE_URI, Pki, token

pytestmark = pytest.mark.integration

VICTIM = "victim"
OBJECT = '{"type":"object"}'
TOOLS = [ToolSpec("charge", "", OBJECT)]


@dataclass
class Victim:
    """A system, a host of VICTIM's `charge` (not idempotent: each run counted), and how to reach it."""

    system: LocalSystem
    credentials: grpc.ChannelCredentials | None
    runs: list[str] = field(default_factory=list)

    def channel(self, target: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
        credentials = credentials or self.credentials
        if credentials is None:
            return grpc.aio.insecure_channel(target)
        return grpc.aio.secure_channel(target, credentials)


async def start_victim(security: Security, credentials: grpc.ChannelCredentials | None) -> Victim:
    system = await start_local_system(security=security, heartbeat_s=0.5)
    victim = Victim(system, credentials)
    admin = token(Role.ADMIN, VICTIM) if security.verifier else None
    async with RegistryClient(system.registry_target, credentials=credentials, token=admin) as registry:
        await registry.put_tools(VICTIM, TOOLS)
    return victim


async def hosting(victim: Victim, security: Security) -> ToolHost:
    host_token = token(Role.HOST, VICTIM) if security.verifier else None
    host = ToolHost(victim.system.bridge_target, VICTIM, credentials=victim.credentials, token=host_token)

    def charge(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        victim.runs.append(ctx.tool_request_id)
        return {"charged": True}

    host.on_tool("charge", charge)
    await host.start(timeout=10)
    return host


def dispatch_request(request_id: str) -> bridge_pb2.DispatchToolRequestRequest:
    return bridge_pb2.DispatchToolRequestRequest(
        request=bridge_pb2.ToolRequest(
            session_id=VICTIM,
            turn_id="t",
            tool_request_id=request_id,
            tool_name="charge",
            arguments_json="{}",
            timeout_ms=5000,
        )
    )


PUT_EMPTY = registry_pb2.PutToolsRequest(session_id=VICTIM)

Metadata = tuple[tuple[str, str], ...]


async def attack(victim: Victim, metadata: Metadata, credentials: Any = None) -> list[grpc.aio.AioRpcError]:
    """Every internal RPC an attacker wants, with `metadata`: the errors they failed with."""
    failures: list[grpc.aio.AioRpcError] = []

    async def failed(call: Callable[[], Any]) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            result = call()
            if hasattr(result, "read"):
                await asyncio.wait_for(result.read(), 10)
            else:
                await asyncio.wait_for(result, 10)
        failures.append(refused.value)

    async with victim.channel(victim.system.bridge_internal_target, credentials) as channel:
        bridge = bridge_pb2_grpc.BridgeServiceStub(channel)
        await failed(lambda: bridge.DispatchToolRequest(dispatch_request("tr_attack"), metadata=metadata))
        batch = bridge_pb2.DispatchToolRequestsRequest(requests=[dispatch_request("tr_attack2").request])
        await failed(lambda: bridge.DispatchToolRequests(iter([batch]), metadata=metadata))
    async with victim.channel(victim.system.registry_internal_target, credentials) as channel:
        registry = registry_pb2_grpc.RegistryServiceStub(channel)
        await failed(lambda: registry.PutTools(PUT_EMPTY, metadata=metadata))
        await failed(
            lambda: registry.ListTools(registry_pb2.ListToolsRequest(session_id=VICTIM), metadata=metadata)
        )
        watch = registry_pb2_grpc.RegistryServiceStub(channel).WatchTools(
            registry_pb2.WatchToolsRequest(session_id=VICTIM), metadata=metadata
        )
        await failed(lambda: watch)
    return failures


def assert_typed(failures: list[grpc.aio.AioRpcError], code: Code, reason: str) -> None:
    assert len(failures) == 5
    for failure in failures:
        assert error_code(failure) is code, (failure.code(), failure.details())
        expected = (
            grpc.StatusCode.UNAUTHENTICATED
            if code is Code.UNAUTHENTICATED
            else grpc.StatusCode.PERMISSION_DENIED
        )
        assert failure.code() is expected
        info = error_info(failure)
        assert info is not None and info.metadata["reason"] == reason


async def assert_untouched(
    victim: Victim, credentials: grpc.ChannelCredentials | None, admin: str | None
) -> None:
    async with RegistryClient(
        victim.system.registry_target, credentials=credentials, token=admin
    ) as registry:
        assert [tool.name for tool in (await registry.list_tools(VICTIM)).tools] == ["charge"]
    assert victim.runs == []


async def served_for_the_service(victim: Victim, metadata: Metadata, credentials: Any = None) -> None:
    """The services' own credential: Dispatch runs the tool, PutTools replaces the list."""
    async with victim.channel(victim.system.bridge_internal_target, credentials) as channel:
        bridge = bridge_pb2_grpc.BridgeServiceStub(channel)
        response = await bridge.DispatchToolRequest(
            dispatch_request("tr_service"), metadata=metadata, timeout=10
        )
        assert json.loads(response.outcome.result_json) == {"charged": True}
    assert victim.runs == ["tr_service"]
    async with victim.channel(victim.system.registry_internal_target, credentials) as channel:
        registry = registry_pb2_grpc.RegistryServiceStub(channel)
        listed = await registry.ListTools(registry_pb2.ListToolsRequest(session_id=VICTIM), metadata=metadata)
        put = registry_pb2.PutToolsRequest(session_id=VICTIM, tools=list(listed.tools))
        await registry.PutTools(put, metadata=metadata, timeout=10)


async def invoke_publicly(victim: Victim, call_token: str | None) -> None:
    """A caller on the public port: the services reach each other's internal listeners themselves."""
    async with InvocationClient(
        victim.system.invocation_target, credentials=victim.credentials, token=call_token
    ) as client:
        called = await client.invoke(VICTIM, "charge", {}, turn_id="public")
        assert called.outcome is not None and called.outcome.ok, called


@pytest.fixture
async def with_tokens() -> AsyncIterator[tuple[Victim, ToolHost]]:
    """The README's "every call needs a token": a secret, no TLS, `toolmesh up`'s generated service token."""
    security = Security(verifier=Verifier(SharedSecret(SECRET)))
    victim = await start_victim(security, None)
    host = await hosting(victim, security)
    yield victim, host
    await host.stop()
    await victim.system.stop(0.5)


async def test_secret_without_tls_refuses_callers_without_the_service_token(
    with_tokens: tuple[Victim, ToolHost],
) -> None:
    victim, _ = with_tokens
    assert victim.system.security.service_token is not None  # generated for this process
    # A local process with no token at all.
    assert_typed(await attack(victim, ()), Code.UNAUTHENTICATED, "service_token_missing")
    # A tenant with a valid token for every session and role: it counts for nothing here.
    for role in (Role.ADMIN, Role.HOST, Role.CALL):
        tenant = (("authorization", f"Bearer {token(role, '*')}"),)
        assert_typed(await attack(victim, tenant), Code.UNAUTHENTICATED, "service_token_missing")
    # A guessed service token.
    guessed = ((SERVICE_TOKEN_HEADER, "x" * 43),)
    assert_typed(await attack(victim, guessed), Code.UNAUTHENTICATED, "service_token_wrong")
    await assert_untouched(victim, None, token(Role.ADMIN, VICTIM))

    await served_for_the_service(victim, ((SERVICE_TOKEN_HEADER, victim.system.security.service_token),))
    victim.runs.clear()
    await invoke_publicly(victim, token(Role.CALL, VICTIM))
    assert len(victim.runs) == 1


@pytest.fixture
async def with_mutual_tls(tmp_path: Path) -> AsyncIterator[tuple[Victim, ToolHost, Pki]]:
    """Mutual TLS from one CA, no tokens: the certificate alone says who is a service."""
    pki = Pki.make(tmp_path)
    security = Security(pki.files("server"))
    victim = await start_victim(security, pki.client_credentials())
    host = await hosting(victim, security)
    yield victim, host, pki
    await host.stop()
    await victim.system.stop(0.5)


async def test_mutual_tls_refuses_tenant_certificates_without_the_service_identity(
    with_mutual_tls: tuple[Victim, ToolHost, Pki],
) -> None:
    victim, _, pki = with_mutual_tls
    # The CLI's --tls-cert: a tenant's client certificate from the same CA.
    tenant = pki.client_credentials(with_certificate=True)
    assert_typed(await attack(victim, (), tenant), Code.PERMISSION_DENIED, "not_a_service")
    # A certificate naming some other URI (not under spiffe://toolmesh/service/).
    other = pki.issue("other", "other.toolmesh.test", uris=["spiffe://tenant/service/bridge"])
    assert_typed(
        await attack(victim, (), other.channel_credentials()), Code.PERMISSION_DENIED, "not_a_service"
    )
    await assert_untouched(victim, victim.credentials, None)

    service = pki.issue("service", "service.toolmesh.test", uris=[SERVICE_URI]).channel_credentials()
    await served_for_the_service(victim, (), service)
    victim.runs.clear()
    await invoke_publicly(victim, None)
    assert len(victim.runs) == 1


async def test_mutual_tls_and_tokens_need_the_certificate_and_the_service_token(tmp_path: Path) -> None:
    pki = Pki.make(tmp_path)
    security = pki.server_security()
    victim = await start_victim(security, pki.client_credentials())
    try:
        service_token = victim.system.security.service_token
        assert service_token is not None
        tenant = pki.client_credentials(with_certificate=True)
        # A tenant's certificate, even with the service token, is not a service.
        with_token = ((SERVICE_TOKEN_HEADER, service_token),)
        assert_typed(await attack(victim, with_token, tenant), Code.PERMISSION_DENIED, "not_a_service")
        service = pki.files("server").channel_credentials()
        assert_typed(await attack(victim, (), service), Code.UNAUTHENTICATED, "service_token_missing")
        await served_for_the_service_without_host(victim, with_token, service)
    finally:
        await victim.system.stop(0.5)


async def served_for_the_service_without_host(victim: Victim, metadata: Metadata, credentials: Any) -> None:
    async with victim.channel(victim.system.bridge_internal_target, credentials) as channel:
        bridge = bridge_pb2_grpc.BridgeServiceStub(channel)
        response = await bridge.DispatchToolRequest(
            dispatch_request("tr_nohost"), metadata=metadata, timeout=10
        )
        assert response.outcome.error.code == "TOOL_HOST_UNAVAILABLE"  # served: nobody hosts it


async def test_separate_processes_share_a_configured_service_token(tmp_path: Path) -> None:
    clean = environment_without_settings()
    secret_env = clean | {"TOOLMESH_AUTH_SECRET": SECRET.decode()}
    # Tokens on, no TLS, no service token: the internal listener would admit anyone; it does not start.
    code, err = await refused_start("registry", env=secret_env)
    assert code == 2, err
    assert "service credential" in err and "--service-token-file" in err

    token_file = tmp_path / "service-token"
    token_file.write_text(SERVICE_TOKEN + "\n")
    registry = await start_service_process(
        "registry", "--service-token-file", str(token_file), env=secret_env
    )
    try:
        assert registry.internal_port is not None
        target = f"127.0.0.1:{registry.internal_port}"
        async with grpc.aio.insecure_channel(target) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.PutTools(PUT_EMPTY, timeout=10)
            assert error_code(refused.value) is Code.UNAUTHENTICATED
            await stub.PutTools(PUT_EMPTY, metadata=((SERVICE_TOKEN_HEADER, SERVICE_TOKEN),), timeout=10)
        assert SERVICE_TOKEN not in "".join(registry.output)
    finally:
        await registry.stop()


async def test_up_says_what_guards_its_internal_ports() -> None:
    clean = environment_without_settings()
    ports = [f"--{name}-port" for name in ("registry", "invocation", "bridge", "web")]
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        "up",
        *(item for port in ports for item in (port, "0")),
        env=clean | {"TOOLMESH_AUTH_SECRET": SECRET.decode()},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=SUPPORT,
    )
    assert process.stdout is not None
    try:
        lines: list[str] = []
        while not lines or not lines[-1].startswith("Press Ctrl-C"):
            lines.append((await asyncio.wait_for(process.stdout.readline(), 20)).decode())
        (internal,) = [line for line in lines if line.split()[0] == "internal"]
        assert "services only: guarded by a service token generated for this process" in internal
        registry_internal = internal.split()[1].rstrip(",")
        async with grpc.aio.insecure_channel(registry_internal) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            admin = (("authorization", f"Bearer {token(Role.ADMIN, '*')}"),)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.PutTools(PUT_EMPTY, metadata=admin, timeout=10)
            assert error_code(refused.value) is Code.UNAUTHENTICATED
    finally:
        process.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), 15) == 0
