import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient, type Client, type Transport } from "@connectrpc/connect";
import { createConnectTransport, createGrpcWebTransport } from "@connectrpc/connect-web";
import {
  BridgeService,
  CancelReason,
  type ToolRequest,
  type ToolRequestCancelled,
} from "./gen/toolmesh/v1/bridge_pb.js";
import { ToolDefinitionSchema, type ToolDefinition, type ToolOutcome } from "./gen/toolmesh/v1/tool_pb.js";
import { Codes, errorInfo, type HostError } from "./errors.js";
import {
  READ_CHECK_TIMEOUT_MS,
  RECONNECT_BACKOFF_FIRST_MS,
  RECONNECT_BACKOFF_MAX_MS,
  RENEW_AHEAD_MS,
} from "./gen/tables.js";
import { convertReturn, runtimeError } from "./results.js";

/** What a handler is told about the call it serves. */
export interface ToolContext {
  readonly sessionId: string;
  readonly turnId: string;
  readonly toolRequestId: string;
  readonly toolName: string;
  /** When the runtime stops waiting for the result, in Date.now() milliseconds. */
  readonly deadline: number;
  /**
   * Aborted when the runtime tells the host to stop the call: its deadline
   * passed (reason: a "TimeoutError" DOMException) or it was cancelled, or
   * the host stopped ("AbortError"). After that, whatever the handler
   * returns is not delivered (the call has ended): onError hears of it, as
   * SUBMIT_TOOL_RESULT_FAILED with cause REQUEST_ENDED (or SHUTTING_DOWN).
   */
  readonly signal: AbortSignal;
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

/** The bridge refused the host itself: its token, or where it connected. */
const REFUSALS = new Set<string>([Codes.UNAUTHENTICATED, Codes.PERMISSION_DENIED, Codes.WRONG_LISTENER]);

/** Submits that fail in transport are tried again until the call's deadline, this much past it at most. */
const SUBMIT_GRACE_MS = 5_000;
const TRANSIENT = new Set([Code.Unavailable, Code.DeadlineExceeded, Code.ResourceExhausted, Code.Unknown]);
/** Missing this many heartbeats in a row means the bridge is gone. */
const MISSED_HEARTBEATS = 3;
const DECLARE_TIMEOUT_MS = 10_000;
// A progress report the bridge has not answered by then is given up (progress is best effort).
const PROGRESS_TIMEOUT_MS = 5_000;

interface Registered {
  readonly handler: ToolHandler;
  readonly declaration: ToolDeclaration | undefined;
}

interface Active {
  readonly controller: AbortController;
  ended: boolean;
}

/**
 * One handler host for one session, inside a page: it opens a host session
 * with the bridge over Connect or gRPC-Web, runs the tool requests it
 * receives, and hands each outcome back. It reconnects with backoff whenever
 * the stream drops or the bridge's heartbeats stop, and declares its tools
 * again each time.
 */
export class ToolHost {
  readonly sessionId: string;
  readonly hostName: string;
  /** The current host session's id; empty while not connected. */
  hostSessionId = "";

  /** One client per bridge replica; `turn` is the one connected to (or tried) now. */
  private readonly clients: Client<typeof BridgeService>[];
  private turn = 0;
  private connectionWaiters: (() => void)[] = [];
  private readonly maxBackoffMs: number;
  private readonly handlers = new Map<string, Registered>();
  private generic: ToolHandler | undefined;
  private readonly errorCallbacks = new Set<(error: HostError) => void>();
  private readonly active = new Map<string, Active>();
  private stopping = false;
  private running: Promise<void> | undefined;
  /** The open streams: the current one, and those a renewal replaced that still hold requests. */
  private readonly streams = new Set<AbortController>();
  /** The host sessions whose streams are open: a result goes to the one its request came on. */
  private readonly openSessions = new Set<string>();
  private wake: (() => void) | undefined;
  private connectedNow = false;
  private readyWaiters: (() => void)[] = [];
  private declaring: Promise<void> = Promise.resolve();
  private declaredOnce = false;
  private hadDeclarations = false;
  private readonly token: ToolHostOptions["token"];
  /** Why the bridge refuses the host, until it takes it; reported once per refusal. */
  private refusal: HostError | undefined;
  private refusalWaiters: ((refusal: HostError) => void)[] = [];

