import { Code, ConnectError, createClient, type Client, type Transport } from "@connectrpc/connect";
import {
  BridgeService,
  CancelReason,
  ToolStartVerdict,
  type ToolRequest,
  type ToolRequestCancelled,
} from "./gen/toolmesh/v1/bridge_pb.js";
import type { ToolDefinition, ToolOutcome } from "./gen/toolmesh/v1/tool_pb.js";
import { COPY_AFTER_MS, answeredBefore, handInCopies, type Copy } from "./copies.js";
import { Codes, errorInfo, type HostError } from "./errors.js";
import { ERROR_TABLE } from "./gen/tables.js";
import {
  MAX_CALLS_PER_MESSAGE,
  READ_CHECK_TIMEOUT_MS,
  RECONNECT_BACKOFF_FIRST_MS,
  RENEW_AHEAD_MS,
} from "./gen/tables.js";
import type { ToolArguments, ToolContext, ToolHandler, ToolHostOptions } from "./host.js";
import { anyAnswers, firstAnswering } from "./replicas.js";
import { convertReturn, runtimeError } from "./results.js";
import { ResultSubmissions, SubmitCut, type Submitted } from "./submits.js";
import { inHandlerSpan } from "./tracing.js";
import { Waiters } from "./waiters.js";

/**
 * Where the engine is:
 * - idle: not started yet;
 * - connecting: opening a stream to the current bridge replica, no host session yet;
 * - declaring: a host session is open and the declared tools are on their way;
 * - ready: a host session is open and its tools declared (start() resolves);
 * - backoff: the stream ended; waiting before trying the next replica;
 * - closing: stop() came while a host session was open; it is open until its aborted stream ends;
 * - stopping: stop() came; no host session, the loop winds down;
 * - stopped: the loop ended after stop().
 */
export type EngineState =
  | "idle"
  | "connecting"
  | "declaring"
  | "ready"
  | "backoff"
  | "closing"
  | "stopping"
  | "stopped";

/**
 * What moves the engine: start() and stop(); a stream's host session opened (the
 * first, or a renewal's), the current session's tools declared, the current
 * stream ended or failed; the backoff passed; the loop ended.
 */
type Trigger = "start" | "stop" | "opened" | "declared" | "ended" | "retry" | "exit";

/** Every transition. A trigger a state does not list leaves it as it is. */
const TRANSITIONS: { readonly [S in EngineState]: Readonly<Partial<Record<Trigger, EngineState>>> } = {
  idle: { start: "connecting", stop: "stopped" },
  connecting: { opened: "declaring", ended: "backoff", stop: "stopping" },
  declaring: { opened: "declaring", declared: "ready", ended: "backoff", stop: "closing" },
  ready: { opened: "declaring", ended: "backoff", stop: "closing" },
  backoff: { retry: "connecting", stop: "stopping" },
  // start() again before the aborted stream ended: its session counts until then, but start() waits
  // for the next one's declaration.
  closing: { start: "declaring", ended: "stopping" },
  // A stream that began opening after stop() (its token was still being asked for) was not aborted
  // with the others: its session counts as open until it ends.
  stopping: { start: "connecting", opened: "closing", exit: "stopped" },
  stopped: { start: "connecting" },
};

const CONNECTED: ReadonlySet<EngineState> = new Set(["declaring", "ready", "closing"]);
const STOP_REQUESTED: ReadonlySet<EngineState> = new Set(["closing", "stopping", "stopped"]);

/** What those waiting on the engine hear of: each trigger, and each refusal of the host. */
type EngineEvent = { readonly trigger: Trigger } | { readonly trigger: "refused"; readonly refusal: HostError };

/** What the engine asks of the host's registrations. */
export interface Registrations {
  /** The tools with a handler of their own, sorted. */
  handlerNames(): string[];
  hasGenericHandler(): boolean;
  /** The tool's own handler, else the generic one. */
  handlerFor(toolName: string): ToolHandler | undefined;
  /** The declared tools' definitions. */
  definitions(): ToolDefinition[];
  /** Tell the onError callbacks. */
  report(error: HostError): void;
}

export interface EngineOptions {
  readonly sessionId: string;
  readonly hostName: string;
  /** One per bridge replica. */
  readonly transports: readonly Transport[];
  /** Each replica's health check (`GET /healthz`), when the transports were made from base URLs. */
  readonly healthUrls: readonly string[] | undefined;
  readonly maxBackoffMs: number;
  readonly token: ToolHostOptions["token"];
}

/** The bridge refused the host itself: its token, or where it connected. */
const REFUSALS = new Set<string>([Codes.UNAUTHENTICATED, Codes.PERMISSION_DENIED, Codes.WRONG_LISTENER]);

