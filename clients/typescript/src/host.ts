import { create } from "@bufbuild/protobuf";
import type { Transport } from "@connectrpc/connect";
import { createConnectTransport, createGrpcWebTransport } from "@connectrpc/connect-web";
import { ToolDefinitionSchema, type ToolDefinition } from "./gen/toolmesh/v1/tool_pb.js";
import { HostEngine } from "./engine.js";
import { healthUrl } from "./replicas.js";
import type { HostError } from "./errors.js";
import { RECONNECT_BACKOFF_MAX_MS } from "./gen/tables.js";

/** What a handler is told about the call it serves. */
export interface ToolContext {
  readonly sessionId: string;
  readonly turnId: string;
  readonly toolRequestId: string;
  readonly toolName: string;
  /**
   * When the runtime stops waiting for the result, in Date.now() milliseconds: the request's
   * deadline on the bridge's clock, at the earliest it may be on the page's clock (bounded from the
   * bridge's answers to the stream's opening and to read checks).
   */
  readonly deadline: number;
  /**
   * Aborted when the runtime tells the host to stop the call: its deadline
   * passed (reason: a "TimeoutError" DOMException) or it was cancelled, or
   * the host stopped ("AbortError"). After that, whatever the handler
   * returns is not delivered (the call has ended): onError hears of it, as
   * SUBMIT_TOOL_RESULT_FAILED with cause REQUEST_ENDED (or SHUTTING_DOWN).
   */
  readonly signal: AbortSignal;
  /**
   * The W3C trace context the request carries (`traceparent`, `tracestate`; empty when the
   * runtime does not trace), for the handler's own spans. With a tracer provider registered
   * through @opentelemetry/api, the handler already runs in an `execute_tool` span, its child.
   */
  readonly traceContext: Readonly<Record<string, string>>;
  /** Milliseconds left before the deadline, 0 when it has passed. */
  timeRemainingMs(): number;
  /**
   * Tell the call's callers how far the handler has got: `progress` on the
   * handler's own scale (finite, growing from one report to the next),
   * `total` the value it reaches when done (when known, above 0), `message`
   * for people (cut to 512 characters; never arguments or results). Best
   * effort: the promise never rejects, a report the bridge drops is
   * forgotten, and at most ten reports a second reach the callers (the
   * latest ones). Progress never changes the outcome nor extends the deadline.
   */
  reportProgress(progress: number, total?: number, message?: string): Promise<void>;
}

/** A JSON object: the arguments of a call. */
export type ToolArguments = Record<string, unknown>;

/**
 * Serves one tool. It returns the result (plain JSON), or
 * `{ error: { code, message, details?, retryable? } }` for a domain error, or
 * a promise of either. What it throws becomes TOOL_HANDLER_ERROR.
 */
export type ToolHandler = (args: ToolArguments, ctx: ToolContext) => unknown;

/** Hints about a tool's behaviour, as in toolmesh's ToolAnnotations. */
export interface ToolAnnotations {
  /** The tool only reads state; running it twice changes nothing. */
  readOnly?: boolean;
  /** Running it again with the same arguments has no further effect. */
  idempotent?: boolean;
  /** A person must confirm before it runs. */
  requiresConfirmation?: boolean;
}

/** A tool's definition, declared by the host so that no separate `tools put` is needed. */
export interface ToolDeclaration {
  description: string;
  /** JSON Schema (2020-12 or draft-07) of the arguments; an object. Default `{ "type": "object" }`. */
  inputSchema?: Record<string, unknown>;
  /** JSON Schema of the result. */
  outputSchema?: Record<string, unknown>;
  /** How long the runtime waits for a result; 0 or absent: its default (60 s). */
  timeoutMs?: number;
  annotations?: ToolAnnotations;
}

export interface ToolHostOptions {
  /**
   * The bridge's port for pages, e.g. "http://127.0.0.1:7404"; or several bridge replicas' ports:
   * the host connects to one and, when its stream breaks, to the next. A result whose replica was
   * lost while the handler ran is handed in on the next connection. Ignored when `transport` is given.
   */
  baseUrl?: string | readonly string[];
  /** The session (thread) whose tools this page serves. */
  sessionId: string;
  /** A name for the host in the bridge's logs; default the page's origin and path. */
  hostName?: string;
  /** "connect" (default) or "grpc-web". Ignored when `transport` is given. */
  protocol?: "connect" | "grpc-web";
  /** A transport of your own (interceptors for credentials, another fetch); or one per bridge replica, as for `baseUrl`. */
  transport?: Transport | readonly Transport[];
  /** Longest wait between reconnection attempts, in ms (default 1000: a bridge that comes back is reached within about a second). */
  maxBackoffMs?: number;
  /**
   * The bearer token (role host, naming this session) sent as `authorization: Bearer` on every
   * request, when the bridge requires tokens: a string, or a function asked before each request
   * (keep it cheap: cache the token until shortly before it expires). A host stream ends when the
   * token it was opened with expires: ahead of that (30 s before its `exp`, or after two thirds of
   * its remaining life when shorter), the host opens a replacement stream with the function's
   * current token, and hands in the results of the old stream's requests there, so no call is lost.
   */
  token?: string | (() => string | Promise<string>);
}

interface Registered {
  readonly handler: ToolHandler;
  readonly declaration: ToolDeclaration | undefined;
}

/**
 * One handler host for one session, inside a page: it opens a host session
 * with the bridge over Connect or gRPC-Web, runs the tool requests it
 * receives (each once the bridge says START: one it never started when the
 * page reloads runs after the reload instead), and hands each outcome back. It reconnects with backoff whenever
 * the stream drops or the bridge's heartbeats stop, and declares its tools
 * again each time. (The connection itself is src/engine.ts.)
 */