  constructor(options: ToolHostOptions) {
    this.sessionId = options.sessionId;
    this.token = options.token;
    this.hostName = (options.hostName ?? defaultHostName()).slice(0, 128);
    this.maxBackoffMs = options.maxBackoffMs ?? RECONNECT_BACKOFF_MAX_MS;
    this.clients = transportsFor(options).map((transport) => createClient(BridgeService, transport));
  }

  private get client(): Client<typeof BridgeService> {
    return this.clients[this.turn] ?? this.clients[0]!;
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
      this.redeclare();
    }
    return () => {
      if (this.handlers.get(name) === registered) {
        this.handlers.delete(name);
        if (declaration !== undefined) {
          this.redeclare();
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
    return this.connectedNow;
  }

  /**
   * Connect in the background, reconnecting whenever the stream drops; resolve
   * once the first host session is open and the declared tools were sent.
   * Rejects when that took longer than `timeoutMs`, or at once when the bridge
   * refuses the host (its token: UNAUTHENTICATED, PERMISSION_DENIED; the error
   * names the code, and `onError` hears of it); the host keeps trying until `stop()`.
   */
  async start(options: { timeoutMs?: number } = {}): Promise<void> {
    this.stopping = false;
    this.running ??= this.run().finally(() => {
      this.running = undefined;
    });
    await this.ready(options.timeoutMs ?? 10_000);
  }

  /** Close the host session, abort every running handler's signal, and stop reconnecting. */
  async stop(): Promise<void> {
    this.stopping = true;
    this.streams.forEach((stream) => stream.abort());
    this.wake?.();
    this.connectionWaiters.splice(0).forEach((waiter) => waiter());
    for (const active of this.active.values()) {
      active.ended = true;
      active.controller.abort(new DOMException("The tool host stopped.", "AbortError"));
    }
    await this.running;
  }

  private ready(timeoutMs: number): Promise<void> {
    if (this.connectedNow && this.declaredOnce) {
      return Promise.resolve();
    }
    return new Promise((resolve, reject) => {
      const forget = (): void => {
        clearTimeout(timer);
        this.readyWaiters = this.readyWaiters.filter((waiter) => waiter !== done);
        this.refusalWaiters = this.refusalWaiters.filter((waiter) => waiter !== refused);
      };
      const timer = setTimeout(() => {
        forget();
        reject(new Error(`toolmesh: no host session within ${timeoutMs} ms; still trying`));
      }, timeoutMs);
      const done = (): void => {
        forget();
        resolve();
      };
      const refused = (refusal: HostError): void => {
        forget();
        reject(new Error(`toolmesh: the bridge refused the host: ${refusal.code} ${refusal.message}`));
      };
      this.readyWaiters.push(done);
      this.refusalWaiters.push(refused);
    });
  }

  private async run(): Promise<void> {
    let backoff = RECONNECT_BACKOFF_FIRST_MS;
    while (!this.stopping) {
      try {
        await this.serveOnce();
        backoff = RECONNECT_BACKOFF_FIRST_MS;
      } catch (error) {
        // The stream failed or went silent: reconnect below; a refusal is said once.
        this.refused(error);
      } finally {
        this.connectedNow = false;
        this.hostSessionId = "";
      }
      if (this.stopping) {
        break;
      }
      // The next replica, if there are several: this one may be gone.
      this.turn = (this.turn + 1) % this.clients.length;
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, backoff * (0.5 + Math.random() / 2));
        // stop() cuts the wait short: it would last as long as the backoff.
        this.wake = () => {
          clearTimeout(timer);
          resolve();
        };
      });
      this.wake = undefined;
      backoff = Math.min(backoff * 2, this.maxBackoffMs);
    }
  }

