"""Domain code without servers: JSON rules, the error table, handler results, wire forms."""

from __future__ import annotations

import asyncio
import copy
import math
import pickle
import time
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from toolmesh.cli.output import exit_code_for
from toolmesh.core import jsontext, telemetry
from toolmesh.core.errors import ERROR_TABLE, RETRYABLE_STATUSES, Code, Status, ToolmeshError
from toolmesh.core.outcome import ErrorKind, Outcome, ToolFailure
from toolmesh.core.rpcstatus import grpc_code, status_of, to_grpc_status
from toolmesh.core.tools import ToolSpec
from toolmesh.core.wire import outcome_from_pb, outcome_to_pb, tool_from_pb, tool_to_pb
from toolmesh.host.context import Cancellation
from toolmesh.host.results import convert_return
from toolmesh_testing import eventually

pytestmark = pytest.mark.unit


def test_every_code_has_one_row_with_a_message() -> None:
    assert set(ERROR_TABLE) == set(Code)
    for code, spec in ERROR_TABLE.items():
        assert spec.message.endswith(".") and len(spec.message) < 120, code
        assert isinstance(spec.status, Status)
        assert spec.status is not Status.OK
    messages = [spec.message for spec in ERROR_TABLE.values()]
    assert len(messages) == len(set(messages))


def test_retryability_follows_what_may_have_run() -> None:
    # Nothing ran: safe to retry. Something may have run: reconcile first.
    assert ERROR_TABLE[Code.TOOL_HOST_UNAVAILABLE].retryable
    assert ERROR_TABLE[Code.CALLER_DEADLINE_EXCEEDED].retryable
    assert not ERROR_TABLE[Code.TOOL_TIMEOUT].retryable
    assert not ERROR_TABLE[Code.TOOL_HOST_DISCONNECTED].retryable
    assert not ERROR_TABLE[Code.SUBMIT_TOOL_RESULT_FAILED].retryable


def test_a_request_at_fault_fails_the_same_way_when_sent_again() -> None:
    at_fault = {code for code, spec in ERROR_TABLE.items() if spec.caller_fault}
    # The two a caller's InvokeTool can fail with, which the client raises rather than returns.
    assert {Code.INVALID_REQUEST, Code.IDEMPOTENCY_KEY_REUSED} <= at_fault
    assert all(not ERROR_TABLE[code].retryable for code in at_fault)
    assert not at_fault & {Code.REGISTRY_UNAVAILABLE, Code.INTERNAL, Code.INVOCATION_NOT_FOUND}


def test_table_statuses_are_grpc_statuses_both_ways() -> None:
    assert {status.name for status in Status} == {code.name for code in grpc.StatusCode}
    for status in Status:
        assert grpc_code(status).name == status.name
        assert status_of(grpc_code(status)) is status


def test_statuses_worth_retrying_without_a_code_come_from_the_retryable_rows() -> None:
    # What the host SDK retries a SubmitToolResult on when the failure carries no code of ours.
    assert {Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED, Status.RESOURCE_EXHAUSTED} == RETRYABLE_STATUSES


@pytest.mark.parametrize(
    ("code", "exit_code"),
    [
        (None, 75),
        (Code.TRANSPORT_FAILED, 75),
        (Code.REGISTRY_UNAVAILABLE, 75),
        (Code.INVALID_REQUEST, 2),
        (Code.INVOCATION_NOT_FOUND, 1),
        (Code.TOOL_ARGS_INVALID, 2),
    ],
)
def test_cli_exit_codes_follow_the_table(code: Code | None, exit_code: int) -> None:
    assert exit_code_for(code) == exit_code


def test_toolmesh_error_becomes_a_status_with_error_info() -> None:
    status = to_grpc_status(ToolmeshError(Code.TOOL_NOT_FOUND, "", {"tool": "x"}))
    assert status.code is grpc.StatusCode.NOT_FOUND
    assert status.details == ERROR_TABLE[Code.TOOL_NOT_FOUND].message
    keys = [key for key, _ in status.trailing_metadata]
    assert "grpc-status-details-bin" in keys


def test_toolmesh_error_pickles_and_copies() -> None:
    error = ToolmeshError(Code.OVERLOADED, "Too many.", {"max_in_flight": "2"})
    error.add_note("seen by the test")
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(again) is ToolmeshError
        assert (again.code, again.detail, again.metadata) == (error.code, error.detail, error.metadata)
        assert (again.message, again.args, again.retryable) == (error.message, error.args, True)
        assert again.__notes__ == ["seen by the test"]
    deep = copy.deepcopy(error)
    deep.metadata["maxInFlight"] = "3"
    assert error.metadata == {"max_in_flight": "2"}


