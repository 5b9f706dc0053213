"""The assistant's rules without servers: the turn codes, the outcome mapping, result size, wire forms."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from toolmesh.assistant import (
    TEXT_LIMIT,
    TURN_TABLE,
    AssistantError,
    Message,
    ModelEndpoint,
    ToolCallRequest,
    ToolResult,
    TurnCode,
)
from toolmesh.assistant.chat_completions import parse_reply, request_body
from toolmesh.assistant.mapping import RUNTIME_TO_TURN, tool_result, turn_code
from toolmesh.assistant.model import FunctionTool
from toolmesh.assistant.offer import offer
from toolmesh.assistant.state import AssistantStatus, StateStore
from toolmesh.client.invocation import CallResult
from toolmesh.core.errors import Code
from toolmesh.core.outcome import ErrorKind, Outcome, ToolFailure
from toolmesh.core.tools import ToolSet, ToolSpec

pytestmark = pytest.mark.unit

TURN_CODES = {
    TurnCode.UNSUPPORTED_WEBMCP,
    TurnCode.DISCOVERY_FAILED,
    TurnCode.INVALID_SCHEMA,
    TurnCode.TOOL_UNAVAILABLE,
    TurnCode.STALE_TOOLS,
    TurnCode.INVALID_ARGUMENTS,
    TurnCode.EXECUTION_FAILED,
    TurnCode.CONFIRMATION_DENIED,
    TurnCode.ABORTED,
    TurnCode.TIMEOUT,
    TurnCode.MODEL_ERROR,
    TurnCode.TURN_LIMIT,
    TurnCode.BUSY,
}
# Failed tool results the model sees; BUSY refuses the send and ends nothing.
TURN_GOES_ON = {
    TurnCode.CONFIRMATION_DENIED,
    TurnCode.TOOL_UNAVAILABLE,
    TurnCode.INVALID_ARGUMENTS,
    TurnCode.EXECUTION_FAILED,
    TurnCode.STALE_TOOLS,
    TurnCode.BUSY,
}
# Every code a tool call can come back with: outcomes and the no-outcome codes of a caller.
CALL_CODES = {
    Code.TOOL_NOT_FOUND,
    Code.UNAUTHENTICATED,
    Code.PERMISSION_DENIED,
    Code.TOOL_ARGS_INVALID,
    Code.TOOL_HANDLER_NOT_FOUND,
    Code.TOOL_HANDLER_ERROR,
    Code.TOOL_RESULT_INVALID,
    Code.TOOL_TIMEOUT,
    Code.TOOL_CANCELLED,
    Code.TOOL_HOST_UNAVAILABLE,
    Code.TOOL_HOST_DISCONNECTED,
    Code.INVALID_REQUEST,
    Code.REGISTRY_UNAVAILABLE,
    Code.BRIDGE_UNAVAILABLE,
    Code.STORE_UNAVAILABLE,
    Code.OUTCOME_UNAVAILABLE,
    Code.OVERLOADED,
    Code.SHUTTING_DOWN,
    Code.INTERNAL,
    Code.CALLER_DEADLINE_EXCEEDED,
    Code.TRANSPORT_FAILED,
}


def test_thirteen_turn_codes_and_which_end_the_turn() -> None:
    assert len(TURN_CODES) == 13
    # The table has one more row: INTERNAL, the assistant's own failure, which ends the turn.
    assert set(TURN_TABLE) == TURN_CODES | {TurnCode.INTERNAL}
    assert TURN_TABLE[TurnCode.INTERNAL].ends_turn
    for code in TURN_CODES:
        assert TURN_TABLE[code].ends_turn is (code not in TURN_GOES_ON), code
    messages = [spec.message for spec in TURN_TABLE.values()]
    assert len(messages) == len(set(messages))


def test_every_call_code_maps_onto_a_turn_code() -> None:
    assert set(RUNTIME_TO_TURN) == CALL_CODES
    assert set(RUNTIME_TO_TURN.values()) <= TURN_CODES


@pytest.mark.parametrize(
    ("code", "kind", "expected"),
    [
        ("TOOL_NOT_FOUND", ErrorKind.RUNTIME, TurnCode.TOOL_UNAVAILABLE),
        ("TOOL_HANDLER_NOT_FOUND", ErrorKind.RUNTIME, TurnCode.TOOL_UNAVAILABLE),
        ("TOOL_HOST_UNAVAILABLE", ErrorKind.RUNTIME, TurnCode.TOOL_UNAVAILABLE),
        ("TOOL_ARGS_INVALID", ErrorKind.RUNTIME, TurnCode.INVALID_ARGUMENTS),
        ("TOOL_HANDLER_ERROR", ErrorKind.RUNTIME, TurnCode.EXECUTION_FAILED),
        ("TOOL_RESULT_INVALID", ErrorKind.RUNTIME, TurnCode.EXECUTION_FAILED),
        ("TOOL_HOST_DISCONNECTED", ErrorKind.RUNTIME, TurnCode.EXECUTION_FAILED),
        ("TOOL_TIMEOUT", ErrorKind.RUNTIME, TurnCode.TIMEOUT),
        ("OUTCOME_UNAVAILABLE", ErrorKind.RUNTIME, TurnCode.EXECUTION_FAILED),
        # Someone cancelled the invocation: the turn stops, as for a cancelled turn.
        ("TOOL_CANCELLED", ErrorKind.RUNTIME, TurnCode.ABORTED),
        # A handler's own code, whatever it is.
        ("TOOL_NOT_FOUND", ErrorKind.DOMAIN, TurnCode.EXECUTION_FAILED),
        ("SOMETHING_NEWER", ErrorKind.RUNTIME, TurnCode.EXECUTION_FAILED),
    ],
)
def test_turn_code_of_an_outcome(code: str, kind: ErrorKind, expected: TurnCode) -> None:
    assert turn_code(code, kind) is expected


def test_no_outcome_results_say_the_tool_may_have_run() -> None:
    result = tool_result(CallResult(None, None, Code.CALLER_DEADLINE_EXCEEDED))
    assert (result.ok, result.code, result.cause) == (False, TurnCode.TIMEOUT, "CALLER_DEADLINE_EXCEEDED")
    assert "may or may not have run" in result.text
    transport = tool_result(CallResult(None, None, Code.TRANSPORT_FAILED, "connection reset"))
    assert transport.code is TurnCode.EXECUTION_FAILED and transport.text.endswith("connection reset")


def test_failure_text_starts_with_the_code_and_its_message() -> None:
    failure = ToolFailure.runtime(
        Code.TOOL_ARGS_INVALID, "1 schema violation(s).", {"violations": [{"path": "/n", "message": "bad"}]}
    )
    result = tool_result(CallResult("tr_1", Outcome.error(failure)))
    assert result.text.startswith(f"INVALID_ARGUMENTS: {TURN_TABLE[TurnCode.INVALID_ARGUMENTS].message} ")
    assert result.text.endswith("/n: bad")
    assert result.data == {"violations": [{"path": "/n", "message": "bad"}]}


def test_text_limit_is_exact() -> None:
    assert len(ToolResult.success(json.dumps("a" * (TEXT_LIMIT - 2))).text) == TEXT_LIMIT - 2
    exact = "b" * TEXT_LIMIT
    assert ToolResult.success(json.dumps(exact)).text == exact
    over = ToolResult.success(json.dumps(exact + "b"))
    assert len(over.text) == TEXT_LIMIT and over.text.endswith(f"[cut: {TEXT_LIMIT + 1} characters in all]")


def test_data_is_dropped_when_its_json_is_over_the_limit() -> None:
    fits = {"k": "c" * (TEXT_LIMIT - len('{"k":""}'))}
    assert ToolResult.success(json.dumps(fits, separators=(",", ":"))).data == fits
    over = {"k": fits["k"] + "c"}
    result = ToolResult.success(json.dumps(over, separators=(",", ":")))
    assert result.data is None and len(result.text) == TEXT_LIMIT
    assert ToolResult.failure(TurnCode.EXECUTION_FAILED, data={"huge": "d" * TEXT_LIMIT}).data is None


def test_a_result_is_ok_or_has_a_code() -> None:
    with pytest.raises(ValueError, match="ok, or it has a code"):
        ToolResult(True, "x", TurnCode.EXECUTION_FAILED)


def test_reply_with_tool_calls_is_read() -> None:
    reply = parse_reply(
        json.dumps(
            {
                "choices": [
                    {
                        "message": {
                            "content": None,
                            "tool_calls": [
                                {"id": "a", "function": {"name": "echo", "arguments": '{"n":1}'}},
                                {"id": "b", "function": {"name": "echo", "arguments": {"n": 2}}},
                            ],
                        }
                    }
                ]
            }
        ).encode()
    )
    assert reply.text == ""
    assert reply.tool_calls == (
        ToolCallRequest("a", "echo", '{"n":1}'),
        ToolCallRequest("b", "echo", '{"n": 2}'),
    )


@pytest.mark.parametrize(
    "body",
    [b"\xff\xfe", b"[]", b'{"choices": [{"message": {"content": [{"type": "text"}]}}]}', b"NaN"],
)
def test_unusable_replies_are_model_errors(body: bytes) -> None:
    with pytest.raises(AssistantError) as raised:
        parse_reply(body)
    assert raised.value.code is TurnCode.MODEL_ERROR


def test_request_body_follows_chat_completions() -> None:
    call = ToolCallRequest("c1", "echo", "{}")
    messages = [
        Message.user("hi"),
        Message.assistant("", (call,)),
        Message.tool(call, ToolResult.success('{"ok":1}')),
        Message.assistant("done"),
    ]
    body = request_body("m", messages, [FunctionTool("echo", "Echo", {"type": "object"})], "Be brief.")
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "echo", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"ok":1}'},
        {"role": "assistant", "content": "done"},
    ]
    assert body["tools"][0]["function"]["parameters"] == {"type": "object"}
    assert "tools" not in request_body("m", messages, [])


@pytest.mark.parametrize(
    "tool",
    [
        ToolSpec("x" * 65, "", '{"type":"object"}'),
        ToolSpec("list", "", '{"type":"array"}'),  # from a registry that checks less than ours
        ToolSpec("old", "", '{"$schema":"http://json-schema.org/draft-04/schema#","type":"object"}'),
    ],
)
def test_tools_that_cannot_be_offered_are_invalid_schema(tool: ToolSpec) -> None:
    with pytest.raises(AssistantError) as raised:
        offer(ToolSet(1, (ToolSpec("fine"), tool)))
    assert raised.value.code is TurnCode.INVALID_SCHEMA


def test_model_endpoint_from_flags_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLMESH_MODEL_URL", "https://models.example/v1/")
    monkeypatch.setenv("TOOLMESH_MODEL", "env-model")
    monkeypatch.setenv("TOOLMESH_MODEL_API_KEY", "sk-secret")
    endpoint = ModelEndpoint.from_env(model="flag-model")
    assert (endpoint.chat_url, endpoint.model) == ("https://models.example/v1/chat/completions", "flag-model")
    assert "sk-secret" not in repr(endpoint)
    monkeypatch.delenv("TOOLMESH_MODEL")
    with pytest.raises(ValueError, match="TOOLMESH_MODEL"):
        ModelEndpoint.from_env()


def test_an_ended_turn_answers_its_open_calls_and_a_stale_turn_changes_nothing() -> None:
    store = StateStore()
    generation = store.begin_turn("t1", Message.user("go"))
    calls = (ToolCallRequest("a", "echo", "{}"), ToolCallRequest("b", "echo", "{}"))
    store.append(generation, Message.assistant("", calls))
    store.append(generation, Message.tool(calls[0], ToolResult.success("1")))
    store.abort(AssistantError(TurnCode.ABORTED))
    store.append(generation, Message.user("late"))  # the aborted turn, still unwinding
    store.end_turn(generation, None)
    state = store.state
    assert (
        state.status is AssistantStatus.IDLE
        and state.error is not None
        and state.error.code is TurnCode.ABORTED
    )
    answered = [(m.call.id, m.result.code) for m in state.messages if m.call and m.result]
    assert answered == [("a", None), ("b", TurnCode.ABORTED)]


def test_assistant_error_pickles_and_copies() -> None:
    error = AssistantError(TurnCode.TIMEOUT, "The model did not answer within 5 s.", {"tool": "echo"})
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(again) is AssistantError
        assert (again.code, again.detail, again.metadata) == (error.code, error.detail, error.metadata)
        assert (again.message, again.human_message, again.ends_turn) == (
            error.message,
            error.human_message,
            True,
        )