/**
 * A result is handed in until the call's deadline and this long after it, failures in transport
 * and retryable refusals tried again meanwhile: a bridge that shares the ledger keeps a result
 * that comes after the deadline beside the caller's TOOL_TIMEOUT (for GetInvocation and exact
 * retries), so a bridge frozen or cut off past the deadline does not lose what the handler did;
 * one that does not share it refuses it (REQUEST_ENDED), which ends the attempts.
 */
const LATE_SUBMIT_MS = 60_000;
/** The network's delay and the clocks' offset: an answer may still come this long after the deadline. */
const SUBMIT_GRACE_MS = 1_000;
/**
 * With several bridge replicas, one submit attempt waits for the bridge's answer a third of the
 * time left for it (until the deadline and SUBMIT_GRACE_MS; once that has passed, until the end
 * of the late window), within these bounds, never longer than that: the rest is for reconnecting elsewhere and handing the result in there. A bridge that
 * answers nothing by then, not even a heartbeat on the stream, is taken for frozen: its stream is
 * given up and the result goes to the next replica (a healthy bridge answers in milliseconds).
 */
const SUBMIT_ATTEMPT_MIN_MS = 1_000;
const SUBMIT_ATTEMPT_MAX_MS = 5_000;
const TRANSIENT = new Set([Code.Unavailable, Code.DeadlineExceeded, Code.ResourceExhausted, Code.Unknown]);
/**
 * A new host stream waits this long for the bridge's first event before it is given up (and opened
 * again, on the next replica if there are several); with several replicas the shorter one: a frozen
 * replica accepts the request and says nothing, and would hold the page while another one is up.
 */
const FIRST_EVENT_MS = 30_000;
const FIRST_EVENT_ELSEWHERE_MS = 5_000;
/** A page leaves a silent bridge replica only for another that answers its health check this soon. */
const OTHERS_ANSWER_MS = 1_000;
/** Missing this many heartbeats in a row means the bridge is gone. */
const MISSED_HEARTBEATS = 3;
const DECLARE_TIMEOUT_MS = 10_000;
// A progress report the bridge has not answered by then is given up (progress is best effort).
const PROGRESS_TIMEOUT_MS = 5_000;

// The longest wait for the bridge's answer to StartToolRequests; no answer, no start.
const START_TIMEOUT_MS = 10_000;

/**
 * One host stream, as its requests' results see it: the client of the bridge replica it was opened
 * to, its controller (aborted to end it), `cut` (aborted when it was given up: the bridge stopped
 * talking, by missed heartbeats or a submit left unanswered; the results queued and in flight for
 * it are then handed in on the next connection), and when it last brought anything.
 */
interface HostStream {
  readonly client: Client<typeof BridgeService>;
  readonly controller: AbortController;
  readonly cut: AbortController;
  hostSessionId: string;
  /** Date.now() when the stream last brought an event (a heartbeat included). */
  lastHeard: number;
  /**
   * Events read so far: "heard since a submit" counts them, as Date.now() (whole milliseconds)
   * cannot tell an event from a submit of the same millisecond.
   */
  events: number;
  /** Silence longer than this gives the stream up. */
  limitMs: number;
}

interface Active {
  readonly controller: AbortController;
  ended: boolean;
}

/**
 * One host stream's own facts: whether its bridge acknowledges starts, and how far the bridge's
 * clock is at most ahead of performance.now(): the least (bridge time + 1 - local time when the
 * page sent what the bridge answered) seen. The bridge read its clock (rounded down) after that, so
 * a delay on the way (a busy page, a suspended tab) only raises a sample, which puts deadlines
 * earlier, never late.
 */
interface StreamFacts {
  startsAcknowledged: boolean;
  offsetMs: number | undefined;
}

/** A request read from a bridge that acknowledges starts, waiting for its START. */
interface Starting {
  readonly request: ToolRequest;
  readonly ctx: ToolContext;
  readonly active: Active;
  readonly hostSessionId: string;
}

/**
 * A ToolHost's connection to the bridge: the host session's stream, renewed
 * ahead of its token's expiry and opened again (on the next replica, with
 * backoff) whenever it drops or the bridge's heartbeats stop; the tool requests
 * it receives, run by their handlers; their outcomes handed back, on the next
 * connection when their stream was lost meanwhile.
 */
export class HostEngine {
  private current: EngineState = "idle";
  private readonly waiters = new Waiters<EngineEvent>();
  /** The loop of the latest start(). */
  private running: Promise<void> | undefined;
  /** One client per bridge replica; `turn` is the one connected to (or tried) now. */
  private readonly clients: Client<typeof BridgeService>[];
  private turn = 0;
  /** The current host session's id; empty while not connected. */
  private session = "";
  /** The open streams: the current one, and those a renewal replaced that still hold requests. */
  private readonly streams = new Set<HostStream>();
  /** The host sessions whose streams are open, by id: a result goes to the one its request came on. */
  private readonly openSessions = new Map<string, HostStream>();
  private readonly active = new Map<string, Active>();
  /** Requests waiting for the bridge's START, by id: a cancellation meanwhile reaches them here. */
  private readonly starting = new Map<string, Starting>();
  /** Requests read and not asked to start yet, by host session: asked together, in one call. */
  private readonly toStart = new Map<string, Starting[]>();
  /** The host sessions with a StartToolRequests call in flight: those read meanwhile wait for it. */
  private readonly asking = new Set<string>();
  private declaring: Promise<void> = Promise.resolve();
  private hadDeclarations = false;
  /** Why the bridge refuses the host, until it takes it; reported once per refusal. */
  private refusal: HostError | undefined;
  /** Results on their way to the bridge, several per call when several handlers end together. */
  private readonly submissions = new ResultSubmissions(() => this.headers());

