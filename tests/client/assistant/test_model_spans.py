"""The assistant's model calls as GenAI `chat {model}` client spans, against the scripted model.

The spans carry the model, the provider and the token usage the endpoint reports, and never
a prompt, a message, an argument or a result.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from scripted_model import ScriptedModel, failure, raw
from spans import hear_in_process
from toolmesh.assistant.chat_completions import OpenAIChatModel
from toolmesh.assistant.config import ModelEndpoint
from toolmesh.assistant.errors import AssistantError, TurnCode
from toolmesh.assistant.messages import Author, Message, ToolCallRequest
from toolmesh.assistant.model import FunctionTool

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SPANS = InMemorySpanExporter()
MARKER = "private-words-4f1c"
MODEL = "scripted-model-1"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def model() -> AsyncIterator[tuple[ScriptedModel, OpenAIChatModel]]:
    hear_in_process(SPANS)
    server = await ScriptedModel().start()
    chat = OpenAIChatModel(ModelEndpoint(server.url, MODEL, api_key=MARKER), system_prompt=MARKER)
    yield server, chat
    await chat.close()
    await server.stop()


def completion(*, usage: dict[str, int] | None) -> bytes:
    message = {
        "role": "assistant",
        "content": f"the answer is {MARKER}",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "look", "arguments": json.dumps({"q": MARKER})},
            }
        ],
    }
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "model": f"{MODEL}-2026",
        "choices": [{"index": 0, "message": message}],
    }
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body).encode()


CONVERSATION = [
    Message(Author.USER, f"tell me {MARKER}"),
    Message(Author.ASSISTANT, "", tool_calls=(ToolCallRequest("call_0", "look", json.dumps({"q": MARKER})),)),
]
TOOLS = [FunctionTool("look", f"looks up {MARKER}", {"type": "object"})]


def chat_spans() -> list[ReadableSpan]:
    return [span for span in SPANS.get_finished_spans() if span.name == f"chat {MODEL}"]


def no_content(span: ReadableSpan) -> None:
    """No attribute, event or status of the span quotes what was said."""
    assert span.attributes is not None
    texts = [str(value) for value in span.attributes.values()]
    texts += [str(event.attributes) for event in span.events]
    texts.append(str(span.status.description))
    assert not any(MARKER in text for text in texts), texts


async def test_a_model_call_is_a_chat_span_with_the_usage_reported(
    model: tuple[ScriptedModel, OpenAIChatModel],
) -> None:
    server, chat = model
    server.script(raw(completion(usage={"prompt_tokens": 42, "completion_tokens": 7, "total_tokens": 49})))
    SPANS.clear()
    reply = await chat.complete(CONVERSATION, TOOLS)
    assert MARKER in reply.text  # the words did travel: only the span leaves them out
    (span,) = chat_spans()
    assert span.kind is SpanKind.CLIENT
    assert span.attributes is not None
    assert dict(span.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": f"{MODEL}-2026",
        "gen_ai.usage.input_tokens": 42,
        "gen_ai.usage.output_tokens": 7,
        "server.address": "127.0.0.1",
        "server.port": server.port,
    }
    assert span.status.status_code is StatusCode.UNSET
    no_content(span)


async def test_without_usage_the_span_has_no_token_counts(
    model: tuple[ScriptedModel, OpenAIChatModel],
) -> None:
    server, chat = model
    server.script(raw(completion(usage=None)))
    SPANS.clear()
    await chat.complete(CONVERSATION, TOOLS)
    (span,) = chat_spans()
    assert span.attributes is not None
    assert "gen_ai.usage.input_tokens" not in span.attributes
    assert "gen_ai.usage.output_tokens" not in span.attributes
    no_content(span)


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        (failure(500), TurnCode.MODEL_ERROR),
        (raw(f'{{"choices": "{MARKER}"}}'.encode()), TurnCode.MODEL_ERROR),
    ],
)
async def test_a_failed_model_call_names_its_turn_code(
    model: tuple[ScriptedModel, OpenAIChatModel], reply: object, code: TurnCode
) -> None:
    server, chat = model
    server.script(reply)  # type: ignore[arg-type]
    SPANS.clear()
    with pytest.raises(AssistantError) as failed:
        await chat.complete(CONVERSATION, TOOLS)
    assert failed.value.code is code
    (span,) = chat_spans()
    assert span.attributes is not None
    assert span.attributes["error.type"] == code.value
    assert span.status.status_code is StatusCode.ERROR
    no_content(span)
