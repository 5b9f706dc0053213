"""Limits: each one refused with a typed error naming it, quotas that come back, settings refused at startup.

A caller over a limit gets LIMIT_EXCEEDED (INVALID_ARGUMENT) or QUOTA_EXCEEDED
(RESOURCE_EXHAUSTED, with RetryInfo), ErrorInfo naming the limit and its
value and never the offending content; everyone else goes on as before.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Any

import grpc
import pytest

from limits_testing import SilentHost, limits, status_of, system_with, tool
from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import start_local_system, start_replicas
from toolmesh.auth.grants import Role
from toolmesh.auth.tokens import SharedSecret, Verifier, mint
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.rpcstatus import error_code, retry_delay_s
from toolmesh.core.tools import ToolSpec
from toolmesh.invocation.quotas import LEASE_GRACE_S, Quotas
from toolmesh.invocation.validation import Validation
from toolmesh.registry.registry import encode_tools as registry_record
from toolmesh.rules.limits import DEFAULT_LIMITS, ENV_LIMITS, NAMES, Limits, limits_from
from toolmesh.rules.schema_cost import CYCLE_RULE, PATTERN_RULE, check_schema
from toolmesh.runtime.security import Security
from toolmesh.store.backends import open_stores
from toolmesh.store.ledger import LeaseTerms
from toolmesh.store.memory import InMemoryStore
from toolmesh.v1 import (
    bridge_pb2_grpc,
    invocation_pb2,
    invocation_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)
from toolmesh_testing import REPO, eventually, refused_start, run_cli
from trust_testing import SECRET


def nested_any_of(depth: int) -> str:
    """anyOf nested `depth` deep through $defs: small text, 2**depth subschema visits per value."""
    defs: dict[str, Any] = {
        f"a{level}": {
            "anyOf": [
                {"type": "array", "items": {"$ref": f"#/$defs/a{level + 1}"}},
                {"type": "array", "items": {"$ref": f"#/$defs/a{level + 1}"}},
            ]
        }
        for level in range(depth)
    }
    defs[f"a{depth}"] = {"type": "integer"}
    return json.dumps({"type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}, "$defs": defs})


def nested_arrays(depth: int) -> Any:
    value: Any = "not an integer"
    for _ in range(depth):
        value = [value]
    return value


def refused_by(error: ToolmeshError, code: Code, limit: str) -> ToolmeshError:
    assert error.code is code
    assert error.metadata["limit"] == limit
    assert "value" in error.metadata
    return error


# Settings ---------------------------------------------------------------------------------------


@pytest.mark.unit
def test_every_limit_is_in_the_docs_table_with_its_default() -> None:
    page = (REPO / "docs" / "operations" / "limits.md").read_text()
    table = page.split("Where each quota is counted", 1)[0]
    documented: dict[str, str] = {}
    for row in table.splitlines():
        if row.startswith("| `"):
            cells = [cell.strip() for cell in row.strip("|").split("|")]
            names = re.findall(r"^`(\w+)`|, `(\w+)`", cells[0])
            for pair in names:
                documented["".join(pair)] = cells[1] if len(names) == 1 else ""
    assert set(NAMES) <= set(documented), set(NAMES) - set(documented)
    for name in NAMES:
        if documented[name]:
            assert documented[name] == f"{getattr(DEFAULT_LIMITS, name):,}", name


@pytest.mark.unit
def test_settings_come_from_the_environment_and_flags_win() -> None:
    settings = limits_from(
        ["tools_per_session=7", "schema-depth=9"],
        {ENV_LIMITS: "tools_per_session=3, calls_in_flight_per_session=5"},
    )
    assert (settings.tools_per_session, settings.schema_depth, settings.calls_in_flight_per_session) == (
        7,
        9,
        5,
    )
    assert limits_from([], {}) == DEFAULT_LIMITS


@pytest.mark.unit
@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("tools_per_sesion=3", "unknown limit"),
        ("tools_per_session", "not name=value"),
        ("tools_per_session=many", "whole number"),
        ("tools_per_session=0", "at least 1"),
        ("tools_per_session=-4", "at least 1"),
        ("message_bytes=1.5", "whole number"),
    ],
)
def test_bad_settings_are_refused(setting: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        limits_from([setting], {})
    with pytest.raises(ValueError, match=needle):
        limits_from([], {ENV_LIMITS: f"schema_depth=4,{setting}"})


@pytest.mark.integration
async def test_a_service_with_an_unknown_limit_does_not_start() -> None:
    env = {**os.environ, ENV_LIMITS: "tools_per_session=5"}
    code, stderr = await refused_start("registry", "--limit", "no_such_limit=3", env=env)
    assert code == 2
    assert "unknown limit 'no_such_limit'" in stderr


@pytest.mark.integration
async def test_toolmesh_up_refuses_a_bad_limit_from_the_environment() -> None:
    env = {**os.environ, ENV_LIMITS: "schema_depth=deep"}
    code, _, stderr = await run_cli("up", "--registry-port", "0", "--invocation-port", "0", env=env)
    assert code == 2
    assert "schema_depth must be a whole number" in stderr


# Hostile schemas, refused at registration ---------------------------------------------------------


def _check(schema: str, settings: Limits = DEFAULT_LIMITS) -> None:
    check_schema(schema, settings, tool="t", which="inputSchema", require_object=True)


@pytest.mark.unit
def test_nested_any_of_is_refused_for_its_expansion() -> None:
    with pytest.raises(ToolmeshError) as raised:
        _check(nested_any_of(20))
    refused_by(raised.value, Code.LIMIT_EXCEEDED, "schema_expansion")
    assert raised.value.metadata["value"] == "10000"
    assert raised.value.status.name == "INVALID_ARGUMENT" and not raised.value.retryable
    _check(nested_any_of(8))  # 2**8 visits: within the default


@pytest.mark.unit
def test_a_ref_cycle_is_refused() -> None:
    schema = {
        "type": "object",
        "properties": {"node": {"$ref": "#/$defs/node"}},
        "$defs": {"node": {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}},
    }
    with pytest.raises(ToolmeshError) as raised:
        _check(json.dumps(schema))
    refused_by(raised.value, Code.LIMIT_EXCEEDED, CYCLE_RULE)


@pytest.mark.unit
@pytest.mark.parametrize("pattern", ["^(?=a)(a+)+$", "(a+)\\1", "(?<!x)y", "a{1000}{1000}"])
def test_a_pattern_the_linear_engine_cannot_take_is_refused(pattern: str) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    with pytest.raises(ToolmeshError) as raised:
        _check(json.dumps(schema))
    refused_by(raised.value, Code.LIMIT_EXCEEDED, PATTERN_RULE)
    assert raised.value.metadata["at"] == "/properties/s/pattern"
    # Nested quantifiers alone are fine: the engine matches them in linear time.
    _check(json.dumps({"type": "object", "properties": {"s": {"pattern": "^(a+)+$"}}}))


@pytest.mark.unit
def test_depth_and_size_are_refused() -> None:
    deep: Any = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"d": deep}}
    with pytest.raises(ToolmeshError) as raised:
        _check(json.dumps(deep))
    refused_by(raised.value, Code.LIMIT_EXCEEDED, "schema_depth")
    big = json.dumps({"type": "object", "description": "x" * 2000})
    with pytest.raises(ToolmeshError) as raised:
        _check(big, limits(schema_bytes=1000))
    refused_by(raised.value, Code.LIMIT_EXCEEDED, "schema_bytes")
    assert "x" * 20 not in raised.value.message


@pytest.mark.unit
def test_a_ref_outside_pointers_and_anchors_is_invalid() -> None:
    schema = {"$id": "https://example.test/s", "type": "object", "properties": {"a": {"$ref": "s#/$defs/x"}}}
    with pytest.raises(ToolmeshError) as raised:
        _check(json.dumps({**schema, "$defs": {"x": {"type": "string"}}}))
    assert raised.value.code is Code.INVALID_SCHEMA


# Hostile arguments, bounded ---------------------------------------------------------------------


@pytest.mark.integration
async def test_a_validation_over_its_time_bound_ends_that_call_only() -> None:
    validation = Validation(limits(validation_timeout_ms=300, validation_workers=1))
    hostile = ToolSpec("hostile", "", nested_any_of(24))
    plain = ToolSpec("plain", "", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}))
    try:
        arguments = {"x": nested_arrays(24)}
        outcome = await validation.arguments(hostile, arguments, json.dumps(arguments))
        assert outcome is not None and outcome.failure is not None
        assert outcome.failure.code == Code.TOOL_ARGS_INVALID
        assert outcome.failure.details == {
            "reason": "validation_time_limit",
            "limit": "validation_timeout_ms",
            "value": "300",
        }
        # The worker was replaced: a costly validation that fits its bound still runs there.
        small = {"x": nested_arrays(3)}
        answered = await validation.arguments(hostile, small, json.dumps(small))
        assert answered is not None and answered.failure is not None
        assert answered.failure.details is not None and answered.failure.details["reason"] == "schema"
        assert await validation.arguments(plain, {"n": 1}, '{"n": 1}') is None
    finally:
        await validation.aclose()


@pytest.mark.integration
async def test_a_validation_over_its_memory_bound_ends_that_call_only() -> None:
    settings = limits(validation_memory_bytes=400 * 2**20, validation_timeout_ms=60_000, validation_workers=1)
    validation = Validation(settings)
    hostile = ToolSpec("hostile", "", nested_any_of(21))  # listing its errors takes gigabytes
    plain = ToolSpec("plain", "", json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))
    try:
        arguments = {"x": nested_arrays(21)}
        outcome = await validation.arguments(hostile, arguments, json.dumps(arguments))
        assert outcome is not None and outcome.failure is not None
        assert outcome.failure.details == {
            "reason": "validation_memory_limit",
            "limit": "validation_memory_bytes",
            "value": str(400 * 2**20),
        }
        large = {"a": "x" * 5000}  # over the inline size: validated by the replacement worker
        assert await validation.arguments(plain, large, json.dumps(large)) is None
    finally:
        await validation.aclose()


# Quotas -----------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_rate_per_caller_refuses_past_its_burst_and_recovers() -> None:
    now = [100.0]
    quotas = Quotas(None, limits(calls_per_second_per_caller=2, calls_burst_per_caller=3), lambda: now[0])
    for _ in range(3):
        quotas.take_call("alice")
    with pytest.raises(ToolmeshError) as raised:
        quotas.take_call("alice")
    refused_by(raised.value, Code.QUOTA_EXCEEDED, "calls_per_second_per_caller")
    assert raised.value.retryable and raised.value.retry_delay_s == pytest.approx(0.5)
    assert raised.value.metadata["retryDelayMs"] == "500"
    quotas.take_call("bob")  # another caller has its own bucket
    for _ in range(10):
        quotas.take_call(None)  # without authentication nobody is counted
    now[0] += 0.5
    quotas.take_call("alice")


@pytest.mark.unit
def test_calls_in_flight_per_session_are_leases_that_outlive_the_deadline() -> None:
    """The claim takes the place on these terms (tests/server/contracts/test_ledger_domain.py: taken, refused,
    given back); refused, the call gets QUOTA_EXCEEDED."""
    quotas = Quotas(InMemoryStore(), limits(calls_in_flight_per_session=1))
    lease = quotas.in_flight("s", 1000)
    assert lease.terms == LeaseTerms("quota:in_flight:s", 1, 1.0 + LEASE_GRACE_S)
    refused_by(lease.refused(), Code.QUOTA_EXCEEDED, "calls_in_flight_per_session")
    assert Quotas(None).in_flight("s", 1000).terms is None  # no store: not counted


# Over real servers ------------------------------------------------------------------------------


@pytest.mark.integration
async def test_the_registry_refuses_what_is_over_its_limits() -> None:
    settings = limits(tools_per_session=3, registry_bytes_per_session=4000)
    async with system_with(settings) as system, grpc.aio.insecure_channel(system.registry_target) as channel:
        registry = registry_pb2_grpc.RegistryServiceStub(channel)
        attempts = {
            "tools_per_session": [tool(f"t{n}") for n in range(4)],
            "registry_bytes_per_session": [
                tool(f"t{n}", json.dumps({"type": "object", "description": "d" * 1500})) for n in range(3)
            ],
            "schema_expansion": [tool("hostile", nested_any_of(20))],
            PATTERN_RULE: [
                tool("p", json.dumps({"type": "object", "properties": {"s": {"pattern": "(?=a)"}}}))
            ],
        }
        for limit, tools in attempts.items():
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await registry.PutTools(registry_pb2.PutToolsRequest(session_id="over", tools=tools))
            status, code, metadata = status_of(raised)
            assert (status, code, metadata["limit"]) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                Code.LIMIT_EXCEEDED,
                limit,
            )
            assert metadata["value"] == str(getattr(settings, limit, metadata["value"]))
            assert "ddd" not in (raised.value.details() or "")
        # Nothing of it was kept, and another session registers as before.
        listed = await registry.ListTools(registry_pb2.ListToolsRequest(session_id="over"))
        assert list(listed.tools) == []
        await registry.PutTools(registry_pb2.PutToolsRequest(session_id="fine", tools=[tool("a"), tool("b")]))


@pytest.mark.integration
async def test_a_message_over_message_bytes_is_resource_exhausted() -> None:
    async with (
        system_with(limits(message_bytes=64 * 1024)) as system,
        grpc.aio.insecure_channel(system.invocation_target) as channel,
    ):
        stub = invocation_pb2_grpc.InvocationServiceStub(channel)
        request = invocation_pb2.InvokeToolRequest(
            session_id="s", turn_id="t", tool_name="echo", arguments_json=json.dumps({"a": "x" * 70_000})
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.InvokeTool(request)
        assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        small = invocation_pb2.InvokeToolRequest(session_id="s", turn_id="t", tool_name="echo")
        answered = await stub.InvokeTool(small)  # the service goes on: no such tool, an outcome
        assert answered.outcome.error.code == Code.TOOL_NOT_FOUND.value


@pytest.mark.integration
async def test_host_sessions_per_session_refused_then_free_again() -> None:
    async with (
        system_with(limits(host_sessions_per_session=2)) as system,
        grpc.aio.insecure_channel(system.bridge_target) as channel,
    ):
        stub = bridge_pb2_grpc.BridgeServiceStub(channel)
        hosts = [await SilentHost(stub, "crowded").open() for _ in range(2)]
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await SilentHost(stub, "crowded").open()
        status, code, metadata = status_of(raised)
        assert (status, code) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Code.QUOTA_EXCEEDED)
        assert (metadata["limit"], metadata["value"]) == ("host_sessions_per_session", "2")
        assert retry_delay_s(raised.value) == pytest.approx(5.0)
        other = await SilentHost(stub, "elsewhere").open()  # another session is not affected
        hosts[0].close()
        again = await eventually(lambda: _opens(stub, "crowded"))
        for host in [*hosts, other, again]:
            host.close()


async def _opens(stub: Any, session: str) -> SilentHost | None:
    try:
        return await SilentHost(stub, session).open()
    except grpc.aio.AioRpcError as error:
        if error_code(error) is Code.QUOTA_EXCEEDED:
            return None
        raise


@pytest.mark.integration
async def test_the_rate_per_token_holds_per_caller_with_retry_info() -> None:
    verifier = Verifier(SharedSecret(SECRET))
    settings = limits(calls_per_second_per_caller=1, calls_burst_per_caller=2)
    async with (
        system_with(settings, security=Security(verifier=verifier)) as system,
        grpc.aio.insecure_channel(system.invocation_target) as channel,
    ):
        stub = invocation_pb2_grpc.InvocationServiceStub(channel)

        def as_caller(subject: str) -> tuple[tuple[str, str]]:
            minted = mint(SECRET, roles=[Role.CALL], sessions=["s"], ttl_s=600, subject=subject)
            return (("authorization", f"Bearer {minted}"),)

        request = invocation_pb2.InvokeToolRequest(session_id="s", turn_id="t", tool_name="none")
        for _ in range(2):
            await stub.InvokeTool(request, metadata=as_caller("fast"))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.InvokeTool(request, metadata=as_caller("fast"))
        status, code, metadata = status_of(raised)
        assert (status, code, metadata["limit"]) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            Code.QUOTA_EXCEEDED,
            "calls_per_second_per_caller",
        )
        delay = retry_delay_s(raised.value)
        assert delay is not None and 0 < delay <= 1.0
        await stub.InvokeTool(request, metadata=as_caller("patient"))  # another caller passes

        async def passes_again() -> bool:
            try:
                await stub.InvokeTool(request, metadata=as_caller("fast"))
            except grpc.aio.AioRpcError as error:
                assert error_code(error) is Code.QUOTA_EXCEEDED
                return False
            return True

        await eventually(passes_again, timeout=5, interval=0.2)


@pytest.mark.integration
async def test_calls_in_flight_per_session_hold_across_replicas() -> None:
    prefix = new_prefix()
    settings = limits(calls_in_flight_per_session=2)
    system = await start_local_system(limits=settings, store_url=SHARED_URL, store_prefix=prefix)
    replicas = await start_replicas(system, 1, SHARED_URL, prefix, limits=settings)
    try:
        targets = [system.invocation_target, f"127.0.0.1:{replicas[2].port}"]
        async with (
            grpc.aio.insecure_channel(system.registry_target) as registry_channel,
            grpc.aio.insecure_channel(system.bridge_target) as bridge_channel,
            grpc.aio.insecure_channel(targets[0]) as first,
            grpc.aio.insecure_channel(targets[1]) as second,
        ):
            registry = registry_pb2_grpc.RegistryServiceStub(registry_channel)
            for session in ("busy", "calm"):
                await registry.PutTools(
                    registry_pb2.PutToolsRequest(session_id=session, tools=[tool("wait", timeout_ms=20_000)])
                )
            bridge = bridge_pb2_grpc.BridgeServiceStub(bridge_channel)
            busy_host = await SilentHost(bridge, "busy").open()
            calm_host = await SilentHost(bridge, "calm").open()
            stubs = [invocation_pb2_grpc.InvocationServiceStub(c) for c in (first, second)]

            def call(stub: Any, session: str, n: int) -> Any:
                return stub.InvokeTool(
                    invocation_pb2.InvokeToolRequest(
                        session_id=session, turn_id="t", tool_name="wait", arguments_json=json.dumps({"n": n})
                    )
                )

            # One call waiting on each replica: the session's two places are taken.
            held = [call(stubs[0], "busy", 1), call(stubs[1], "busy", 2)]
            await eventually(lambda: busy_host.requests == 2)
            for stub in stubs:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await call(stub, "busy", 3)
                status, code, metadata = status_of(raised)
                assert (status, code, metadata["limit"], metadata["value"]) == (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    Code.QUOTA_EXCEEDED,
                    "calls_in_flight_per_session",
                    "2",
                )
            calm = call(stubs[1], "calm", 4)  # another session is not affected
            await eventually(lambda: calm_host.requests == 1)
            # The host leaves: the calls end (TOOL_HOST_DISCONNECTED) and give their places back.
            busy_host.close()
            for ended in held:
                assert (await ended).outcome.error.code == Code.TOOL_HOST_DISCONNECTED.value
            again = await SilentHost(bridge, "busy").open()
            retried = call(stubs[1], "busy", 5)
            await eventually(lambda: again.requests == 1)
            retried.cancel()
            calm.cancel()
            for host in (again, calm_host):
                host.close()
    finally:
        for server in reversed(replicas):
            await server.stop(0)
        await system.stop(0.5)
        await delete_prefixed(SHARED_URL, prefix)


@pytest.mark.integration
async def test_a_hostile_schema_registered_earlier_delays_nobody() -> None:
    """A version without these limits registered it: the invocation service bounds its validation."""
    prefix = new_prefix()
    earlier = open_stores(SHARED_URL, prefix)
    await earlier.store.put("registry:tools:hostile", registry_record([ToolSpec("h", "", nested_any_of(26))]))
    system = await start_local_system(
        limits=limits(validation_timeout_ms=300), store_url=SHARED_URL, store_prefix=prefix
    )
    try:
        async with grpc.aio.insecure_channel(system.invocation_target) as channel:
            stub = invocation_pb2_grpc.InvocationServiceStub(channel)
            hostile = asyncio.ensure_future(
                stub.InvokeTool(
                    invocation_pb2.InvokeToolRequest(
                        session_id="hostile",
                        turn_id="t",
                        tool_name="h",
                        arguments_json=json.dumps({"x": nested_arrays(26)}),
                    )
                )
            )
            # Meanwhile, other sessions' calls are answered (TOOL_NOT_FOUND: an outcome all the same).
            others = 0
            while not hostile.done():
                other = await stub.InvokeTool(
                    invocation_pb2.InvokeToolRequest(session_id="other", turn_id="t", tool_name="x"),
                    timeout=1.0,
                )
                assert other.outcome.error.code == Code.TOOL_NOT_FOUND.value
                others += 1
            outcome = (await hostile).outcome
            assert outcome.error.code == Code.TOOL_ARGS_INVALID.value
            assert "took longer than 300 ms" in outcome.error.message
            assert others > 5
    finally:
        await system.stop(0.5)
        await earlier.close()
        await delete_prefixed(SHARED_URL, prefix)
