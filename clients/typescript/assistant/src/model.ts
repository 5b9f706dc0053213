// The model: an OpenAI-compatible chat-completions endpoint, called from the page. The page
// holds no provider key: point `url` at a same-origin relay that adds it (README, "Relay").
import { AgentError } from "./errors.js";
import type { JsonValue, ToolResult } from "./results.js";
import { CLIENT, PROVIDER, endSpan, recordResponse, serverAttributes, startSpan } from "./tracing.js";

/** One tool call the model asked for; the arguments as the model wrote them. */
export interface ToolCallRequest {
  readonly id: string;
  readonly name: string;
  readonly argumentsJson: string;
}

/** One message of the conversation. */
export type Message =
  | { readonly role: "user"; readonly text: string }
  | { readonly role: "assistant"; readonly text: string; readonly toolCalls: readonly ToolCallRequest[] }
  | { readonly role: "tool"; readonly text: string; readonly call: ToolCallRequest; readonly result: ToolResult };

/** A tool as the model is offered it. */
export interface FunctionTool {
  readonly name: string;
  readonly description: string;
  readonly parameters: JsonValue;
}

export interface ModelReply {
  readonly text: string;
  readonly toolCalls: readonly ToolCallRequest[];
}

/** Plans the turns: any object with `complete`; `chatCompletions()` makes one for an endpoint. */
export interface ChatModel {
  /** Raise AgentError(MODEL_ERROR) for a failed or unusable answer; stop when `signal` aborts. */
  complete(messages: readonly Message[], tools: readonly FunctionTool[], signal: AbortSignal): Promise<ModelReply>;
}

export interface ModelEndpoint {
  /** The API's base (`/v1`, POSTed at `/v1/chat/completions`) or the full chat-completions URL. */
  readonly url: string;
  /** The model's name. */
  readonly model: string;
  /** Sent first in every request, when given. */
  readonly systemPrompt?: string;
  /** Extra headers (never a provider key: the relay adds that). */
  readonly headers?: Readonly<Record<string, string>>;
  /** The fetch to use; default globalThis.fetch. */
  readonly fetch?: typeof fetch;
}

// A reply larger than this is not a chat answer.
const MAX_REPLY_CHARS = 4 * 1024 * 1024;

export function chatUrl(url: string): string {
  return /\/chat\/completions\/?$/.test(url) ? url : `${url.replace(/\/+$/, "")}/chat/completions`;
}

/** The chat-completions request body for the conversation, with the tools as functions. */
export function requestBody(
  model: string,
  messages: readonly Message[],
  tools: readonly FunctionTool[],
  systemPrompt = "",
): { [key: string]: JsonValue } {
  const wire: JsonValue[] = systemPrompt ? [{ role: "system", content: systemPrompt }] : [];
  for (const message of messages) {
    if (message.role === "tool") {
      wire.push({ role: "tool", tool_call_id: message.call.id, content: message.text });
    } else if (message.role === "user" || message.toolCalls.length === 0) {
      wire.push({ role: message.role, content: message.text });
    } else {
      wire.push({
        role: "assistant",
        content: message.text || null,
        tool_calls: message.toolCalls.map((c) => ({
          id: c.id,
          type: "function",
          function: { name: c.name, arguments: c.argumentsJson },
        })),
      });
    }
  }
  const body: { [key: string]: JsonValue } = { model, messages: wire };
  if (tools.length > 0) {
    body["tools"] = tools.map((t) => ({
      type: "function",
      function: { name: t.name, description: t.description, parameters: t.parameters },
    }));
  }
  return body;
}

const unusable = (detail: string): AgentError => new AgentError("MODEL_ERROR", `The model's reply is unusable: ${detail}.`);
const isRecord = (value: unknown): value is { readonly [key: string]: unknown } =>
  typeof value === "object" && value !== null && !Array.isArray(value);

