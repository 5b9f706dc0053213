// The handler's span through the page's @opentelemetry/api (an optional peer dependency,
// read from its registered global: otel.ts).
import type { Context, Span, SpanContext } from "@opentelemetry/api";
import type { ToolContext } from "./host.js";
import { ERROR, SERVER, SPAN_KEY, activeContext, registeredApi } from "./otel.js";

const TRACEPARENT = /^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$/;

/** The request's W3C trace context as the API's remote parent; undefined when it carries none. */
function remoteParent(traceContext: Readonly<Record<string, string>>): SpanContext | undefined {
  const parsed = TRACEPARENT.exec(traceContext["traceparent"] ?? "");
  if (parsed === null || /^0+$/.test(parsed[1]!) || /^0+$/.test(parsed[2]!)) {
    return undefined;
  }
  return { traceId: parsed[1]!, spanId: parsed[2]!, traceFlags: Number.parseInt(parsed[3]!, 16), isRemote: true };
}

/** A span that only carries a context: what the API calls a non-recording span. */
function carrying(spanContext: SpanContext): Span {
  const span: Span = {
    spanContext: () => spanContext,
    setAttribute: () => span,
    setAttributes: () => span,
    addEvent: () => span,
    addLink: () => span,
    addLinks: () => span,
    setStatus: () => span,
    updateName: () => span,
    end: () => undefined,
    isRecording: () => false,
    recordException: () => undefined,
  };
  return span;
}

/**
 * Run the handler inside an `execute_tool {tool}` SERVER span, the child of the request's trace
 * context (the GenAI conventions' names, as the Python host's); when the page registered no
 * tracer provider, just run it. A throw marks the span TOOL_HANDLER_ERROR by type only.
 */
export async function inHandlerSpan<T>(ctx: ToolContext, run: () => T | Promise<T>): Promise<T> {
  const api = registeredApi();
  if (api === undefined) {
    return await run();
  }
  const base: Context = activeContext(api);
  const parent = remoteParent(ctx.traceContext);
  const parentContext = parent === undefined ? base : base.setValue(SPAN_KEY, carrying(parent));
  const span = api.trace.getTracer("@toolmesh/host").startSpan(
    `execute_tool ${ctx.toolName}`,
    {
      kind: SERVER,
      attributes: {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": ctx.toolName,
        "gen_ai.tool.call.id": ctx.toolRequestId,
        "gen_ai.tool.type": "function",
        "toolmesh.session_id": ctx.sessionId,
        "toolmesh.turn_id": ctx.turnId,
        "toolmesh.tool_name": ctx.toolName,
        "toolmesh.tool_request_id": ctx.toolRequestId,
      },
    },
    parentContext,
  );
  const current = parentContext.setValue(SPAN_KEY, span);
  try {
    return await (api.context === undefined ? run() : api.context.with(current, run));
  } catch (thrown) {
    // Never the exception's text: it may quote arguments.
    span.setAttribute("error.type", "TOOL_HANDLER_ERROR");
    span.setStatus({ code: ERROR, message: thrown instanceof Error ? thrown.name : typeof thrown });
    throw thrown;
  } finally {
    span.end();
  }
}
