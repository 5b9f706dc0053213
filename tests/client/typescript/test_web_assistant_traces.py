"""@toolmesh/assistant's spans through the page's @opentelemetry/api (Chromium): a turn is an
`invoke_agent` span, each model call a `chat {model}` CLIENT span and each webmcp() tool call an
`execute_tool {tool}` span, its children; no prompt, message, argument or result on any; no span,
and the same turns, when the page registered no tracer provider."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import pytest_asyncio

from assistant_page import PAGE, Page
from browser_driver import BrowserDriver, build_test_page
from scripted_model import Hold, Reply, ScriptedModel, Step, answer, failure, raw, running_model, tool_calls

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

# In the person's text, the tool's arguments, its result and the model's answer: never on a span.
MARKER = "marker-7f3a"
INTERNAL, CLIENT, ERROR = 0, 2, 2


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def driver() -> AsyncIterator[BrowserDriver]:
    build_test_page("assistant-test")
    started = await BrowserDriver.start()
    yield started
    await started.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def model() -> AsyncIterator[ScriptedModel]:
    async with running_model(cors=True) as server:
        yield server


_tabs = iter(range(1 << 30))


async def open_page(driver: BrowserDriver, model: ScriptedModel, *steps: Step, **query: str) -> Page:
    model.script(*steps)
    tab = f"t{next(_tabs)}"
    opened = await driver.open(tab, {"model": model.url, **query}, path="/assistant")
    assert opened["started"], opened
    return Page(driver, tab)


def with_usage(reply: Reply, model: str, usage: dict[str, int]) -> Reply:
    """`reply` as an endpoint that names its model and reports token usage sends it."""
    return raw(json.dumps({**json.loads(reply.body), "model": model, "usage": usage}).encode())


async def spans(page: Page) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = await page.eval(f"{PAGE}.spans")
    return found


def named(found: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [span for span in found if span["name"] == name]


async def test_a_turn_is_an_invoke_agent_span_over_its_model_and_tool_calls(
    driver: BrowserDriver, model: ScriptedModel
) -> None:
    page = await open_page(
        driver,
        model,
        with_usage(
            tool_calls(("add_note", {"text": MARKER})),
            "scripted-2026",
            {"prompt_tokens": 42, "completion_tokens": 7, "total_tokens": 49},
        ),
        answer(f"Added {MARKER}."),
        traced="1",
    )
    assert await page.outcome(await page.send(f"note {MARKER}")) == {"answer": f"Added {MARKER}."}
    found = await spans(page)
    assert sorted(span["name"] for span in found) == [
        "chat scripted",
        "chat scripted",
        "execute_tool add_note",
        "invoke_agent",
    ]
    assert all(span["ended"] for span in found)
    (turn,) = named(found, "invoke_agent")
    assert turn["kind"] == INTERNAL and turn["parentSpanId"] == ""
    assert turn["attributes"] == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "scripted",
        "toolmesh.turn_id": await page.eval(f"{PAGE}.assistant.state.turnId"),
    }
    assert turn["status"]["code"] == 0
    for child in found:
        if child is not turn:
            assert (child["traceId"], child["parentSpanId"]) == (turn["traceId"], turn["spanId"])
    endpoint = urlsplit(model.url)
    first, second = named(found, "chat scripted")
    assert first["kind"] == CLIENT
    assert first["attributes"] == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "scripted",
        "gen_ai.response.model": "scripted-2026",
        "gen_ai.usage.input_tokens": 42,
        "gen_ai.usage.output_tokens": 7,
        "server.address": endpoint.hostname,
        "server.port": endpoint.port,
    }
    # Without a reported model or usage, the span has neither.
    assert not {"gen_ai.response.model", "gen_ai.usage.input_tokens"} & set(second["attributes"])
    (tool,) = named(found, "execute_tool add_note")
    assert tool["kind"] == INTERNAL
    assert tool["attributes"] == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "add_note",
        "gen_ai.tool.call.id": "call_0",
        "gen_ai.tool.type": "function",
        "toolmesh.turn_id": turn["attributes"]["toolmesh.turn_id"],
    }
    assert await page.eval(f"{PAGE}.notes") == [MARKER]
    assert MARKER not in json.dumps(found)


async def test_a_failed_tool_call_marks_its_span_and_the_turn_goes_on(
    driver: BrowserDriver, model: ScriptedModel
) -> None:
    page = await open_page(driver, model, tool_calls(("fail_note", {})), answer("It failed."), traced="1")
    assert await page.outcome(await page.send("fail")) == {"answer": "It failed."}
    found = await spans(page)
    (tool,) = named(found, "execute_tool fail_note")
    assert tool["attributes"]["error.type"] == "EXECUTION_FAILED"
    assert tool["status"] == {"code": ERROR, "message": "EXECUTION_FAILED"}
    (turn,) = named(found, "invoke_agent")
    assert "error.type" not in turn["attributes"] and turn["status"]["code"] == 0


@pytest.mark.parametrize(
    ("code", "query", "steps"),
    [
        ("MODEL_ERROR", {}, [failure(500)]),
        ("MODEL_ERROR", {}, [raw(b"this is not json")]),
        ("TIMEOUT", {"timeoutMs": "300"}, [Hold()]),
    ],
    ids=["http-500", "not-json", "timeout"],
)
async def test_a_failed_model_call_marks_its_span_and_the_turn_by_the_turn_code(
    driver: BrowserDriver, model: ScriptedModel, code: str, query: dict[str, str], steps: list[Step]
) -> None:
    page = await open_page(driver, model, *steps, traced="1", **query)
    assert await page.outcome(await page.send(f"hello {MARKER}")) == {"code": code}
    # The model call's span ends when its request is aborted, after the turn has.
    await page.wait(f"{PAGE}.spans.every((span) => span.ended)")
    found = await spans(page)
    (chat,) = named(found, "chat scripted")
    (turn,) = named(found, "invoke_agent")
    for span in (chat, turn):
        assert span["attributes"]["error.type"] == code
        assert span["status"] == {"code": ERROR, "message": code}
    assert MARKER not in json.dumps(found)


async def test_a_stopped_turn_ends_its_running_tool_span_as_aborted(
    driver: BrowserDriver, model: ScriptedModel
) -> None:
    page = await open_page(driver, model, tool_calls(("slow_note", {})), traced="1")
    index = await page.send("slow")
    await page.wait(f"{PAGE}.assistant.state.activity?.kind === 'calling'")
    await page.eval(f"{PAGE}.stop()")
    assert await page.outcome(index) == {"code": "ABORTED"}
    found = await spans(page)
    (tool,) = named(found, "execute_tool slow_note")
    (turn,) = named(found, "invoke_agent")
    for span in (tool, turn):
        assert span["ended"] and span["attributes"]["error.type"] == "ABORTED"


async def test_without_a_tracer_provider_there_are_no_spans_and_the_turn_is_the_same(
    driver: BrowserDriver, model: ScriptedModel
) -> None:
    page = await open_page(driver, model, tool_calls(("add_note", {"text": "milk"})), answer("Added it."))
    assert await page.outcome(await page.send("note milk")) == {"answer": "Added it."}
    assert await page.eval(f"{PAGE}.notes") == ["milk"]
    # Nothing registered the API's global: the assistant neither needed nor made one.
    assert await page.eval("globalThis[Symbol.for('opentelemetry.js.api.1')] === undefined")
    assert await spans(page) == []
