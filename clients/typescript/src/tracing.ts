// The handler's span through the page's @opentelemetry/api (an optional peer dependency).
//
// Nothing is imported at run time: the API keeps what a page registered (its tracer provider,
// its context manager) on a global of its major version, which is read here. A page that
// registered no tracer provider gets no span, and pays one property look-up per call.
import type { Context, Span, SpanContext, Tracer } from "@opentelemetry/api";
import type { ToolContext } from "./host.js";

const API = Symbol.for("opentelemetry.js.api.1");
// The API's key of the current span in a Context.
const SPAN_KEY = Symbol.for("OpenTelemetry Context Key SPAN");
// SpanKind.SERVER and SpanStatusCode.ERROR of the API.
const SERVER = 1;
const ERROR = 2;
const TRACEPARENT = /^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$/;

interface RegisteredApi {
  trace?: { getTracer(name: string): Tracer };
  context?: { active(): Context; with<T>(context: Context, run: () => T): T };
}

/** A Context of values, for a page that registered no context manager. */
class Values implements Context {
  constructor(private readonly values: ReadonlyMap<symbol, unknown> = new Map()) {}
  getValue(key: symbol): unknown {
    return this.values.get(key);
  }
  setValue(key: symbol, value: unknown): Context {
    return new Values(new Map(this.values).set(key, value));
  }
  deleteValue(key: symbol): Context {
    const values = new Map(this.values);
    values.delete(key);
    return new Values(values);
  }
}

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
  const api = (globalThis as Record<symbol, RegisteredApi | undefined>)[API];
  if (api?.trace === undefined) {
    return await run();
  }
  const base = api.context?.active() ?? new Values();
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
