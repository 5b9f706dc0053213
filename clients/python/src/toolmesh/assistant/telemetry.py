"""The GenAI conventions' model-call span (development, semantic conventions 1.44.0): `chat {model}`.

A CLIENT span around each chat-completions request, with gen_ai.operation.name `chat`,
gen_ai.provider.name, gen_ai.request.model, gen_ai.response.model and the token usage
when the endpoint reports it; error.type is the turn code a failed call ends with.
Never a prompt, a message, a tool's arguments or a result: the conventions' opt-in
content attributes (gen_ai.input.messages, ...) are not built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.trace import SpanKind, Status, StatusCode

from toolmesh.assistant.errors import AssistantError
from toolmesh.core import telemetry

CHAT = "chat"
# The API the endpoint speaks (an OpenAI-compatible one), as the conventions name providers.
PROVIDER = "openai"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"


@contextlib.contextmanager
def _chat_span(model: str, url: str) -> Iterator[Any]:
    parts = urlsplit(url)
    attributes: dict[str, Any] = {
        telemetry.GEN_AI_OPERATION_NAME: CHAT,
        GEN_AI_PROVIDER_NAME: PROVIDER,
        GEN_AI_REQUEST_MODEL: model,
    }
    if parts.hostname:
        attributes["server.address"] = parts.hostname
        attributes["server.port"] = parts.port or (443 if parts.scheme == "https" else 80)
    with telemetry.TRACER.start_as_current_span(
        f"{CHAT} {model}",
        kind=SpanKind.CLIENT,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        try:
            yield current
        except AssistantError as error:
            current.set_attribute(telemetry.ERROR_TYPE, error.code.value)
            current.set_status(Status(StatusCode.ERROR, error.code.value))
            raise
        except Exception as error:
            current.set_attribute(telemetry.ERROR_TYPE, type(error).__qualname__)
            current.set_status(Status(StatusCode.ERROR, type(error).__qualname__))
            raise


def chat_span(model: str, url: str) -> contextlib.AbstractContextManager[Any]:
    """The span of one model call to `url` (none at all when not tracing)."""
    if not telemetry.enabled():
        return telemetry.NO_SPAN
    return _chat_span(model, url)


def record_response(span: Any, body: object) -> None:
    """The response's model and token usage, when the reply says them (numbers only)."""
    if not span.is_recording() or not isinstance(body, dict):
        return
    model = body.get("model")
    if isinstance(model, str) and model:
        span.set_attribute(GEN_AI_RESPONSE_MODEL, model)
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return
    for key, attribute in (
        ("prompt_tokens", GEN_AI_USAGE_INPUT_TOKENS),
        ("completion_tokens", GEN_AI_USAGE_OUTPUT_TOKENS),
    ):
        count = usage.get(key)
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            span.set_attribute(attribute, count)