  /** The token to send now (the callback's current one), if any. */
  private async currentToken(): Promise<string | undefined> {
    return typeof this.token === "function" ? await this.token() : this.token;
  }

  /** The headers of every request: the token, when there is one. */
  private async headers(token?: string): Promise<Record<string, string>> {
    token ??= await this.currentToken();
    return token === undefined ? {} : { authorization: `Bearer ${token}` };
  }

  private refused(error: unknown): void {
    const info = errorInfo(error);
    if (info === undefined || !REFUSALS.has(info.reason)) {
      return;
    }
    if (info.metadata["reason"] === "expired" && this.connectedNow) {
      return; // a stream that outlived its token: opened again with the current one
    }
    const first = this.refusal === undefined;
    this.refusal = {
      code: info.reason,
      message: error instanceof ConnectError ? error.rawMessage : "",
      sessionId: this.sessionId,
      turnId: "",
      toolRequestId: "",
      toolName: "",
      cause: info.metadata["reason"] ?? "",
    };
    if (first) {
      this.report(this.refusal);
    }
    for (const waiter of this.refusalWaiters) {
      waiter(this.refusal);
    }
  }

  /**
   * One connection: a stream, renewed ahead of its token's expiry, until it ends or fails. A
   * renewal opens a new stream that replaces the current one (replacesHostSessionId): the bridge
   * sends the old one no new requests and ends it once it answered those it holds, so no call is
   * lost to it; the old stream is read meanwhile, and its requests' results handed in on it.
   */
  private async serveOnce(): Promise<void> {
    let token = await this.currentToken();
    let replaces = "";
    for (;;) {
      let opened: (hostSessionId: string) => void = () => {};
      const openedNow = new Promise<string>((resolve) => {
        opened = resolve;
      });
      const reading = this.readStream(token, replaces, opened);
      const renewal = renewInMs(token);
      if (renewal === undefined) {
        return reading;
      }
      const renewAt = Date.now() + renewal;
      let timer: ReturnType<typeof setTimeout> | undefined;
      // Only a stream that opened is renewed: one the bridge refuses ends by itself.
      const due = openedNow.then(
        (hostSessionId) =>
          new Promise<string>((resolve) => {
            timer = setTimeout(() => resolve(hostSessionId), Math.max(renewAt - Date.now(), 0));
          }),
      );
      const first = await Promise.race([reading.then(() => undefined), due]).finally(() => clearTimeout(timer));
      if (first === undefined || this.stopping) {
        return reading;
      }
      const fresh = await this.currentToken();
      if (fresh === token) {
        return reading; // nothing fresher to renew with: the stream ends at expiry and is opened again then
      }
      // The old stream is read on until the bridge ends it; how it ends concerns no one.
      reading.catch(() => {});
      replaces = first;
      token = fresh;
    }
  }

