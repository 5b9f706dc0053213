"""ChatModel over an OpenAI-compatible chat-completions endpoint, through httpx."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import httpx

from toolmesh.assistant.config import ModelEndpoint
from toolmesh.assistant.errors import AssistantError, TurnCode
from toolmesh.assistant.messages import Author, Message, ToolCallRequest
from toolmesh.assistant.model import FunctionTool, ModelReply
from toolmesh.assistant.telemetry import chat_span, record_response
from toolmesh.core import jsontext

# A reply larger than this is not a chat answer.
MAX_REPLY_BYTES = 4 * 1024 * 1024


class OpenAIChatModel:
    """ChatModel over an OpenAI-compatible chat-completions endpoint with tool calling.

    Args:
        endpoint: The endpoint's URL, model name, API key and timeout.
        system_prompt: Sent first in every request, when not empty.
        client: An httpx client to use instead of making one (it is then not closed here).
    """

    def __init__(
        self, endpoint: ModelEndpoint, *, system_prompt: str = "", client: httpx.AsyncClient | None = None
    ) -> None:
        self._endpoint = endpoint
        self._system_prompt = system_prompt
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(endpoint.timeout_s))

    async def complete(self, messages: Sequence[Message], tools: Sequence[FunctionTool]) -> ModelReply:
        """POST the conversation and tools; the reply's text and tool calls.

        Raises AssistantError with TIMEOUT when no answer came within the
        endpoint's timeout, and MODEL_ERROR when the endpoint cannot be reached,
        answers HTTP 4xx/5xx, or replies with something unusable.
        """
        with chat_span(self._endpoint.model, self._endpoint.chat_url) as span:
            answer = _json_of(await self._post(messages, tools))
            record_response(span, answer)
            return reply_of(answer)

    async def _post(self, messages: Sequence[Message], tools: Sequence[FunctionTool]) -> bytes:
        """The endpoint's reply to the conversation, as bytes; AssistantError as `complete` says."""
        body = request_body(self._endpoint.model, messages, tools, self._system_prompt)
        headers = {"Authorization": f"Bearer {self._endpoint.api_key}"} if self._endpoint.api_key else {}
        timeout = self._endpoint.timeout_s
        try:
            # httpx's timeout bounds each phase; this bounds the whole call.
            async with asyncio.timeout(timeout):
                response = await self._client.post(self._endpoint.chat_url, json=body, headers=headers)
        except (TimeoutError, httpx.TimeoutException):
            raise AssistantError(
                TurnCode.TIMEOUT, f"The model did not answer within {timeout:g} s."
            ) from None
        except httpx.HTTPError as exc:
            # The transport's own words (connection refused, name not known), never the request.
            cause = (
                f"{type(exc).__name__}: {exc}"
                if isinstance(exc, httpx.TransportError)
                else type(exc).__name__
            )
            raise AssistantError(
                TurnCode.MODEL_ERROR,
                f"The model endpoint {self._endpoint.chat_url} could not be reached ({cause}).",
            ) from None
        if response.status_code >= 400:
            raise AssistantError(
                TurnCode.MODEL_ERROR,
                f"The model endpoint {self._endpoint.chat_url} answered HTTP {response.status_code}.",
            )
        return response.content

    async def close(self) -> None:
        """Close the httpx client, if this model made it."""
        if self._own_client:
            await self._client.aclose()


def request_body(
    model: str, messages: Sequence[Message], tools: Sequence[FunctionTool], system_prompt: str = ""
) -> dict[str, Any]:
    """The chat-completions request body for the conversation, with the tools as functions."""
    wire = [{"role": "system", "content": system_prompt}] if system_prompt else []
    wire += [_message(message) for message in messages]
    body: dict[str, Any] = {"model": model, "messages": wire}
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
            }
            for t in tools
        ]
    return body


def _message(message: Message) -> dict[str, Any]:
    if message.role is Author.TOOL:
        assert message.call is not None
        return {"role": "tool", "tool_call_id": message.call.id, "content": message.text}
    if message.role is Author.USER or not message.tool_calls:
        return {"role": message.role.value, "content": message.text}
    return {
        "role": "assistant",
        "content": message.text or None,
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in message.tool_calls
        ],
    }


def _unusable(detail: str) -> AssistantError:
    return AssistantError(TurnCode.MODEL_ERROR, f"The model's reply is unusable: {detail}.")


def parse_reply(content: bytes) -> ModelReply:
    """Read a chat-completions reply; raise AssistantError(MODEL_ERROR) for anything unusable."""
    return reply_of(_json_of(content))


def _json_of(content: bytes) -> Any:
    if len(content) > MAX_REPLY_BYTES:
        raise _unusable(f"it is larger than {MAX_REPLY_BYTES} bytes")
    try:
        return jsontext.parse(content.decode())
    except (UnicodeDecodeError, jsontext.NotPlainJson):
        raise _unusable("it is not JSON") from None


def reply_of(body: Any) -> ModelReply:
    """The reply a parsed chat-completions body holds; AssistantError(MODEL_ERROR) if unusable."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _unusable("it has no choices")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise _unusable("its first choice has no message")
    text = message.get("content")
    if text is not None and not isinstance(text, str):
        raise _unusable("its content is not text")
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise _unusable("its tool_calls is not a list")
    calls = tuple(_tool_call(raw) for raw in raw_calls)
    if text is None and not calls:
        raise _unusable("it has neither text nor tool calls")
    return ModelReply(text or "", calls)


def _tool_call(raw: object) -> ToolCallRequest:
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or not isinstance(function, dict):
        raise _unusable("a tool call has no function")
    call_id, name, arguments = raw.get("id"), function.get("name"), function.get("arguments", "{}")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise _unusable("a tool call lacks an id or a name")
    if isinstance(arguments, dict):  # some servers send an object rather than JSON text
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise _unusable("a tool call's arguments are not text")
    return ToolCallRequest(call_id, name, arguments)
