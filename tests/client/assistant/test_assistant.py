"""The assistant's turns over real services, a real host process and a scripted model over HTTP.

Every turn code is driven here; how outcomes map onto them is checked without
servers in test_assistant_units.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from scripted_model import Hold, ScriptedModel, answer, before, failure, raw, running_model, tool_calls
from toolmesh.assembly.system import LocalSystem
from toolmesh.assistant import (
    TEXT_LIMIT,
    TURN_TABLE,
    Assistant,
    AssistantError,
    AssistantState,
    AssistantStatus,
    Author,
    ConfirmationRequest,
    Message,
    ModelEndpoint,
    ToolResult,
    ToolServices,
    TurnCode,
    TurnLimits,
)
from toolmesh.assistant.confirmation import Confirm
from toolmesh.assistant.grpc_channel import GrpcToolChannel
from toolmesh.assistant.model import FunctionTool, ModelReply
from toolmesh.client import RegistryClient
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh_testing import HostProcess, start_host_process

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

THREAD = "assistant-e2e"
OBJECT = '{"type":"object"}'
TOOLS = [
    ToolSpec(
        "echo",
        "Echo the arguments",
        json.dumps(
            {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 1}},
                "required": ["n"],
                "additionalProperties": False,
            }
        ),
    ),
    ToolSpec("boom", "Raises", OBJECT),
    ToolSpec("locked", "Answers with a domain error", OBJECT),
    ToolSpec("slow", "Never answers in time", OBJECT, timeout_ms=300),
    ToolSpec("big", "Returns size characters", OBJECT),
    ToolSpec(
        "delete_note",
        "Delete a note",
        json.dumps({"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}),
        annotations=ToolAnnotations(requires_confirmation=True),
    ),
    ToolSpec("unhandled", "Registered, but the host has no handler", OBJECT),
]

MakeAssistant = Callable[..., Assistant]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def model() -> AsyncIterator[ScriptedModel]:
    async with running_model() as server:
        yield server


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def host(system: LocalSystem, marker_dir: Path) -> AsyncIterator[HostProcess]:
    process = await start_host_process(
        system.bridge_target, THREAD, "assistant_handlers:HANDLERS", marker_dir
    )
    yield process
    await process.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def registry(system: LocalSystem) -> AsyncIterator[RegistryClient]:
    async with RegistryClient(system.registry_target) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="module", autouse=True)
async def tools(registry: RegistryClient, host: HostProcess) -> int:
    """Every test starts from the same tool list."""
    return await registry.put_tools(THREAD, TOOLS)


@pytest_asyncio.fixture(loop_scope="module")
async def make(system: LocalSystem, model: ScriptedModel) -> AsyncIterator[MakeAssistant]:
    made: list[Assistant] = []

    def build(
        *,
        session: str = THREAD,
        confirm: Confirm | None = None,
        limits: TurnLimits | None = None,
        model_url: str | None = None,
        model_timeout: float = 5.0,
        services: ToolServices | None = None,
    ) -> Assistant:
        assistant = Assistant.connect(
            session,
            model=ModelEndpoint(model_url or model.url, "scripted", "sk-test", model_timeout),
            services=services or ToolServices(system.registry_target, system.invocation_target),
            confirm=confirm,
            limits=limits,
        )
        made.append(assistant)
        return assistant

    yield build
    for assistant in made:
        await assistant.dispose()


async def turn_error(assistant: Assistant, text: str = "go") -> AssistantError:
    with pytest.raises(AssistantError) as raised:
        await assistant.send(text)
    assert assistant.state.error is raised.value
    assert assistant.state.status is AssistantStatus.IDLE
    return raised.value


def results(state: AssistantState) -> list[ToolResult]:
    return [m.result for m in state.messages if m.result is not None]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- a turn that answers ---------------------------------------------------------------------------


async def test_tool_result_goes_back_to_the_model_and_it_answers(
    make: MakeAssistant, model: ScriptedModel
) -> None:
    model.script(tool_calls(("echo", {"n": 2})), answer("It said 2."))
    assistant = make()
    seen: list[AssistantState] = []
    assistant.subscribe(seen.append)
    assert await assistant.send("echo two") == "It said 2."

    first, second = model.requests
    assert first["model"] == "scripted"
    assert first["messages"] == [{"role": "user", "content": "echo two"}]
    offered = {tool["function"]["name"]: tool["function"] for tool in first["tools"]}
    assert set(offered) == {tool.name for tool in TOOLS}
    assert offered["echo"]["parameters"]["required"] == ["n"]
    [tool_message] = model.tool_messages(1)
    assert tool_message["tool_call_id"] == "call_0"
    assert json.loads(tool_message["content"]) == {"echo": {"n": 2}, "turnId": assistant.state.turn_id}
    assert second["messages"][1]["tool_calls"][0]["function"]["name"] == "echo"

    state = assistant.state
    assert (state.status, state.error) == (AssistantStatus.IDLE, None)
    assert [m.role for m in state.messages] == [Author.USER, Author.ASSISTANT, Author.TOOL, Author.ASSISTANT]
    [result] = results(state)
    assert result.ok and result.data == {"echo": {"n": 2}, "turnId": state.turn_id}
    assert seen[0].status is AssistantStatus.RUNNING and seen[-1].status is AssistantStatus.IDLE
    assert [len(s.messages) for s in seen] == [1, 2, 3, 4, 4]


# -- failed tool results: the model sees them and the turn goes on ----------------------------------


async def test_unknown_tool_and_missing_handler_are_tool_unavailable(
    make: MakeAssistant, model: ScriptedModel
) -> None:
    model.script(tool_calls(("no_such_tool", {}), ("unhandled", {})), answer("Neither works."))
    assistant = make()
    assert await assistant.send("try") == "Neither works."
    unknown, unhandled = results(assistant.state)
    assert (unknown.code, unknown.cause) == (TurnCode.TOOL_UNAVAILABLE, "not_listed")
    assert (unhandled.code, unhandled.cause) == (TurnCode.TOOL_UNAVAILABLE, "TOOL_HANDLER_NOT_FOUND")
    contents = [m["content"] for m in model.tool_messages(1)]
    assert all(content.startswith("TOOL_UNAVAILABLE: ") for content in contents)


async def test_arguments_that_fail_the_schema_or_are_not_json_are_invalid_arguments(
    make: MakeAssistant, model: ScriptedModel
) -> None:
    model.script(tool_calls(("echo", {"n": 0}), ("echo", "{not json"), ("echo", "[1]")), answer("Fixed."))
    assistant = make()
    assert await assistant.send("try") == "Fixed."
    schema, not_json, not_object = results(assistant.state)
    assert (schema.code, schema.cause) == (TurnCode.INVALID_ARGUMENTS, "TOOL_ARGS_INVALID")
    assert "/n: 0 is less than the minimum of 1" in schema.text
    assert (not_json.code, not_json.cause) == (TurnCode.INVALID_ARGUMENTS, "not_json")
    assert (not_object.code, not_object.cause) == (TurnCode.INVALID_ARGUMENTS, "not_object")
    assert "minimum of 1" in model.tool_messages(1)[0]["content"]


async def test_raising_handler_and_domain_error_are_execution_failed(
    make: MakeAssistant, model: ScriptedModel
) -> None:
    model.script(tool_calls(("boom", {}), ("locked", {})), answer("Both failed."))
    assistant = make()
    assert await assistant.send("try") == "Both failed."
    raised, domain = results(assistant.state)
    assert (raised.code, raised.cause) == (TurnCode.EXECUTION_FAILED, "TOOL_HANDLER_ERROR")
    assert "0451" not in raised.text
    assert (domain.code, domain.cause) == (TurnCode.EXECUTION_FAILED, "NOTE_LOCKED")
    assert "The note is locked." in domain.text and domain.data == {"id": "n1"}


# -- confirmation ----------------------------------------------------------------------------------


async def test_confirmed_call_runs(make: MakeAssistant, model: ScriptedModel, marker_dir: Path) -> None:
    asked: list[ConfirmationRequest] = []

    async def yes(request: ConfirmationRequest) -> bool:
        asked.append(request)
        return True

    model.script(tool_calls(("delete_note", {"id": "ok1"})), answer("Deleted."))
    assistant = make(confirm=yes)
    assert await assistant.send("delete ok1") == "Deleted."
    [request] = asked
    assert (request.tool.name, request.arguments, request.turn_id) == (
        "delete_note",
        {"id": "ok1"},
        assistant.state.turn_id,
    )
    assert (marker_dir / "deleted-ok1").read_text() == assistant.state.turn_id
    assert results(assistant.state)[0].ok


def _refuse(answer: bool) -> Confirm:
    return lambda request: answer


def _raise(request: ConfirmationRequest) -> bool:
    raise RuntimeError("the dialog broke")


async def _dismissed(request: ConfirmationRequest) -> bool:
    raise asyncio.CancelledError  # the prompt was cancelled (Escape)


@pytest.mark.parametrize(
    "confirm", [_refuse(False), _raise, _dismissed, None], ids=["no", "raises", "dismissed", "no-callback"]
)
async def test_refused_confirmation_is_confirmation_denied_and_nothing_runs(
    make: MakeAssistant, model: ScriptedModel, marker_dir: Path, confirm: Confirm | None
) -> None:
    note = f"keep-{id(confirm)}"
    model.script(tool_calls(("delete_note", {"id": note})), answer("Kept."))
    assistant = make(confirm=confirm)
    assert await assistant.send("delete") == "Kept."
    [result] = results(assistant.state)
    assert result.code is TurnCode.CONFIRMATION_DENIED
    assert model.tool_messages(1)[0]["content"].startswith("CONFIRMATION_DENIED: ")
    # The assistant waits for every call it makes before the model reads the result:
    # had it called the tool, the handler would have left its marker by now.
    assert not (marker_dir / f"deleted-{note}").exists()


async def test_call_that_cannot_run_is_not_put_to_the_person(
    make: MakeAssistant, model: ScriptedModel
) -> None:
    asked: list[ConfirmationRequest] = []

    def yes(request: ConfirmationRequest) -> bool:
        asked.append(request)
        return True

    model.script(tool_calls(("delete_note", {"id": 7})), answer("Oops."))
    assistant = make(confirm=yes)
    assert await assistant.send("delete") == "Oops."
    assert asked == []
    assert results(assistant.state)[0].code is TurnCode.INVALID_ARGUMENTS


# -- stale tools -----------------------------------------------------------------------------------

EXTRA = ToolSpec("extra", "Appeared later", OBJECT)


async def test_revision_moved_after_planning_is_stale_tools(
    make: MakeAssistant, model: ScriptedModel, registry: RegistryClient
) -> None:
    model.script(
        before(lambda: registry.put_tools(THREAD, [*TOOLS, EXTRA]), tool_calls(("echo", {"n": 1}))),
        answer("Will ask again."),
    )
    assistant = make()
    assert await assistant.send("echo") == "Will ask again."
    [result] = results(assistant.state)
    assert result.code is TurnCode.STALE_TOOLS
    assert "STALE_TOOLS: " in model.tool_messages(1)[0]["content"]
    # The next round was planned on the new list.
    assert "extra" in {tool["function"]["name"] for tool in model.requests[1]["tools"]}


async def test_tool_list_changing_during_the_prompt_withdraws_it_as_stale_tools(
    make: MakeAssistant, model: ScriptedModel, registry: RegistryClient, marker_dir: Path
) -> None:
    withdrawn = asyncio.Event()

    async def wait_while_the_list_changes(request: ConfirmationRequest) -> bool:
        await registry.put_tools(THREAD, [*TOOLS, EXTRA])
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            withdrawn.set()
            raise
        return True

    model.script(tool_calls(("delete_note", {"id": "stale1"})), answer("The list changed."))
    assistant = make(confirm=wait_while_the_list_changes)
    assert await asyncio.wait_for(assistant.send("delete"), 10) == "The list changed."
    assert withdrawn.is_set()
    assert results(assistant.state)[0].code is TurnCode.STALE_TOOLS
    assert not (marker_dir / "deleted-stale1").exists()


async def test_confirming_after_the_list_changed_is_stale_tools(
    make: MakeAssistant, model: ScriptedModel, registry: RegistryClient, marker_dir: Path
) -> None:
    async def change_then_confirm(request: ConfirmationRequest) -> bool:
        await registry.put_tools(THREAD, [*TOOLS, EXTRA])
        return True

    model.script(tool_calls(("delete_note", {"id": "stale2"})), answer("Not deleted."))
    assistant = make(confirm=change_then_confirm)
    assert await assistant.send("delete") == "Not deleted."
    assert results(assistant.state)[0].code is TurnCode.STALE_TOOLS
    assert not (marker_dir / "deleted-stale2").exists()


# -- codes that end the turn -----------------------------------------------------------------------


async def test_plaintext_channel_where_tls_is_required_is_unsupported(
    make: MakeAssistant, model: ScriptedModel, system: LocalSystem
) -> None:
    model.script(answer("never"))
    services = ToolServices(system.registry_target, system.invocation_target, require_tls=True)
    error = await turn_error(make(services=services))
    assert error.code is TurnCode.UNSUPPORTED_WEBMCP and "TLS" in error.message
    assert model.requests == []


async def test_server_without_the_invocation_service_is_unsupported(
    make: MakeAssistant, model: ScriptedModel, system: LocalSystem
) -> None:
    model.script(answer("never"))
    # The bridge's server speaks gRPC and health, but offers no InvocationService.
    services = ToolServices(system.registry_target, system.bridge_target)
    error = await turn_error(make(services=services))
    assert error.code is TurnCode.UNSUPPORTED_WEBMCP
    assert "toolmesh.v1.InvocationService" in error.message
    assert model.requests == []


async def test_unreachable_registry_is_discovery_failed(
    make: MakeAssistant, model: ScriptedModel, system: LocalSystem
) -> None:
    model.script(answer("never"))
    services = ToolServices(f"127.0.0.1:{closed_port()}", system.invocation_target)
    error = await turn_error(make(services=services))
    assert error.code is TurnCode.DISCOVERY_FAILED
    assert model.requests == []


async def test_tool_that_cannot_be_offered_is_invalid_schema(
    make: MakeAssistant, model: ScriptedModel, registry: RegistryClient
) -> None:
    # The registry accepts dotted names; a chat-completions function name cannot have one.
    await registry.put_tools("assistant-dotted", [ToolSpec("notes.delete", "", OBJECT)])
    model.script(answer("never"))
    error = await turn_error(make(session="assistant-dotted"))
    assert error.code is TurnCode.INVALID_SCHEMA and "notes.delete" in error.message
    assert model.requests == []


async def test_model_that_hangs_is_timeout(make: MakeAssistant, model: ScriptedModel) -> None:
    model.script(Hold())
    assistant = make(model_timeout=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    error = await turn_error(assistant)
    assert error.code is TurnCode.TIMEOUT
    assert loop.time() - started < 3


@pytest.mark.parametrize(
    ("own_timeout", "cause"), [(None, "TOOL_TIMEOUT"), (0.1, "CALLER_DEADLINE_EXCEEDED")], ids=["tool", "own"]
)
async def test_tool_past_its_deadline_is_timeout_and_ends_the_turn(
    make: MakeAssistant, model: ScriptedModel, own_timeout: float | None, cause: str
) -> None:
    model.script(tool_calls(("slow", {}), ("echo", {"n": 1})), answer("never"))
    assistant = make(limits=TurnLimits(tool_timeout_s=own_timeout))
    error = await turn_error(assistant)
    assert error.code is TurnCode.TIMEOUT and cause in error.message
    slow, echo = results(assistant.state)
    assert (slow.code, slow.cause) == (TurnCode.TIMEOUT, cause)
    assert (echo.code, echo.cause) == (TurnCode.TIMEOUT, "not_run")  # echo never ran
    assert len(model.requests) == 1


@pytest.mark.parametrize(
    "reply",
    [
        failure(500),
        failure(401),
        raw(b"<html>gateway</html>"),
        raw(b'{"choices": []}'),
        raw(b'{"choices": [{"message": {"role": "assistant", "content": null}}]}'),
        raw(b'{"choices": [{"message": {"tool_calls": [{"function": {"name": "echo"}}]}}]}'),
    ],
    ids=["500", "401", "not-json", "no-choices", "empty-message", "call-without-id"],
)
async def test_failing_or_unusable_model_is_model_error(
    make: MakeAssistant, model: ScriptedModel, reply: Any
) -> None:
    model.script(reply)
    assistant = make()
    error = await turn_error(assistant)
    assert error.code is TurnCode.MODEL_ERROR
    assert [m.role for m in assistant.state.messages] == [Author.USER]


async def test_unreachable_model_is_model_error(make: MakeAssistant) -> None:
    error = await turn_error(make(model_url=f"http://127.0.0.1:{closed_port()}/v1"))
    assert error.code is TurnCode.MODEL_ERROR and "ConnectError" in error.message


async def test_more_rounds_than_allowed_is_turn_limit(make: MakeAssistant, model: ScriptedModel) -> None:
    model.script(*[tool_calls(("echo", {"n": n})) for n in (1, 2, 3)], answer("never"))
    assistant = make(limits=TurnLimits(max_rounds=2))
    error = await turn_error(assistant)
    assert error.code is TurnCode.TURN_LIMIT
    assert len(model.requests) == 3
    ran = [r for r in results(assistant.state) if r.ok]
    assert [r.data["echo"] for r in ran] == [{"n": 1}, {"n": 2}]
    assert (
        results(assistant.state)[-1].code is TurnCode.TURN_LIMIT
    )  # the third round's call was answered, not run


class BrokenModel:
    """A model adapter with a bug: it fails in a way no turn code names."""

    async def complete(self, messages: Sequence[Message], tools: Sequence[FunctionTool]) -> ModelReply:
        raise LookupError("a bug in the adapter")

    async def close(self) -> None:
        pass


async def test_a_failure_of_the_assistants_own_code_ends_the_turn_as_internal(system: LocalSystem) -> None:
    services = ToolServices(system.registry_target, system.invocation_target)
    assistant = Assistant(THREAD, channel=GrpcToolChannel(THREAD, services), model=BrokenModel())
    try:
        error = await turn_error(assistant)
    finally:
        await assistant.dispose()
    assert error.code is TurnCode.INTERNAL and error.ends_turn
    assert error.human_message == TURN_TABLE[TurnCode.INTERNAL].message
    assert error.detail == "LookupError" and isinstance(error.__cause__, LookupError)


# -- busy, cancel, clear, dispose ------------------------------------------------------------------


async def _running(assistant: Assistant, hold: Hold) -> asyncio.Task[str]:
    turn = asyncio.create_task(assistant.send("first"))
    await asyncio.wait_for(hold.entered.wait(), 5)
    assert assistant.state.status is AssistantStatus.RUNNING
    return turn


async def test_send_during_a_turn_is_busy_and_changes_nothing(
    make: MakeAssistant, model: ScriptedModel
) -> None:
    hold = Hold(then=answer("first done"))
    model.script(hold, answer("second done"))
    assistant = make()
    turn = await _running(assistant, hold)
    before_busy = assistant.state
    with pytest.raises(AssistantError) as raised:
        await assistant.send("second")
    assert raised.value.code is TurnCode.BUSY
    assert assistant.state is before_busy
    hold.released.set()
    assert await turn == "first done"
    assert await assistant.send("second") == "second done"
    assert [m.text for m in assistant.state.messages] == ["first", "first done", "second", "second done"]


async def _ended(turn: Awaitable[str]) -> AssistantError:
    with pytest.raises(AssistantError) as raised:
        await asyncio.wait_for(turn, 5)
    return raised.value


async def test_cancel_mid_turn_is_aborted_and_the_conversation_goes_on(
    make: MakeAssistant, model: ScriptedModel
) -> None:
    hold = Hold()
    model.script(hold, answer("after cancel"))
    assistant = make()
    turn = await _running(assistant, hold)
    assert assistant.cancel() is True
    assert assistant.state.status is AssistantStatus.IDLE
    assert assistant.state.error is not None and assistant.state.error.code is TurnCode.ABORTED
    assert (await _ended(turn)).code is TurnCode.ABORTED
    assert assistant.cancel() is False
    assert await assistant.send("again") == "after cancel"
    assert [m.text for m in assistant.state.messages] == ["first", "again", "after cancel"]


async def test_cancel_during_a_confirmation_prompt_is_aborted(
    make: MakeAssistant, model: ScriptedModel, marker_dir: Path
) -> None:
    prompted = asyncio.Event()

    async def never_answers(request: ConfirmationRequest) -> bool:
        prompted.set()
        await asyncio.sleep(30)
        return True

    model.script(tool_calls(("delete_note", {"id": "cancelled1"})))
    assistant = make(confirm=never_answers)
    turn = asyncio.create_task(assistant.send("delete"))
    await asyncio.wait_for(prompted.wait(), 5)
    assistant.cancel()
    assert (await _ended(turn)).code is TurnCode.ABORTED
    [result] = results(assistant.state)  # the open call is answered, so the history stays valid
    assert (result.code, result.cause) == (TurnCode.ABORTED, "not_run")
    assert not (marker_dir / "deleted-cancelled1").exists()


async def test_clear_mid_turn_is_aborted_and_forgets_everything(
    make: MakeAssistant, model: ScriptedModel
) -> None:
    hold = Hold()
    model.script(hold)
    assistant = make()
    turn = await _running(assistant, hold)
    assistant.clear()
    assert (await _ended(turn)).code is TurnCode.ABORTED
    assert assistant.state == AssistantState()


async def test_dispose_mid_turn_is_aborted_and_final(make: MakeAssistant, model: ScriptedModel) -> None:
    hold = Hold()
    model.script(hold)
    assistant = make()
    turn = await _running(assistant, hold)
    await assistant.dispose()
    assert (await _ended(turn)).code is TurnCode.ABORTED
    assert assistant.state.status is AssistantStatus.DISPOSED
    with pytest.raises(AssistantError) as raised:
        await assistant.send("anyone?")
    assert raised.value.code is TurnCode.ABORTED


# -- result size -----------------------------------------------------------------------------------


async def test_large_results_are_cut_to_the_text_limit_and_lose_their_data(
    make: MakeAssistant, model: ScriptedModel
) -> None:
    model.script(
        tool_calls(
            ("big", {"size": 20_000}), ("big", {"size": 20_000, "as_text": True}), ("big", {"size": 5_000})
        ),
        answer("Long."),
    )
    assistant = make()
    assert await assistant.send("big") == "Long."
    large_json, large_text, small = results(assistant.state)
    for result in (large_json, large_text):
        assert result.ok and result.data is None
        assert len(result.text) == TEXT_LIMIT
        assert result.text.endswith(" characters in all]")
    assert large_json.text.startswith('{"blob":"zzz')
    assert large_text.text.startswith("yyy")
    assert small.data == {"blob": "z" * 5_000}
    contents = [m["content"] for m in model.tool_messages(1)]
    assert [len(content) for content in contents] == [TEXT_LIMIT, TEXT_LIMIT, len(small.text)]
