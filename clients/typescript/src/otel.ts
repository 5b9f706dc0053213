// The page's @opentelemetry/api (an optional peer dependency), read without importing it.
//
// The API keeps what a page registered (its tracer provider, its context manager) on a global
// of its major version; @toolmesh/host and @toolmesh/assistant read it here. A page that
// registered no tracer provider gets no span, and pays one property look-up per call.
import type { Context, Tracer } from "@opentelemetry/api";

const API = Symbol.for("opentelemetry.js.api.1");
/** The API's key of the current span in a Context. */
export const SPAN_KEY = Symbol.for("OpenTelemetry Context Key SPAN");
/** SpanKind.INTERNAL, SERVER and CLIENT, and SpanStatusCode.ERROR, of the API. */
export const INTERNAL = 0;
export const SERVER = 1;
export const CLIENT = 2;
export const ERROR = 2;

export interface TracingApi {
  trace: { getTracer(name: string): Tracer };
  context?: { active(): Context; with<T>(context: Context, run: () => T): T };
}

/** The API the page registered a tracer provider through; undefined when it registered none. */
export function registeredApi(): TracingApi | undefined {
  const api = (globalThis as Record<symbol, Partial<TracingApi> | undefined>)[API];
  return api?.trace === undefined ? undefined : (api as TracingApi);
}

/** A Context of values, for a page that registered no context manager. */
export class Values implements Context {
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

/** The page's active Context (an empty one without a context manager). */
export function activeContext(api: TracingApi): Context {
  return api.context?.active() ?? new Values();
}