  private async readStream(
    token: string | undefined,
    replaces: string,
    opened: (hostSessionId: string) => void,
  ): Promise<void> {
    const stream = new AbortController();
    this.streams.add(stream);
    // This stream's host session: its requests' results go there, even once a renewal took over.
    let hostSessionId = "";
    // Until the bridge says how often it beats, allow a generous first wait.
    let limitMs = 30_000;
    let last = Date.now();
    const watchdog = setInterval(
      () => {
        if (Date.now() - last > limitMs) {
          stream.abort(new DOMException("The bridge's heartbeats stopped.", "TimeoutError"));
        }
      },
      Math.min(limitMs / 3, 1_000),
    );
    try {
      const events = this.client.openHostSession(
        {
          sessionId: this.sessionId,
          hostName: this.hostName,
          handlerNames: [...this.handlers.keys()].sort(),
          hasGenericHandler: this.generic !== undefined,
          replacesHostSessionId: replaces,
        },
        { signal: stream.signal, headers: await this.headers(token) },
      );
      for await (const response of events) {
        last = Date.now();
        const event = response.event;
        switch (event.case) {
          case "opened": {
            this.refusal = undefined;
            hostSessionId = event.value.hostSessionId;
            this.openSessions.add(hostSessionId);
            this.hostSessionId = hostSessionId;
            limitMs = (MISSED_HEARTBEATS * Math.max(event.value.heartbeatIntervalMs, 100));
            this.connectedNow = true;
            this.declaredOnce = false;
            this.redeclare();
            this.connectionWaiters.splice(0).forEach((waiter) => waiter());
            opened(hostSessionId);
            break;
          }
          case "toolRequest":
            this.begin(event.value, hostSessionId);
            break;
          case "cancelled":
            this.cancel(event.value);
            break;
          case "heartbeat":
            if (event.value.readCheck !== 0n) {
              this.answerReadCheck(hostSessionId, event.value.readCheck);
            }
            break;
          default:
            break;
        }
      }
    } finally {
      clearInterval(watchdog);
      this.streams.delete(stream);
      this.openSessions.delete(hostSessionId);
    }
  }

  /**
   * Tell the bridge this page reads its stream: it sends requests to hosts
   * that do. A failure is left alone: the next check asks again.
   */
  private answerReadCheck(hostSessionId: string, readCheck: bigint): void {
    this.headers()
      .then((headers) =>
        this.client.answerReadCheck({ hostSessionId, readCheck }, { timeoutMs: READ_CHECK_TIMEOUT_MS, headers }),
      )
      .catch(() => {});
  }

  /** Send one progress report; never rejects (a refusal or a transport failure is forgotten). */
  private async reportProgress(toolRequestId: string, progress: number, total?: number, message?: string): Promise<void> {
    try {
      await this.client.reportToolProgress(
        { hostSessionId: this.hostSessionId, toolRequestId, progress, total, message: message ?? "" },
        { timeoutMs: PROGRESS_TIMEOUT_MS },
      );
    } catch {
      // Progress is optional: the call goes on whatever became of the report.
    }
  }

  /** Send the declared tools now (in order after any declaration under way), if connected. */
  private redeclare(): void {
    this.declaring = this.declaring.then(() => this.declare());
  }

  private async declare(): Promise<void> {
    const hostSessionId = this.hostSessionId;
    if (!this.connectedNow || hostSessionId === "") {
      return;
    }
    const tools: ToolDefinition[] = [];
    for (const [name, registered] of this.handlers) {
      if (registered.declaration !== undefined) {
        tools.push(toDefinition(name, registered.declaration));
      }
    }
    // A host that never declared anything has nothing to withdraw either.
    if (tools.length > 0 || this.hadDeclarations) {
      this.hadDeclarations = tools.length > 0;
      try {
        await this.client.declareHostTools(
          { hostSessionId, tools },
          { timeoutMs: DECLARE_TIMEOUT_MS, headers: await this.headers() },
        );
      } catch (error) {
        const info = errorInfo(error);
        this.report({
          code: info?.reason ?? Codes.TRANSPORT_FAILED,
          message: error instanceof ConnectError ? error.rawMessage : "The tools could not be declared.",
          sessionId: this.sessionId,
          turnId: "",
          toolRequestId: "",
          toolName: "",
          cause: "",
        });
      }
    }
    if (hostSessionId === this.hostSessionId) {
      this.declaredOnce = true;
      const waiters = this.readyWaiters;
      this.readyWaiters = [];
      waiters.forEach((waiter) => waiter());
    }
  }

