// A tracer provider for the browser tests, registered through the real @opentelemetry/api: it
// keeps every span it starts (name, ids, parent, attributes, status) for the test to read.
import {
  trace,
  type Attributes,
  type Context,
  type Span,
  type SpanOptions,
  type SpanStatus,
  type Tracer,
  type TracerProvider,
} from "@opentelemetry/api";

export interface CollectedSpan {
  name: string;
  kind: number | undefined;
  traceId: string;
  spanId: string;
  parentSpanId: string;
  attributes: Attributes;
  status: SpanStatus;
  ended: boolean;
}

function hex(bytes: number): string {
  const random = crypto.getRandomValues(new Uint8Array(bytes));
  return Array.from(random, (b) => b.toString(16).padStart(2, "0")).join("");
}

export function registerCollectingTracer(): CollectedSpan[] {
  const spans: CollectedSpan[] = [];
  const tracer: Tracer = {
    startSpan(name: string, options: SpanOptions = {}, context?: Context): Span {
      const parent = context === undefined ? undefined : trace.getSpanContext(context);
      const collected: CollectedSpan = {
        name,
        kind: options.kind,
        traceId: parent?.traceId ?? hex(16),
        spanId: hex(8),
        parentSpanId: parent?.spanId ?? "",
        attributes: { ...options.attributes },
        status: { code: 0 },
        ended: false,
      };
      spans.push(collected);
      const span: Span = {
        spanContext: () => ({ traceId: collected.traceId, spanId: collected.spanId, traceFlags: 1 }),
        setAttribute: (key, value) => {
          if (value !== undefined) collected.attributes[key] = value;
          return span;
        },
        setAttributes: (attributes) => {
          Object.assign(collected.attributes, attributes);
          return span;
        },
        addEvent: () => span,
        addLink: () => span,
        addLinks: () => span,
        setStatus: (status) => {
          collected.status = status;
          return span;
        },
        updateName: (renamed) => {
          collected.name = renamed;
          return span;
        },
        end: () => {
          collected.ended = true;
        },
        isRecording: () => true,
        recordException: () => undefined,
      };
      return span;
    },
    startActiveSpan(): never {
      throw new Error("not used by @toolmesh/host or @toolmesh/assistant");
    },
  };
  const provider: TracerProvider = { getTracer: () => tracer };
  trace.setGlobalTracerProvider(provider);
  return spans;
}