  constructor(
    private readonly options: EngineOptions,
    private readonly host: Registrations,
  ) {
    this.clients = options.transports.map((transport) => createClient(BridgeService, transport));
  }

  get state(): EngineState {
    return this.current;
  }

  get hostSessionId(): string {
    return this.session;
  }

  /** Whether a host session is open now. */
  get connected(): boolean {
    return CONNECTED.has(this.current);
  }

  private get stopRequested(): boolean {
    return STOP_REQUESTED.has(this.current);
  }

  /** The one place the state changes; everyone waiting hears of the trigger. */
  private apply(trigger: Trigger): void {
    this.current = TRANSITIONS[this.current][trigger] ?? this.current;
    this.waiters.release({ trigger });
  }

  /** A call, not a property read: TypeScript would take a state read after an await for the one read before. */
  private is(state: EngineState): boolean {
    return this.current === state;
  }

  private get client(): Client<typeof BridgeService> {
    return this.clients[this.turn] ?? this.clients[0]!;
  }

  /** The client of the replica `hostSessionId`'s stream is on, else the current one. */
  private clientOf(hostSessionId: string): Client<typeof BridgeService> {
    return this.openSessions.get(hostSessionId)?.client ?? this.client;
  }

  /** Connect in the background, reconnecting whenever the stream drops, until stop(). */
  start(): void {
    const loopEnded = this.current === "idle" || this.current === "stopped";
    this.apply("start");
    if (loopEnded) {
      this.running = this.run();
    }
  }

  /**
   * Resolves once a host session is open and its tools declared; rejects after
   * `timeoutMs`, or when the bridge refuses the host.
   */
  async ready(timeoutMs: number): Promise<void> {
    if (this.current === "ready") {
      return;
    }
    const event = await this.waiters.wait(timeoutMs, (e) => e.trigger === "declared" || e.trigger === "refused");
    if (event === undefined) {
      throw new Error(`toolmesh: no host session within ${timeoutMs} ms; still trying`);
    }
    if (event.trigger === "refused") {
      throw new Error(`toolmesh: the bridge refused the host: ${event.refusal.code} ${event.refusal.message}`);
    }
  }

  /** Close the host session, abort every running handler's signal, and stop reconnecting. */
  async stop(): Promise<void> {
    this.apply("stop");
    this.streams.forEach((stream) => stream.controller.abort());
    for (const active of [...this.active.values(), ...[...this.starting.values()].map((s) => s.active)]) {
      active.ended = true;
      active.controller.abort(new DOMException("The tool host stopped.", "AbortError"));
    }
    await this.running;
  }

  private async run(): Promise<void> {
    let backoff = RECONNECT_BACKOFF_FIRST_MS;
    for (;;) {
      try {
        await this.openOnAnswering();
        await this.serveOnce();
        backoff = RECONNECT_BACKOFF_FIRST_MS;
      } catch (error) {
        // The stream failed or went silent: reconnect below; a refusal is said once.
        this.refused(error);
      } finally {
        this.session = "";
        this.apply("ended");
      }
      if (this.is("stopping")) {
        break;
      }
      // The next replica, if there are several: this one may be gone.
      this.turn = (this.turn + 1) % this.clients.length;
      // stop() cuts the wait short: it would last as long as the backoff.
      await this.waiters.wait(backoff * (0.5 + Math.random() / 2), (e) => e.trigger === "stop");
      if (this.is("stopping")) {
        break;
      }
      this.apply("retry");
      backoff = Math.min(backoff * 2, this.options.maxBackoffMs);
    }
    this.apply("exit");
  }

  /**
   * With several replicas: open on one that answers (./replicas.ts). The current one if it does
   * at once, else the first of them all to; the current one still when none does within
   * FIRST_EVENT_ELSEWHERE_MS.
   */
  private async openOnAnswering(): Promise<void> {
    const urls = this.options.healthUrls;
    if (urls === undefined || urls.length < 2) {
      return;
    }
    const stop = this.waiters.wait(FIRST_EVENT_ELSEWHERE_MS, (e) => e.trigger === "stop");
    const turn = await firstAnswering(urls, this.turn, FIRST_EVENT_ELSEWHERE_MS, stop);
    if (turn !== undefined) {
      this.turn = turn;
    }
  }