  private begin(request: ToolRequest, hostSessionId: string): void {
    const controller = new AbortController();
    const ctx: ToolContext = {
      sessionId: request.sessionId,
      turnId: request.turnId,
      toolRequestId: request.toolRequestId,
      toolName: request.toolName,
      deadline: Date.now() + request.timeoutMs,
      signal: controller.signal,
      timeRemainingMs() {
        return Math.max(0, this.deadline - Date.now());
      },
      reportProgress: (progress, total, message) => this.reportProgress(request.toolRequestId, progress, total, message),
    };
    const active: Active = { controller, ended: false };
    this.active.set(ctx.toolRequestId, active);
    void this.serve(request.argumentsJson, ctx, active, hostSessionId).finally(() => {
      this.active.delete(ctx.toolRequestId);
    });
  }

  private cancel(cancelled: ToolRequestCancelled): void {
    const active = this.active.get(cancelled.toolRequestId);
    if (active === undefined) {
      return;
    }
    active.ended = true;
    active.controller.abort(
      cancelled.reason === CancelReason.TIMEOUT
        ? new DOMException("The tool call reached its deadline.", "TimeoutError")
        : new DOMException("The tool call was cancelled.", "AbortError"),
    );
  }

  private async serve(argumentsJson: string, ctx: ToolContext, active: Active, hostSessionId: string): Promise<void> {
    const outcome = await this.execute(argumentsJson, ctx);
    if (outcome === undefined) {
      return;
    }
    if (active.ended) {
      this.notDelivered(ctx); // ended meanwhile: the bridge would refuse it
      return;
    }
    await this.submit(outcome, ctx, hostSessionId);
  }

  /** A result the handler produced after its call ended: not sent, and said so. */
  private notDelivered(ctx: ToolContext): void {
    this.report({
      ...ids(ctx),
      code: Codes.SUBMIT_TOOL_RESULT_FAILED,
      message: "The call ended before the handler returned.",
      cause: this.stopping ? Codes.SHUTTING_DOWN : Codes.REQUEST_ENDED,
    });
  }

  /** Run the handler; undefined when the call ended (its signal aborted) before it settled. */
  private async execute(argumentsJson: string, ctx: ToolContext): Promise<ToolOutcome | undefined> {
    const handler = this.handlers.get(ctx.toolName)?.handler ?? this.generic;
    if (handler === undefined) {
      return runtimeError("TOOL_HANDLER_NOT_FOUND", `No handler for ${ctx.toolName}.`, { tool: ctx.toolName });
    }
    let value: unknown;
    try {
      value = await handler(JSON.parse(argumentsJson) as ToolArguments, ctx);
    } catch (thrown) {
      if (ctx.signal.aborted) {
        return undefined; // it gave up as it was told to
      }
      // The caller gets a compact error: the exception's name, never its text or stack.
      const name = thrown instanceof Error ? thrown.name : typeof thrown;
      this.report({ ...ids(ctx), code: Codes.TOOL_HANDLER_ERROR, message: name, cause: "" });
      return runtimeError("TOOL_HANDLER_ERROR", "", { tool: ctx.toolName, exception: name });
    }
    if (ctx.signal.aborted) {
      this.notDelivered(ctx); // it returned after being told to stop: its value goes nowhere
      return undefined;
    }
    const converted = convertReturn(value);
    if (converted.refusedBecause !== undefined) {
      const failure = converted.outcome.outcome;
      this.report({
        ...ids(ctx),
        code: Codes.SUBMIT_TOOL_RESULT_FAILED,
        message: failure.case === "error" ? failure.value.message : "",
        cause: converted.refusedBecause,
      });
    }
    return converted.outcome;
  }