@pytest.mark.parametrize(
    ("value", "path"),
    [
        (b"x", "$"),
        ({"a": {1, 2}}, "$.a"),
        ({"a": [1, math.nan]}, "$.a[1]"),
        ({"a": math.inf}, "$.a"),
        ({1: "x"}, "$"),
        ({"f": print}, "$.f"),
        ({"o": object()}, "$.o"),
        # Values that JSON text carries, but not as the same value to every reader.
        ({"s": "ok \ud800"}, "$.s"),
        ({"k\udfff": 1}, "$"),
        ({"n": [2**53 + 1]}, "$.n[0]"),
        ({"n": -(10**400)}, "$.n"),
    ],
)
def test_check_plain_names_the_first_problem(value: Any, path: str) -> None:
    with pytest.raises(jsontext.NotPlainJson) as raised:
        jsontext.check_plain(value)
    assert raised.value.path == path


def test_cycles_are_found_but_shared_values_are_fine() -> None:
    shared = [1, 2]
    jsontext.check_plain({"a": shared, "b": shared, "c": (1, 2)})
    cycle: dict[str, Any] = {}
    cycle["self"] = {"again": cycle}
    with pytest.raises(jsontext.NotPlainJson, match="cycle"):
        jsontext.check_plain(cycle)


def test_deep_values_do_not_hit_the_recursion_limit() -> None:
    deep: list[Any] = []
    node = deep
    for _ in range(50_000):
        child: list[Any] = []
        node.append(child)
        node = child
    jsontext.check_plain(deep)


def test_parse_refuses_nan_and_infinity() -> None:
    for text in ["NaN", '{"a": Infinity}', "-Infinity", "{", "[1,]"]:
        with pytest.raises(jsontext.NotPlainJson):
            jsontext.parse(text)
    assert jsontext.parse('{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}


def test_parse_refuses_what_readers_take_differently() -> None:
    for text in [
        '{"a": 1, "b": {"c": 1, "c": 2}}',
        "[1e400]",
        '"\\udc00"',
        '{"\\ud800x": 1}',
        "9007199254740993",
        "1" + "0" * 400,
    ]:
        with pytest.raises(jsontext.NotPlainJson):
            jsontext.parse(text)
    # Surrogate pairs, integers a float holds exactly, and tiny numbers pass.
    assert jsontext.parse('["\\ud83d\\ude00", 9007199254740992, 100000000000000000000, 1e-400]') == [
        "\U0001f600",
        2**53,
        10**20,
        0.0,
    ]
    jsontext.check_plain({"n": [2**53, -(2**53), 10**20, 2**80], "s": "caf\u00e9 \U0001f600"})


def test_canonical_form_ignores_key_order_whitespace_and_number_spelling() -> None:
    one = jsontext.canonical(jsontext.parse('{"b": 1.0, "a": [1e2, "x"]}'))
    two = jsontext.canonical(jsontext.parse('{ "a":[100,"x"],"b":1 }'))
    assert one == two
    assert one != jsontext.canonical(jsontext.parse('{"a": [100, "x"], "b": 2}'))
    # Large integers too (RFC 8785 writes every number as a float would).
    big = jsontext.canonical(jsontext.parse('{"id": 100000000000000000000}'))
    assert big == jsontext.canonical(jsontext.parse('{"id": 1e20}')) == b'{"id":100000000000000000000}'


def test_returned_error_object_is_a_domain_error() -> None:
    converted = convert_return(
        {"error": {"code": "E", "message": "m", "details": {"k": 1}, "retryable": True}}
    )
    assert converted.outcome.failure == ToolFailure(ErrorKind.DOMAIN, "E", "m", {"k": 1}, True)
    assert converted.refused_because is None


@pytest.mark.parametrize(
    "bad",
    [
        {"code": "", "message": "m"},
        {"code": "E"},
        {"code": "E", "message": "m", "retryable": "yes"},
        {"code": "E", "message": "m", "details": [1]},
        {"code": "E", "message": "m", "extra": 1},
    ],
)
def test_malformed_returned_error_is_tool_result_invalid(bad: dict[str, Any]) -> None:
    failure = convert_return({"error": bad}).outcome.failure
    assert failure is not None and failure.code == "TOOL_RESULT_INVALID"
    assert failure.details == {"reason": "malformed_error"}


def test_returned_error_with_a_runtime_code_is_tool_result_invalid() -> None:
    failure = convert_return({"error": {"code": "TOOL_TIMEOUT", "message": "m"}}).outcome.failure
    assert failure is not None and failure.code == "TOOL_RESULT_INVALID"
    assert failure.details == {"reason": "runtime_code"}


def test_error_key_among_others_is_an_ordinary_result() -> None:
    assert convert_return({"error": {"code": "E"}, "more": 1}).outcome.ok
    assert convert_return({"error": "text"}).outcome.ok


@pytest.mark.parametrize("value", ["\udfff", {"text": "a\ud800b"}, {"id": 2**53 + 1}])
def test_a_result_no_reader_reads_as_it_is_is_refused_not_raised(value: Any) -> None:
    converted = convert_return(value)
    assert converted.refused_because is Code.RESULT_NOT_JSON
    failure = converted.outcome.failure
    assert failure is not None and failure.code == "TOOL_RESULT_INVALID"
    outcome_to_pb(converted.outcome).SerializeToString()  # the refusal itself travels


def test_non_json_and_oversized_results_are_refused_with_a_reason() -> None:
    converted = convert_return({"x": b"bytes"})
    assert converted.refused_because is Code.RESULT_NOT_JSON
    assert converted.outcome.failure is not None and converted.outcome.failure.code == "TOOL_RESULT_INVALID"
    assert convert_return("x" * (2 * 1024 * 1024)).refused_because is Code.RESULT_TOO_LARGE
    assert convert_return(None).outcome.result_json == "null"


def test_outcome_holds_exactly_one_side() -> None:
    with pytest.raises(ValueError):
        Outcome()
    with pytest.raises(ValueError):
        Outcome(result_json="1", failure=ToolFailure.runtime(Code.TOOL_TIMEOUT))


@pytest.mark.parametrize(
    "outcome",
    [
        Outcome.success('{"a":1}'),
        Outcome.runtime_error(Code.TOOL_TIMEOUT, "after 5 ms", {"timeoutMs": 5}),
        Outcome.error(ToolFailure(ErrorKind.DOMAIN, "E", "m", None, True)),
    ],
)
def test_outcome_survives_the_wire(outcome: Outcome) -> None:
    assert outcome_from_pb(outcome_to_pb(outcome)) == outcome


def test_tool_definition_survives_the_wire_and_json_form() -> None:
    spec = ToolSpec.from_json_dict(
        {
            "name": "t",
            "description": "d",
            "inputSchema": {"type": "object"},
            "outputSchema": {"type": "string"},
            "timeoutMs": 10,
            "annotations": {"readOnly": True, "requiresConfirmation": True},
        }
    )
    assert tool_from_pb(tool_to_pb(spec)) == spec
    assert ToolSpec.from_json_dict(spec.to_json_dict()) == spec
    assert spec.effective_timeout_ms == 10
    assert ToolSpec("u").effective_timeout_ms == 60_000


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"name": 1},
        {"name": "t"},
        {"name": "t", "inputSchema": {}, "timeoutMs": "5"},
        {"name": "t", "inputSchema": {}, "annotations": {"readOnly": "yes"}},
        {"name": "t", "inputSchema": {}, "annotations": {"requiresConfirmaton": True}},
        {"name": "t", "inputSchema": {}, "timeout": 5},
    ],
)
def test_malformed_tools_json_entries_are_invalid_schema(raw: Any) -> None:
    with pytest.raises(ToolmeshError) as raised:
        ToolSpec.from_json_dict(raw)
    assert raised.value.code is Code.INVALID_SCHEMA