  /** The token to send now (the callback's current one), if any. */
  private async currentToken(): Promise<string | undefined> {
    const token = this.options.token;
    return typeof token === "function" ? await token() : token;
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
    if (info.metadata["reason"] === "expired" && this.connected) {
      return; // a stream that outlived its token: opened again with the current one
    }
    const first = this.refusal === undefined;
    const refusal: HostError = {
      code: info.reason,
      message: error instanceof ConnectError ? error.rawMessage : "",
      sessionId: this.options.sessionId,
      turnId: "",
      toolRequestId: "",
      toolName: "",
      cause: info.metadata["reason"] ?? "",
    };
    this.refusal = refusal;
    if (first) {
      this.host.report(refusal);
    }
    this.waiters.release({ trigger: "refused", refusal });
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
      if (first === undefined || this.stopRequested) {
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
    const stream: HostStream = {
      client: this.client,
      controller: new AbortController(),
      cut: new AbortController(),
      // This stream's host session: its requests' results go there, even once a renewal took over.
      hostSessionId: "",
      lastHeard: Date.now(),
      events: 0,
      // Until the bridge says how often it beats, allow a generous first wait.
      limitMs: this.clients.length > 1 ? FIRST_EVENT_ELSEWHERE_MS : FIRST_EVENT_MS,
    };
    this.streams.add(stream);
    const facts: StreamFacts = { startsAcknowledged: false, offsetMs: undefined };
    const watchdog = setInterval(
      () => {
        if (Date.now() - stream.lastHeard > stream.limitMs) {
          this.giveUp(stream, "The bridge's heartbeats stopped.");
        }
      },
      Math.min(stream.limitMs / 3, 1_000),
    );
    try {
      const headers = await this.headers(token);
      const askedAt = performance.now();
      const events = stream.client.openHostSession(
        {
          sessionId: this.options.sessionId,
          hostName: this.options.hostName,
          handlerNames: this.host.handlerNames(),
          hasGenericHandler: this.host.hasGenericHandler(),
          replacesHostSessionId: replaces,
          acknowledgesStarts: true,
          readsToolRequestBatches: true,
        },
        { signal: stream.controller.signal, headers },
      );
      for await (const response of events) {
        stream.lastHeard = Date.now();
        stream.events += 1;
        const event = response.event;
        switch (event.case) {
          case "opened": {
            this.refusal = undefined;
            const hostSessionId = event.value.hostSessionId;
            stream.hostSessionId = hostSessionId;
            // Asked for, and taken: the bridge starts none of this stream's requests unasked.
            facts.startsAcknowledged = event.value.startsAcknowledged;
            answered(facts, event.value.serverTimeUnixMs, askedAt);
            this.openSessions.set(hostSessionId, stream);
            this.session = hostSessionId;
            stream.limitMs = MISSED_HEARTBEATS * Math.max(event.value.heartbeatIntervalMs, 100);
            this.redeclare();
            this.apply("opened");
            opened(hostSessionId);
            break;
          }
          case "toolRequest":
            this.begin(event.value, stream.hostSessionId, facts);
            break;
          case "toolRequests":
            // Several that were ready together: each as if it had come alone, in their order.
            for (const request of event.value.requests) {
              this.begin(request, stream.hostSessionId, facts);
            }
            break;
          case "cancelled":
            this.cancel(event.value);
            break;
          case "heartbeat":
            if (event.value.readCheck !== 0n) {
              this.answerReadCheck(stream.hostSessionId, event.value.readCheck, facts);
            }
            break;
          default:
            break;
        }
      }
    } finally {
      clearInterval(watchdog);
      this.streams.delete(stream);
      this.openSessions.delete(stream.hostSessionId);
    }
  }

  /**
   * Give up `stream` and every other stream to its replica (a renewal's old one): the bridge stopped
   * talking (frozen, cut off). Each ends, which takes the engine to the next replica, and its
   * results queued and in flight are cut, for the next connection. A stream that ends otherwise
   * (the bridge ended it, or it broke) keeps its submits in flight: the bridge may answer them still,
   * and a broken connection fails them itself.
   */
  private giveUp(stream: HostStream, why: string): void {
    for (const other of this.streams) {
      if (other === stream || other.client === stream.client) {
        const reason = new DOMException(why, "TimeoutError");
        other.cut.abort(reason);
        other.controller.abort(reason);
      }
    }
  }

  /**
   * Give `stream` up when nothing was heard on it since `heard` (its count of events as the submit
   * went out); whether it did. Only when another replica may be reached: one that answers its
   * health check within OTHERS_ANSWER_MS, when the page knows the replicas' base URLs. When none
   * does, every replica is frozen or cut off, and the page stays: leaving would end there, once it
   * comes back, the requests it ran (as the Python host SDK does).
   */
  private async leaveIfSilent(stream: HostStream, heard: number): Promise<boolean> {
    if (stream.cut.signal.aborted || this.clients.length < 2 || stream.events > heard) {
      return false;
    }
    const urls = this.options.healthUrls;
    if (urls !== undefined) {
      const turn = this.clients.indexOf(stream.client);
      if (!(await anyAnswers(urls.filter((_, index) => index !== turn), OTHERS_ANSWER_MS))) {
        console.warn("toolmesh: bridge silent and no other replica answers; staying", { sessionId: this.options.sessionId });
        return false;
      }
      if (stream.cut.signal.aborted || stream.events > heard) {
        return false; // given up meanwhile, or heard from: no longer silent
      }
    }
    this.giveUp(stream, "The bridge left a result unanswered.");
    return true;
  }

  /**
   * Tell the bridge this page reads its stream: it sends requests to hosts
   * that do. A failure is left alone: the next check asks again. Each answer may bound the
   * bridge's clock closer than the stream's opening did.
   */
  private answerReadCheck(hostSessionId: string, readCheck: bigint, facts: StreamFacts): void {
    this.headers()
      .then(async (headers) => {
        const sentAt = performance.now();
        const answer = await this.clientOf(hostSessionId).answerReadCheck(
          { hostSessionId, readCheck },
          { timeoutMs: READ_CHECK_TIMEOUT_MS, headers },
        );
        answered(facts, answer.serverTimeUnixMs, sentAt);
      })
      .catch(() => {});
  }

  /** Send one progress report; never rejects (a refusal or a transport failure is forgotten). */
  private async reportProgress(toolRequestId: string, progress: number, total?: number, message?: string): Promise<void> {
    try {
      await this.clientOf(this.session).reportToolProgress(
        { hostSessionId: this.session, toolRequestId, progress, total, message: message ?? "" },
        { timeoutMs: PROGRESS_TIMEOUT_MS },
      );
    } catch {
      // Progress is optional: the call goes on whatever became of the report.
    }
  }

  /** Send the declared tools now (in order after any declaration under way), if connected. */
  redeclare(): void {
    this.declaring = this.declaring.then(() => this.declare());
  }

  private async declare(): Promise<void> {
    const hostSessionId = this.session;
    if (!this.connected || hostSessionId === "") {
      return;
    }
    const tools = this.host.definitions();
    // A host that never declared anything has nothing to withdraw either.
    if (tools.length > 0 || this.hadDeclarations) {
      this.hadDeclarations = tools.length > 0;
      try {
        await this.clientOf(hostSessionId).declareHostTools(
          { hostSessionId, tools },
          { timeoutMs: DECLARE_TIMEOUT_MS, headers: await this.headers() },
        );
      } catch (error) {
        const info = errorInfo(error);
        this.host.report({
          code: info?.reason ?? Codes.TRANSPORT_FAILED,
          message: error instanceof ConnectError ? error.rawMessage : "The tools could not be declared.",
          sessionId: this.options.sessionId,
          turnId: "",
          toolRequestId: "",
          toolName: "",
          cause: "",
        });
      }
    }
    if (hostSessionId === this.session) {
      this.apply("declared");
    }
  }

  /** Run the request; from a bridge that acknowledges starts, only once it says START. */
  private begin(request: ToolRequest, hostSessionId: string, facts: StreamFacts): void {
    const controller = new AbortController();
    const ctx: ToolContext = {
      sessionId: request.sessionId,
      turnId: request.turnId,
      toolRequestId: request.toolRequestId,
      toolName: request.toolName,
      deadline: Date.now() + timeLeftMs(request, facts),
      traceContext: Object.freeze({ ...request.traceContext }),
      signal: controller.signal,
      timeRemainingMs() {
        return Math.max(0, this.deadline - Date.now());
      },
      reportProgress: (progress, total, message) => this.reportProgress(request.toolRequestId, progress, total, message),
    };
    const active: Active = { controller, ended: false };
    const handled = this.host.handlerFor(request.toolName) !== undefined;
    if (handled && ctx.timeRemainingMs() <= 0) {
      // Read after its deadline (the page was busy, the tab suspended): the caller has TOOL_TIMEOUT.
      notStarted(ctx, "DEADLINE_PASSED");
      return;
    }
    if (!handled || !facts.startsAcknowledged || request.redeliverable) {
      // Without a handler nothing runs: the answer (TOOL_HANDLER_NOT_FOUND) needs no START. A
      // read-only or idempotent request goes to another host if this one leaves, started or not:
      // a START would tell the bridge nothing (its result counts as the start).
      this.runHandler(request, ctx, active, hostSessionId);
      return;
    }
    const starting: Starting = { request, ctx, active, hostSessionId };
    this.starting.set(ctx.toolRequestId, starting);
    const batch = this.toStart.get(hostSessionId);
    if (batch !== undefined) {
      batch.push(starting);
      return;
    }
    this.toStart.set(hostSessionId, [starting]);
    if (this.asking.has(hostSessionId)) {
      return; // asked together once the call in flight returns: one call per round trip
    }
    // Those read in this task go in one call, asked in the next task: a message, not a timer, which
    // a background tab would throttle to once a second or less.
    const next = new MessageChannel();
    next.port1.onmessage = () => {
      next.port1.close();
      this.askToStart(hostSessionId);
    };
    next.port2.postMessage(null);
  }

  private runHandler(request: ToolRequest, ctx: ToolContext, active: Active, hostSessionId: string): void {
    this.active.set(ctx.toolRequestId, active);
    void this.serve(request.argumentsJson, ctx, active, hostSessionId).finally(() => {
      this.active.delete(ctx.toolRequestId);
    });
  }

  private askToStart(hostSessionId: string): void {
    const batch = this.toStart.get(hostSessionId) ?? [];
    this.toStart.delete(hostSessionId);
    if (batch.length === 0 || this.stopRequested) {
      return;
    }
    if (batch.length > MAX_CALLS_PER_MESSAGE) {
      this.toStart.set(hostSessionId, batch.slice(MAX_CALLS_PER_MESSAGE));
    }
    this.asking.add(hostSessionId);
    void this.startWhenTold(hostSessionId, batch.slice(0, MAX_CALLS_PER_MESSAGE)).finally(() => {
      this.asking.delete(hostSessionId);
      if (this.toStart.has(hostSessionId)) {
        this.askToStart(hostSessionId);
      }
    });
  }

  /** Ask the bridge to start `batch`, and run those it says START for; none if it does not answer. */
  private async startWhenTold(hostSessionId: string, batch: Starting[]): Promise<void> {
    const verdicts = new Map<string, ToolStartVerdict>();
    let cause = "";
    try {
      const waitMs = Math.min(Math.max(1_000, ...batch.map((s) => s.ctx.timeRemainingMs())), START_TIMEOUT_MS);
      const response = await this.clientOf(hostSessionId).startToolRequests(
        { hostSessionId, toolRequestIds: batch.map((s) => s.ctx.toolRequestId) },
        { timeoutMs: waitMs, headers: await this.headers() },
      );
      for (const start of response.starts) {
        verdicts.set(start.toolRequestId, start.verdict);
      }
    } catch (error) {
      // The answer is unknown, and running without it could run the request twice (the bridge may
      // send it to another host).
      cause = errorInfo(error)?.reason ?? Codes.TRANSPORT_FAILED;
    }
    for (const starting of batch) {
      const { request, ctx, active } = starting;
      this.starting.delete(ctx.toolRequestId);
      const verdict = verdicts.get(ctx.toolRequestId) ?? ToolStartVerdict.UNSPECIFIED;
      if (verdict === ToolStartVerdict.START && ctx.timeRemainingMs() <= 0) {
        // Given in time, read late (the page was busy, the tab suspended): the caller has TOOL_TIMEOUT.
        notStarted(ctx, "DEADLINE_PASSED");
      } else if (verdict === ToolStartVerdict.START && !ctx.signal.aborted && !this.stopRequested) {
        this.runHandler(request, ctx, active, hostSessionId);
      } else if (verdict === ToolStartVerdict.START) {
        notStarted(ctx, this.stopRequested ? Codes.SHUTTING_DOWN : "CANCELLED");
      } else {
        notStarted(ctx, cause || ToolStartVerdict[verdict]);
      }
    }
  }

  private cancel(cancelled: ToolRequestCancelled): void {
    const active = this.active.get(cancelled.toolRequestId) ?? this.starting.get(cancelled.toolRequestId)?.active;
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
    this.host.report({
      ...ids(ctx),
      code: Codes.SUBMIT_TOOL_RESULT_FAILED,
      message: "The call ended before the handler returned.",
      cause: this.stopRequested ? Codes.SHUTTING_DOWN : Codes.REQUEST_ENDED,
    });
  }

  /** Run the handler; undefined when the call ended (its signal aborted) before it settled. */
  private async execute(argumentsJson: string, ctx: ToolContext): Promise<ToolOutcome | undefined> {
    const handler = this.host.handlerFor(ctx.toolName);
    if (handler === undefined) {
      return runtimeError("TOOL_HANDLER_NOT_FOUND", `No handler for ${ctx.toolName}.`, { tool: ctx.toolName });
    }
    let value: unknown;
    try {
      value = await inHandlerSpan(ctx, () => handler(JSON.parse(argumentsJson) as ToolArguments, ctx));
    } catch (thrown) {
      if (ctx.signal.aborted) {
        return undefined; // it gave up as it was told to
      }
      // The caller gets a compact error: the exception's name, never its text or stack.
      const name = thrown instanceof Error ? thrown.name : typeof thrown;
      this.host.report({ ...ids(ctx), code: Codes.TOOL_HANDLER_ERROR, message: name, cause: "" });
      return runtimeError("TOOL_HANDLER_ERROR", "", { tool: ctx.toolName, exception: name });
    }
    if (ctx.signal.aborted) {
      this.notDelivered(ctx); // it returned after being told to stop: its value goes nowhere
      return undefined;
    }
    const converted = convertReturn(value);
    if (converted.refusedBecause !== undefined) {
      const failure = converted.outcome.outcome;
      this.host.report({
        ...ids(ctx),
        code: Codes.SUBMIT_TOOL_RESULT_FAILED,
        message: failure.case === "error" ? failure.value.message : "",
        cause: converted.refusedBecause,
      });
    }
    return converted.outcome;
  }

  /**
   * Hand the outcome to the bridge, trying transport failures and retryable refusals again until
   * the call's deadline and LATE_SUBMIT_MS past it (a late result is kept beside a TOOL_TIMEOUT). When the stream
   * ended meanwhile (its bridge replica may be gone), wait for the next connection and hand it in
   * there, naming the same request under the new host session. With several bridge replicas, an
   * attempt waits for the answer only its share of the time left (SUBMIT_ATTEMPT_MIN_MS): one left
   * unanswered with nothing heard on the stream since it went out gives the stream up (the bridge
   * is frozen or cut off), as missed heartbeats do, and the result goes to the next replica in the
   * time left. Sending the same outcome twice is safe: the bridge keeps one outcome per request and
   * says whether it was this one. Results that end together share a call (ResultSubmissions); each
   * is answered, and tried again, on its own.
   */
  private async submit(outcome: ToolOutcome, ctx: ToolContext, hostSessionId: string): Promise<void> {
    const giveUpAt = ctx.deadline + LATE_SUBMIT_MS;
    for (let attempt = 1; ; attempt++) {
      let stream = this.openSessions.get(hostSessionId);
      if (stream === undefined || stream.cut.signal.aborted) {
        stream = await this.connection(giveUpAt - Date.now(), hostSessionId);
        if (stream === undefined) {
          this.host.report({
            ...ids(ctx),
            code: Codes.SUBMIT_TOOL_RESULT_FAILED,
            message: "No connection to a bridge before the deadline.",
            cause: this.stopRequested ? Codes.SHUTTING_DOWN : Codes.TRANSPORT_FAILED,
          });
          return;
        }
        hostSessionId = stream.hostSessionId;
      }
      // A refusal of this result alone (in a batch), or the error of the call that carried it.
      let refusal: { readonly reason: string; readonly metadata: Readonly<Record<string, string>> } | undefined;
      let message = "";
      let failure: unknown;
      const sentAt = Date.now();
      const heard = stream.events;
      // Before the deadline, an attempt's share is of the time until it (and the grace), so that a
      // frozen replica is left for the next one in time; after it, of the late window.
      const inTimeMs = ctx.deadline + SUBMIT_GRACE_MS - sentAt;
      const timeoutMs = this.attemptMs(inTimeMs > 0 ? inTimeMs : giveUpAt - sentAt);
      try {
        const submitting = this.submissions.submit(
          stream.client,
          hostSessionId,
          ctx.toolRequestId,
          outcome,
          timeoutMs,
          stream.cut.signal,
        );
        const copy = { hostSessionId, toolRequestId: ctx.toolRequestId, outcome };
        const refused = await this.withCopies(submitting, stream, heard, copy, timeoutMs);
        if (refused === undefined) {
          return;
        }
        refusal = refused;
        message = refused.message;
      } catch (error) {
        if (error instanceof SubmitCut) {
          continue; // its stream was given up: the next connection takes it
        }
        failure = error;
        refusal = errorInfo(error);
        message = error instanceof ConnectError ? error.rawMessage : "";
      }
      if (attempt > 1 && answeredBefore(refusal)) {
        return; // an earlier attempt got through; its answer was lost on the way back
      }
      if (
        failure instanceof ConnectError &&
        failure.code === Code.DeadlineExceeded &&
        giveUpAt > Date.now() &&
        (await this.leaveIfSilent(stream, heard))
      ) {
        continue; // not a word from that bridge since the submit went out: the next replica takes it
      }
      // The transport's own failures, and refusals whose code is retryable (STORE_UNAVAILABLE:
      // the bridge could not read the ledger yet).
      const transient =
        refusal === undefined
          ? failure instanceof ConnectError && TRANSIENT.has(failure.code)
          : refusal.reason in ERROR_TABLE && ERROR_TABLE[refusal.reason as keyof typeof ERROR_TABLE].retryable;
      if (transient && giveUpAt > Date.now() && !this.stopRequested) {
        await new Promise((resolve) => setTimeout(resolve, Math.min(50 * 2 ** attempt, 1_000)));
        continue;
      }
      this.host.report({
        ...ids(ctx),
        code: Codes.SUBMIT_TOOL_RESULT_FAILED,
        message,
        cause: refusal?.reason ?? Codes.TRANSPORT_FAILED,
      });
      return;
    }
  }

  /**
   * `submitting`'s answer, or undefined (taken) when a copy of its result was taken first: copies go
   * to the other replicas when it is not answered within COPY_AFTER_MS with nothing heard on `stream`
   * since `heard` (./copies.ts). The answer is still awaited then, to leave a replica that stays
   * silent, as for any other result.
   */
  private async withCopies(
    submitting: Promise<Submitted>,
    stream: HostStream,
    heard: number,
    copy: Copy,
    timeoutMs: number,
  ): Promise<Submitted> {
    const others = this.clients.filter((client) => client !== stream.client);
    if (others.length === 0) {
      return submitting;
    }
    const late = Symbol("late");
    let timer: ReturnType<typeof setTimeout> | undefined;
    try {
      const first = await Promise.race([
        submitting,
        new Promise<typeof late>((resolve) => {
          timer = setTimeout(() => resolve(late), COPY_AFTER_MS);
        }),
      ]);
      if (first !== late || stream.events > heard || stream.cut.signal.aborted) {
        return await submitting;
      }
    } finally {
      clearTimeout(timer);
    }
    const copying = this.headers().then((headers) => handInCopies(others, copy, timeoutMs, headers));
    const answered = submitting.then(
      () => "answered" as const,
      () => "answered" as const,
    );
    // A copy not taken never wins the race: the result's own answer decides then.
    const copied = copying.then((taken) => (taken ? ("copied" as const) : new Promise<never>(() => {})));
    if ((await Promise.race([answered, copied])) === "answered") {
      return submitting;
    }
    submitting.catch((error: unknown) => {
      if (error instanceof ConnectError && error.code === Code.DeadlineExceeded) {
        void this.leaveIfSilent(stream, heard);
      }
    });
    return undefined;
  }

  /**
   * How long one submit attempt may wait, of the `windowMs` left (whole milliseconds: they go in
   * Connect-Timeout-Ms): all of it with one bridge replica, else its share (another one to go to).
   */
  private attemptMs(windowMs: number): number {
    const share =
      this.clients.length > 1
        ? Math.min(windowMs, Math.max(SUBMIT_ATTEMPT_MIN_MS, Math.min(windowMs / 3, SUBMIT_ATTEMPT_MAX_MS)))
        : windowMs;
    return Math.max(Math.floor(share), 0);
  }

  /**
   * The open host session's stream to hand results in on, once `old`'s ended or was given up: the
   * current session's, if it is really open (its stream not given up, which the state says a
   * little later, once the stream's reader ended). Undefined after `timeoutMs`, or when the host
   * stops with no session open.
   */
  private async connection(timeoutMs: number, old: string): Promise<HostStream | undefined> {
    const until = Date.now() + timeoutMs;
    for (;;) {
      const stream = this.openSessions.get(this.session);
      if (stream !== undefined && !stream.cut.signal.aborted && stream.hostSessionId !== old) {
        return stream;
      }
      const left = until - Date.now();
      if (this.stopRequested || left <= 0) {
        return undefined;
      }
      await this.waiters.wait(left, (e) => e.trigger === "opened" || e.trigger === "stop");
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

/**
 * Take the bridge's clock from its answer to what the page sent at `sentAt` (performance.now()); 0:
 * a bridge that does not send it.
 */
function answered(facts: StreamFacts, serverTimeUnixMs: bigint, sentAt: number): void {
  if (serverTimeUnixMs !== 0n) {
    const sample = Number(serverTimeUnixMs) + 1 - sentAt;
    facts.offsetMs = facts.offsetMs === undefined ? sample : Math.min(facts.offsetMs, sample);
  }
}

/**
 * Milliseconds the request has left: from the bridge's deadline when it gave one (a request read
 * late has less time left than its timeoutMs says), at the earliest it may be on the page's clock,
 * never more than its timeoutMs.
 */
function timeLeftMs(request: ToolRequest, facts: StreamFacts): number {
  if (request.deadlineUnixMs === 0n || facts.offsetMs === undefined) {
    return request.timeoutMs;
  }
  // Whole milliseconds: they end up in Connect-Timeout-Ms, which takes digits only.
  return Math.min(request.timeoutMs, Math.floor(Number(request.deadlineUnixMs) - (facts.offsetMs + performance.now())));
}

/** Say, in the page's console, that a request was not run and why: its ids, never its arguments. */
function notStarted(ctx: ToolContext, cause: string): void {
  console.info("toolmesh: tool request not started", { ...ids(ctx), cause });
}

function ids(ctx: ToolContext): Pick<HostError, "sessionId" | "turnId" | "toolRequestId" | "toolName"> {
  return { sessionId: ctx.sessionId, turnId: ctx.turnId, toolRequestId: ctx.toolRequestId, toolName: ctx.toolName };
}