  /**
   * Hand the outcome to the bridge, trying transport failures again until the
   * call's deadline. When the stream broke meanwhile (its bridge replica may be
   * gone), wait for the next connection and hand it in there, naming the same
   * request under the new host session. Sending the same outcome twice is safe:
   * the bridge keeps one outcome per request and says whether it was this one.
   */
  private async submit(outcome: ToolOutcome, ctx: ToolContext, hostSessionId: string): Promise<void> {
    for (let attempt = 1; ; attempt++) {
      if (!this.openSessions.has(hostSessionId)) {
        await this.connection(ctx.timeRemainingMs());
        hostSessionId = this.hostSessionId || hostSessionId;
      }
      try {
        await this.client.submitToolResult(
          { hostSessionId, toolRequestId: ctx.toolRequestId, outcome },
          { timeoutMs: Math.max(ctx.timeRemainingMs(), 1_000) + SUBMIT_GRACE_MS, headers: await this.headers() },
        );
        return;
      } catch (error) {
        const info = errorInfo(error);
        if (attempt > 1 && info?.reason === Codes.REQUEST_ENDED && info.metadata["ended"] === "answered") {
          return; // an earlier attempt got through; its answer was lost on the way back
        }
        const transient = error instanceof ConnectError && TRANSIENT.has(error.code) && info === undefined;
        if (transient && ctx.timeRemainingMs() > 0 && !this.stopping) {
          await new Promise((resolve) => setTimeout(resolve, Math.min(50 * 2 ** attempt, 1_000)));
          continue;
        }
        this.report({
          ...ids(ctx),
          code: Codes.SUBMIT_TOOL_RESULT_FAILED,
          message: error instanceof ConnectError ? error.rawMessage : "",
          cause: info?.reason ?? Codes.TRANSPORT_FAILED,
        });
        return;
      }
    }
  }

  /** Resolves once a host session is open, or after `timeoutMs`, or when the host stops. */
  private connection(timeoutMs: number): Promise<void> {
    if (this.connectedNow || this.stopping) {
      return Promise.resolve();
    }
    return new Promise((resolve) => {
      const done = (): void => {
        clearTimeout(timer);
        this.connectionWaiters = this.connectionWaiters.filter((waiter) => waiter !== done);
        resolve();
      };
      const timer = setTimeout(done, timeoutMs);
      this.connectionWaiters.push(done);
    });
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

/**
 * Milliseconds until a stream opened with `token` should be replaced; undefined: never (no token,
 * or one without `exp`). The JWT's `exp` is read without verifying it: the bridge verifies the
 * token, the host only schedules its own stream's renewal with it.
 */
function renewInMs(token: string | undefined, now: number = Date.now()): number | undefined {
  const payload = token?.split(".");
  if (payload?.length !== 3) {
    return undefined;
  }
  let exp: unknown;
  try {
    const base64 = payload[1]!.replace(/-/g, "+").replace(/_/g, "/");
    exp = (JSON.parse(atob(base64 + "=".repeat((4 - (base64.length % 4)) % 4))) as { exp?: unknown }).exp;
  } catch {
    return undefined;
  }
  if (typeof exp !== "number" || !Number.isFinite(exp)) {
    return undefined;
  }
  const remaining = exp * 1000 - now;
  return Math.max(remaining - Math.min(RENEW_AHEAD_MS, remaining / 3), 0);
}

function ids(ctx: ToolContext): Pick<HostError, "sessionId" | "turnId" | "toolRequestId" | "toolName"> {
  return { sessionId: ctx.sessionId, turnId: ctx.turnId, toolRequestId: ctx.toolRequestId, toolName: ctx.toolName };
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

function transportsFor(options: ToolHostOptions): Transport[] {
  if (options.transport !== undefined) {
    const transports = Array.isArray(options.transport) ? [...options.transport] : [options.transport as Transport];
    if (transports.length > 0) {
      return transports;
    }
  }
  const urls = typeof options.baseUrl === "string" ? [options.baseUrl] : [...(options.baseUrl ?? [])];
  if (urls.length === 0) {
    throw new TypeError("toolmesh: ToolHost needs a baseUrl (the bridge's port for pages) or a transport");
  }
  return urls.map((baseUrl) =>
    options.protocol === "grpc-web" ? createGrpcWebTransport({ baseUrl }) : createConnectTransport({ baseUrl }),
  );
}

function defaultHostName(): string {
  const location = (globalThis as { location?: { origin: string; pathname: string } }).location;
  return location === undefined ? "page" : `page:${location.origin}${location.pathname}`;
}
