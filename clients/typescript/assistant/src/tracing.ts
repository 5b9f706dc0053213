// The assistant's spans in the GenAI conventions' names (development, semantic conventions
// 1.44.0), through the page's @opentelemetry/api when it registered a tracer provider (read from
// the API's global, as @toolmesh/host does: nothing imported at run time). A turn is an INTERNAL
// `invoke_agent` span; each model call a CLIENT `chat {model}` span and each tool call (webmcp()
// or toolmesh()) an INTERNAL `execute_tool {tool}` span, its children; a toolmesh() call sends its
// span's W3C context with each RunTool attempt, so the services' spans join the turn's trace.
// Never a prompt, a message, an argument or a result: the conventions' opt-in content attributes
// are not built.
import type { Attributes, Context, Span } from "@opentelemetry/api";
import { ERROR, INTERNAL, SPAN_KEY, activeContext, registeredApi } from "../../src/otel.js";
import { AgentError } from "./errors.js";

export { CLIENT, INTERNAL } from "../../src/otel.js";

/** The API the endpoint speaks (an OpenAI-compatible one), as the conventions name providers. */
export const PROVIDER = "openai";

// A browser carries no context across awaits, and ChatModel.complete and ToolChannel.invoke are
// public signatures: a call's parent is found by the AbortSignal the assistant gives the call.
const parents = new WeakMap<AbortSignal, Context>();

/** A started span and the Context whose current span it is. */
export interface Traced {
  readonly span: Span;
  readonly context: Context;
}

/** Start `name`, the child of the span `signal` was given for (else of the active context); undefined without a tracer provider. */
export function startSpan(name: string, kind: number, attributes: Attributes, signal?: AbortSignal): Traced | undefined {
  const api = registeredApi();
  if (api === undefined) return undefined;
  const parent = (signal === undefined ? undefined : parents.get(signal)) ?? activeContext(api);
  const span = api.trace.getTracer("@toolmesh/assistant").startSpan(name, { kind, attributes }, parent);
  return { span, context: parent.setValue(SPAN_KEY, span) };
}

/** Calls given `signal` make their spans children of `traced`'s span. */
export function parentFor(signal: AbortSignal, traced: Traced | undefined): void {
  if (traced !== undefined) parents.set(signal, traced.context);
}

/** The `execute_tool {tool}` span of one tool call, the child of its turn's span (via `signal`). */
export function startToolSpan(
  toolName: string,
  turnId: string,
  callId: string | undefined,
  signal: AbortSignal,
): Traced | undefined {
  return startSpan(
    `execute_tool ${toolName}`,
    INTERNAL,
    {
      "gen_ai.operation.name": "execute_tool",
      "gen_ai.tool.name": toolName,
      ...(callId === undefined ? {} : { "gen_ai.tool.call.id": callId }),
      "gen_ai.tool.type": "function",
      "toolmesh.turn_id": turnId,
    },
    signal,
  );
}

/** The W3C trace context headers (traceparent, tracestate) that make a request `traced`'s child. */
export function traceHeaders(traced: Traced | undefined): Record<string, string> {
  if (traced === undefined) return {};
  const { traceId, spanId, traceFlags, traceState } = traced.span.spanContext();
  const headers: Record<string, string> = {
    traceparent: `00-${traceId}-${spanId}-${(traceFlags & 0xff).toString(16).padStart(2, "0")}`,
  };
  const state = traceState?.serialize() ?? "";
  if (state !== "") headers["tracestate"] = state;
  return headers;
}

/** End the span; a failure marks it by its turn code (or the thrown value's type), never its text. */
export function endSpan(traced: Traced | undefined, failed?: unknown): void {
  if (traced === undefined) return;
  if (failed !== undefined) {
    const type =
      failed instanceof AgentError ? failed.code : failed instanceof Error ? failed.name : typeof failed;
    traced.span.setAttribute("error.type", type);
    traced.span.setStatus({ code: ERROR, message: type });
  }
  traced.span.end();
}

/** server.address and server.port of the endpoint `url` (relative to the page). */
export function serverAttributes(url: string): Attributes {
  try {
    const parsed = new URL(url, globalThis.location?.href);
    const port = parsed.port ? Number(parsed.port) : parsed.protocol === "https:" ? 443 : 80;
    return { "server.address": parsed.hostname, "server.port": port };
  } catch {
    return {};
  }
}

const isRecord = (value: unknown): value is { readonly [key: string]: unknown } =>
  typeof value === "object" && value !== null && !Array.isArray(value);

/** The reply's model and token usage, when it says them (a name and numbers only). */
export function recordResponse(traced: Traced | undefined, body: unknown): void {
  if (traced === undefined || !isRecord(body)) return;
  const model = body["model"];
  if (typeof model === "string" && model) traced.span.setAttribute("gen_ai.response.model", model);
  const usage = body["usage"];
  if (!isRecord(usage)) return;
  for (const [key, attribute] of [
    ["prompt_tokens", "gen_ai.usage.input_tokens"],
    ["completion_tokens", "gen_ai.usage.output_tokens"],
  ] as const) {
    const count = usage[key];
    if (typeof count === "number" && Number.isInteger(count) && count >= 0) traced.span.setAttribute(attribute, count);
  }
}