/** Read a chat-completions reply; raise AgentError(MODEL_ERROR) for anything unusable. */
export function parseReply(content: string): ModelReply {
  return replyOf(parseBody(content));
}

function parseBody(content: string): unknown {
  if (content.length > MAX_REPLY_CHARS) throw unusable(`it is larger than ${MAX_REPLY_CHARS} characters`);
  try {
    return JSON.parse(content);
  } catch {
    throw unusable("it is not JSON");
  }
}

function replyOf(body: unknown): ModelReply {
  const choices = isRecord(body) ? body["choices"] : undefined;
  if (!Array.isArray(choices) || !isRecord(choices[0])) throw unusable("it has no choices");
  const message = choices[0]["message"];
  if (!isRecord(message)) throw unusable("its first choice has no message");
  const text = message["content"];
  if (text !== null && text !== undefined && typeof text !== "string") throw unusable("its content is not text");
  const rawCalls = message["tool_calls"] ?? [];
  if (!Array.isArray(rawCalls)) throw unusable("its tool_calls is not a list");
  const toolCalls = rawCalls.map((raw: unknown): ToolCallRequest => {
    const fn = isRecord(raw) ? raw["function"] : undefined;
    if (!isRecord(raw) || !isRecord(fn)) throw unusable("a tool call has no function");
    const id = raw["id"];
    const name = fn["name"];
    let args = fn["arguments"] ?? "{}";
    if (typeof id !== "string" || !id || typeof name !== "string" || !name) {
      throw unusable("a tool call lacks an id or a name");
    }
    if (isRecord(args)) args = JSON.stringify(args); // some servers send an object, not JSON text
    if (typeof args !== "string") throw unusable("a tool call's arguments are not text");
    return { id, name, argumentsJson: args };
  });
  if ((text === null || text === undefined) && toolCalls.length === 0) {
    throw unusable("it has neither text nor tool calls");
  }
  return { text: typeof text === "string" ? text : "", toolCalls };
}

/**
 * A ChatModel over an OpenAI-compatible chat-completions endpoint with tool calling.
 * MODEL_ERROR when the endpoint cannot be reached, answers HTTP 4xx/5xx, or replies with
 * something unusable; the assistant's `timeoutMs` and `cancel()` abort the request.
 */
export function chatCompletions(endpoint: ModelEndpoint): ChatModel {
  const url = chatUrl(endpoint.url);
  const doFetch = endpoint.fetch ?? ((input: RequestInfo | URL, init?: RequestInit) => fetch(input, init));
  return {
    async complete(messages, tools, signal) {
      const traced = startSpan(
        `chat ${endpoint.model}`,
        CLIENT,
        {
          "gen_ai.operation.name": "chat",
          "gen_ai.provider.name": PROVIDER,
          "gen_ai.request.model": endpoint.model,
          ...serverAttributes(url),
        },
        signal,
      );
      try {
        const body = parseBody(await post(messages, tools, signal));
        recordResponse(traced, body);
        const reply = replyOf(body);
        endSpan(traced);
        return reply;
      } catch (error) {
        endSpan(traced, error);
        throw error;
      }
    },
  };

  async function post(messages: readonly Message[], tools: readonly FunctionTool[], signal: AbortSignal): Promise<string> {
    const body = requestBody(endpoint.model, messages, tools, endpoint.systemPrompt ?? "");
    let response: Response;
    let content: string;
    try {
      response = await doFetch(url, {
        method: "POST",
        headers: { "content-type": "application/json", ...endpoint.headers },
        body: JSON.stringify(body),
        signal,
      });
      content = await response.text();
    } catch (error) {
      if (signal.aborted) throw signal.reason;
      throw new AgentError(
        "MODEL_ERROR",
        `The model endpoint ${url} could not be reached (${(error as Error)?.name ?? "error"}).`,
      );
    }
    if (response.status >= 400) {
      throw new AgentError("MODEL_ERROR", `The model endpoint ${url} answered HTTP ${response.status}.`);
    }
    return content;
  }
}