export class ToolHost {
  readonly sessionId: string;
  readonly hostName: string;

  private readonly handlers = new Map<string, Registered>();
  private generic: ToolHandler | undefined;
  private readonly errorCallbacks = new Set<(error: HostError) => void>();
  private readonly engine: HostEngine;

  constructor(options: ToolHostOptions) {
    this.sessionId = options.sessionId;
    this.hostName = (options.hostName ?? defaultHostName()).slice(0, 128);
    this.engine = new HostEngine(
      {
        sessionId: this.sessionId,
        hostName: this.hostName,
        transports: transportsFor(options),
        // A transport of the page's own may lead anywhere: only base URLs say where to ask.
        healthUrls: customTransports(options).length === 0 ? baseUrls(options).map(healthUrl) : undefined,
        maxBackoffMs: options.maxBackoffMs ?? RECONNECT_BACKOFF_MAX_MS,
        token: options.token,
      },
      {
        handlerNames: () => [...this.handlers.keys()].sort(),
        hasGenericHandler: () => this.generic !== undefined,
        handlerFor: (toolName) => this.handlers.get(toolName)?.handler ?? this.generic,
        definitions: () => this.definitions(),
        report: (error) => this.report(error),
      },
    );
  }

  /** The current host session's id; empty while not connected. */
  get hostSessionId(): string {
    return this.engine.hostSessionId;
  }

  /**
   * Serve `name` with `handler`. With a `declaration`, the tool's definition
   * goes into the session's list (now if connected, else on connecting).
   * Returns a function that removes the handler (and withdraws the declaration).
   */
  onTool(name: string, handler: ToolHandler, declaration?: ToolDeclaration): () => void {
    const registered: Registered = { handler, declaration };
    this.handlers.set(name, registered);
    if (declaration !== undefined) {
      this.engine.redeclare();
    }
    return () => {
      if (this.handlers.get(name) === registered) {
        this.handlers.delete(name);
        if (declaration !== undefined) {
          this.engine.redeclare();
        }
      }
    };
  }

  /** Serve every tool without a named handler; `ctx.toolName` says which. */
  onAny(handler: ToolHandler): void {
    this.generic = handler;
  }

  /** Be told of handler errors and results that could not be handed back. Returns an unsubscribe function. */
  onError(callback: (error: HostError) => void): () => void {
    this.errorCallbacks.add(callback);
    return () => this.errorCallbacks.delete(callback);
  }

  /** Whether a host session is open now. */
  get connected(): boolean {
    return this.engine.connected;
  }

  /**
   * Connect in the background, reconnecting whenever the stream drops; resolve
   * once the first host session is open and the declared tools were sent.
   * Rejects when that took longer than `timeoutMs`, or at once when the bridge
   * refuses the host (its token: UNAUTHENTICATED, PERMISSION_DENIED; the error
   * names the code, and `onError` hears of it); the host keeps trying until `stop()`.
   */
  async start(options: { timeoutMs?: number } = {}): Promise<void> {
    this.engine.start();
    await this.engine.ready(options.timeoutMs ?? 10_000);
  }

  /** Close the host session, abort every running handler's signal, and stop reconnecting. */
  async stop(): Promise<void> {
    await this.engine.stop();
  }

  /** The declared tools' definitions, in the order they were registered. */
  private definitions(): ToolDefinition[] {
    const tools: ToolDefinition[] = [];
    for (const [name, registered] of this.handlers) {
      if (registered.declaration !== undefined) {
        tools.push(toDefinition(name, registered.declaration));
      }
    }
    return tools;
  }

  private report(error: HostError): void {
    for (const callback of this.errorCallbacks) {
      try {
        callback(error);
      } catch {
        // One callback's failure must not keep the others from hearing.
      }
    }
  }
}

function toDefinition(name: string, declaration: ToolDeclaration): ToolDefinition {
  return create(ToolDefinitionSchema, {
    name,
    description: declaration.description,
    inputSchemaJson: JSON.stringify(declaration.inputSchema ?? { type: "object" }),
    outputSchemaJson: declaration.outputSchema === undefined ? "" : JSON.stringify(declaration.outputSchema),
    timeoutMs: declaration.timeoutMs ?? 0,
    annotations: {
      readOnly: declaration.annotations?.readOnly ?? false,
      idempotent: declaration.annotations?.idempotent ?? false,
      requiresConfirmation: declaration.annotations?.requiresConfirmation ?? false,
    },
  });
}

function customTransports(options: ToolHostOptions): Transport[] {
  if (options.transport === undefined) {
    return [];
  }
  return Array.isArray(options.transport) ? [...options.transport] : [options.transport as Transport];
}

function transportsFor(options: ToolHostOptions): Transport[] {
  const transports = customTransports(options);
  if (transports.length > 0) {
    return transports;
  }
  const urls = baseUrls(options);
  if (urls.length === 0) {
    throw new TypeError("toolmesh: ToolHost needs a baseUrl (the bridge's port for pages) or a transport");
  }
  return urls.map((baseUrl) =>
    options.protocol === "grpc-web" ? createGrpcWebTransport({ baseUrl }) : createConnectTransport({ baseUrl }),
  );
}

function baseUrls(options: ToolHostOptions): string[] {
  return typeof options.baseUrl === "string" ? [options.baseUrl] : [...(options.baseUrl ?? [])];
}

function defaultHostName(): string {
  const location = (globalThis as { location?: { origin: string; pathname: string } }).location;
  return location === undefined ? "page" : `page:${location.origin}${location.pathname}`;
}
