"""What is validated is what the host reads: arguments JSON readers take differently are refused.

Over real servers and a real host process that echoes what it received.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem
from toolmesh.client import CallResult, InvocationClient, RegistryClient
from toolmesh.core.limits import FULL_VIOLATION_REPORT_CHARS, MAX_REPORTED_VIOLATIONS, MAX_VIOLATION_TEXT
from toolmesh.core.tools import ToolSpec
from toolmesh_testing import HostProcess, start_host_process

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "faithful"
TOOLS = [
    # Anything goes: the host reads whatever passes.
    ToolSpec("echo", "Echo the arguments", '{"type": "object"}', timeout_ms=3000),
    ToolSpec(
        "typed",
        "Echo, with a schema",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "n": {"type": "integer"},
                    "role": {"enum": ["reader"]},
                    "maybe": {"type": ["null", "string"]},
                    "items": {"type": "array", "items": {"type": "string"}},
                },
            }
        ),
        timeout_ms=3000,
    ),
]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def host(system: LocalSystem, marker_dir: Path) -> AsyncIterator[HostProcess]:
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools(SESSION, TOOLS)
    process = await start_host_process(system.bridge_target, SESSION, "e2e_handlers:HANDLERS", marker_dir)
    yield process
    await process.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module", params=["unary", "stream"])
async def client(
    system: LocalSystem, host: HostProcess, request: pytest.FixtureRequest
) -> AsyncIterator[InvocationClient]:
    async with InvocationClient(system.invocation_target, multiplex=request.param == "stream") as invocation:
        yield invocation


async def call_raw(client: InvocationClient, tool: str, text: str) -> CallResult:
    return await client.invoke(SESSION, tool, turn_id="t", arguments_json=text, timeout=20)


def args_refusal(result: CallResult) -> tuple[str, str, Any]:
    assert result.outcome is not None and result.outcome.failure is not None, result
    failure = result.outcome.failure
    assert failure.code == "TOOL_ARGS_INVALID", failure
    assert failure.details is not None
    return failure.details["reason"], failure.message, failure.details


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        # Python keeps the last "role", a reader that keeps the first gets "admin".
        ('{"role": "admin", "role": "reader"}', "the key 'role' appears twice"),
        ('{"n": 1, "items": ["a"], "n": 2}', "the key 'n' appears twice"),
        # Validated as null (what the validator makes of infinity), read as infinity.
        ('{"maybe": 1e400}', "too large for a 64-bit float"),
        ('{"maybe": -1e400}', "too large for a 64-bit float"),
        # A lone surrogate: valid JSON text, not Unicode; the host could not answer it.
        ('{"maybe": "\\ud800"}', "lone surrogate"),
        ('{"\\udfff": 1}', "lone surrogate"),
        # A float reader rounds it to 9007199254740992.
        ('{"n": 9007199254740993}', "not exact in a 64-bit float"),
    ],
)
async def test_text_readers_take_differently_is_refused_at_once(
    client: InvocationClient, text: str, problem: str
) -> None:
    for tool in ("typed", "echo"):
        reason, message, _ = args_refusal(await call_raw(client, tool, text))
        assert reason == "not_json"
        assert problem in message


async def test_what_passes_reaches_the_host_as_it_was_validated(client: InvocationClient) -> None:
    text = '{"n": 7, "maybe": "\\ud83d\\ude00 caf\\u00e9", "big": 100000000000000000000, "f": 1.5e300}'
    result = await call_raw(client, "echo", text)
    assert result.outcome is not None and result.outcome.ok, result
    assert result.to_json()["result"]["echo"] == json.loads(text)


@pytest.mark.parametrize("length", [5_000, 900_000])
async def test_a_long_value_is_described_not_echoed(client: InvocationClient, length: int) -> None:
    arguments = {"n": "x" * length, "items": ["a", 1]}
    reason, _, details = args_refusal(await client.invoke(SESSION, "typed", arguments, turn_id="t"))
    assert reason == "schema"
    violations = details["violations"]
    assert 1 <= len(violations) <= MAX_REPORTED_VIOLATIONS
    for violation in violations:
        assert len(violation["message"]) <= MAX_VIOLATION_TEXT
        assert len(violation["path"]) <= MAX_VIOLATION_TEXT
        assert "x" * 100 not in violation["message"]
    assert len(json.dumps(details)) < 4 * MAX_VIOLATION_TEXT
    by_path = {violation["path"]: violation["message"] for violation in violations}
    assert by_path["/n"] == 'does not satisfy "type" at /properties/n/type (the value is too long to quote)'
    if length < FULL_VIOLATION_REPORT_CHARS:
        # All of them, and a short value is still quoted: it says what was wrong.
        assert by_path["/items/1"] == '1 is not of type "string"'


async def test_many_violations_in_large_arguments_cost_one(client: InvocationClient) -> None:
    # 200,000 violations: listing them all would hold the service for seconds.
    arguments = {"items": [1] * 200_000}
    reason, message, details = args_refusal(await client.invoke(SESSION, "typed", arguments, turn_id="t"))
    assert reason == "schema"
    assert details["violations"] == [{"path": "/items/0", "message": '1 is not of type "string"'}]
    assert message.endswith("(arguments this large are not checked further).")