def test_an_unknown_key_is_refused_by_name() -> None:
    with pytest.raises(ToolmeshError) as raised:
        ToolSpec.from_json_dict(
            {"name": "t", "inputSchema": {}, "annotations": {"requiresConfirmaton": True}}
        )
    assert '"requiresConfirmaton" in annotations' in raised.value.detail
    assert "requiresConfirmation" in raised.value.detail


def test_an_sdk_installed_later_is_seen_at_the_next_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = telemetry._SdkInstalled()
    installed.recheck_s = 0.05
    monkeypatch.setattr(trace, "get_tracer_provider", trace.NoOpTracerProvider)
    assert not installed()
    monkeypatch.setattr(trace, "get_tracer_provider", TracerProvider)
    assert not installed()  # asked again only after recheck_s
    time.sleep(0.06)  # past recheck_s: the time passing is what is tested
    assert installed()
    monkeypatch.setattr(trace, "get_tracer_provider", trace.NoOpTracerProvider)
    assert installed()  # once installed, it stays


async def test_cancellation_wakes_a_handler_thread_however_the_two_interleave() -> None:
    early = Cancellation()
    early.set("timeout")
    assert await asyncio.to_thread(early.wait_blocking, 5)  # set before anyone waited

    late = Cancellation()
    waiting = asyncio.ensure_future(asyncio.to_thread(late.wait_blocking, 5))
    await eventually(lambda: late._event is not None)  # the thread waits on its event
    late.set("cancelled")
    assert await asyncio.wait_for(waiting, 2)
    assert late.reason == "cancelled"

    never = Cancellation()
    assert not await asyncio.to_thread(never.wait_blocking, 0.05)
