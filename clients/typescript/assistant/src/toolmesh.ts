// A toolmesh session's tools: listed and watched through the registry, called through the
// invocation service, both over Connect from the page (`@toolmesh/assistant/toolmesh`).
//
// Each call is a RunTool stream (the handler's progress as it runs). When it ends with no
// outcome (the connection dropped, the service was going away), the channel makes an exact
// retry, the same session, tool and arguments, which the ledger joins to the running
// invocation or answers with its outcome: the tool runs once. At most RETRY_ATTEMPTS attempts
// in all, within the call's deadline; then a failed result that says no outcome arrived.
import { Code, ConnectError, createClient, type Interceptor } from "@connectrpc/connect";
import { createConnectTransport, createGrpcWebTransport } from "@connectrpc/connect-web";
import { errorInfo } from "../../src/errors.js";
import { ERROR_TABLE } from "../../src/gen/tables.js";
import { InvocationService, type InvokeToolResponse } from "../../src/gen/toolmesh/v1/invocation_pb.js";
import { RegistryService } from "../../src/gen/toolmesh/v1/registry_pb.js";
import { ErrorKind, type ToolDefinition } from "../../src/gen/toolmesh/v1/tool_pb.js";
import type { ChannelTool, InvokeOptions, ToolChannel, ToolList } from "./channel.js";
import { AgentError } from "./errors.js";
import { DOMAIN_ERROR_TURN, RUNTIME_TO_TURN, UNKNOWN_CODE_TURN } from "./gen/turns.js";
import { failure, plainJson, success, type JsonValue, type ToolResult } from "./results.js";
import { endSpan, startToolSpan, traceHeaders } from "./tracing.js";

/** Attempts of one call in all (the first and its exact retries). */
export const RETRY_ATTEMPTS = 3;
/** The pause before the first exact retry; it doubles before each next one. */
export const RETRY_BACKOFF_MS = 200;
// Failures without a toolmesh ErrorInfo that are the connection's (a dropped connection, a proxy's
// 5xx), not a refusal: the request may have reached the service.
const TRANSPORT_CODES: ReadonlySet<Code> = new Set([Code.Unknown, Code.Unavailable, Code.Internal, Code.Aborted]);

/**
 * Why a call failed with `error` and no outcome; `refusal` when an exact retry cannot help (a
 * typed refusal, nothing ran; or the caller's deadline passed), else the retry is safe.
 */
function classify(error: unknown): { cause: string; final: boolean; refusal?: ToolResult } {
  const connect = ConnectError.from(error);
  if (connect.code === Code.DeadlineExceeded) return { cause: "CALLER_DEADLINE_EXCEEDED", final: true };
  const reason = errorInfo(connect)?.reason;
  if (reason === undefined) {
    if (TRANSPORT_CODES.has(connect.code)) return { cause: "TRANSPORT_FAILED", final: false };
    const name = Code[connect.code];
    return { cause: name, final: true, refusal: failure("TOOL_UNAVAILABLE", `The service refused the call (${name}).`, name) };
  }
  const spec = (ERROR_TABLE as Readonly<Record<string, { retryable: boolean; callerFault: boolean }>>)[reason];
  if (spec !== undefined && spec.retryable && !spec.callerFault) return { cause: reason, final: false };
  const code = RUNTIME_TO_TURN[reason] ?? UNKNOWN_CODE_TURN;
  return { cause: reason, final: true, refusal: failure(code, `[${reason}] ${connect.rawMessage}`, reason) };
}

/** The result of a call that got no outcome after `attempts`: the tool may or may not have run. */
function noOutcome(cause: string, attempts: number, toolRequestId: string): ToolResult {
  const tried = attempts > 1 ? ` after ${attempts} attempts` : "";
  const named = toolRequestId === "" ? "" : ` (invocation ${toolRequestId})`;
  return failure(
    RUNTIME_TO_TURN[cause] ?? UNKNOWN_CODE_TURN,
    `No outcome arrived${tried} (${cause}); the tool may or may not have run${named}.`,
    cause,
  );
}

/** Wait `ms`; false when `signal` aborted first. */
function paused(ms: number, signal: AbortSignal): Promise<boolean> {
  return new Promise((resolve) => {
    const timer = setTimeout(() => {
      signal.removeEventListener("abort", stop);
      resolve(true);
    }, ms);
    const stop = (): void => {
      clearTimeout(timer);
      resolve(false);
    };
    signal.addEventListener("abort", stop, { once: true });
  });
}

/** What the model reads of an outcome. */
function outcomeOf(response: InvokeToolResponse): ToolResult {
  const outcome = response.outcome?.outcome;
  if (outcome?.case === "resultJson") {
    try {
      return success(plainJson(JSON.parse(outcome.value)));
    } catch {
      return failure("EXECUTION_FAILED", "The result is not JSON.", "not_json");
    }
  }
  if (outcome?.case !== "error") {
    return failure("EXECUTION_FAILED", "The outcome is empty.", "no_outcome");
  }
  const error = outcome.value;
  let details: JsonValue = null;
  try {
    details = error.detailsJson ? plainJson(JSON.parse(error.detailsJson)) : null;
  } catch {
    details = null;
  }
  const code = error.kind === ErrorKind.DOMAIN ? DOMAIN_ERROR_TURN : (RUNTIME_TO_TURN[error.code] ?? UNKNOWN_CODE_TURN);
  return failure(code, `[${error.code}] ${error.message}`, error.code, details);
}

export interface ToolmeshChannelOptions {
  /** The web port of toolmesh's services (Connect over HTTP/1.1): `toolmesh up`'s, or the
   * standalone invocation service's. */
  readonly baseUrl: string;
  /** The registry's web port, when it is not `baseUrl` (standalone services). */
  readonly registryUrl?: string;
  readonly sessionId: string;
  /** A caller token (role `call`) naming the session, or a function asked before each request. */
  readonly token?: string | (() => string | Promise<string>);
  /** The web port's protocol, as `@toolmesh/host`'s option: Connect (the default) or gRPC-Web. */
  readonly protocol?: "connect" | "grpc-web";
  /** The fetch to send requests with (default: the page's). */
  readonly fetch?: typeof globalThis.fetch;
}

/** A ToolChannel over a toolmesh session. */
export function toolmesh(options: ToolmeshChannelOptions): ToolChannel {
  const auth: Interceptor = (next) => async (request) => {
    if (options.token !== undefined) {
      const token = typeof options.token === "string" ? options.token : await options.token();
      request.header.set("authorization", `Bearer ${token}`);
    }
    return next(request);
  };
  const transport = (baseUrl: string) => {
    const settings = { baseUrl, interceptors: [auth], ...(options.fetch !== undefined ? { fetch: options.fetch } : {}) };
    return options.protocol === "grpc-web" ? createGrpcWebTransport(settings) : createConnectTransport(settings);
  };
  const invocationTransport = transport(options.baseUrl);
  const registry = createClient(
    RegistryService,
    options.registryUrl === undefined ? invocationTransport : transport(options.registryUrl),
  );
  const invocation = createClient(InvocationService, invocationTransport);
  let revision: number | null = null;
  const waiters = new Set<() => void>();
  const watching = new AbortController();
  let watch: Promise<void> | null = null;

  const startWatch = (): void => {
    watch ??= (async () => {
      try {
        for await (const change of registry.watchTools({ sessionId: options.sessionId }, { signal: watching.signal })) {
          revision = Number(change.revision);
          for (const wake of [...waiters]) wake();
        }
      } catch {
        // The watch ended; revisions are read again with ListTools.
      } finally {
        watch = null;
      }
    })();
  };

  const toTool = (definition: ToolDefinition): ChannelTool => {
    let schema: unknown = definition.inputSchemaJson;
    try {
      schema = definition.inputSchemaJson === "" ? { type: "object" } : (JSON.parse(definition.inputSchemaJson) as unknown);
    } catch {
      // Left as text: offering it fails with INVALID_SCHEMA.
    }
    return {
      name: definition.name,
      description: definition.description,
      inputSchema: schema,
      requiresConfirmation: definition.annotations?.requiresConfirmation === true,
      ...(definition.timeoutMs > 0 ? { timeoutMs: definition.timeoutMs } : {}),
    };
  };

  const list = async (signal: AbortSignal): Promise<ToolList> => {
    try {
      const response = await registry.listTools({ sessionId: options.sessionId }, { signal });
      revision = Number(response.revision);
      return { revision, tools: response.tools.map(toTool) };
    } catch (error) {
      if (signal.aborted) throw signal.reason;
      const code = ConnectError.from(error).code;
      if (code === Code.Unimplemented || code === Code.NotFound) {
        throw new AgentError("UNSUPPORTED_WEBMCP", "The registry is not reachable from pages.");
      }
      throw new AgentError("DISCOVERY_FAILED", `ListTools failed (${Code[code]}).`);
    }
  };

  const confirm = (toolRequestId: string, attachmentIds: readonly string[]): void => {
    if (toolRequestId === "") return;
    const delivered = attachmentIds.filter((id) => id !== "").map((attachmentId) => ({ toolRequestId, attachmentId }));
    // The outcome arrived: the invocation service need not keep it for this page's replay.
    void invocation
      .confirmDelivery(delivered.length > 0 ? { attachments: delivered } : { toolRequestIds: [toolRequestId] })
      .catch(() => undefined);
  };

  return {
    async check() {
      if (!options.baseUrl || !options.sessionId) {
        throw new AgentError("UNSUPPORTED_WEBMCP", "toolmesh() needs a baseUrl and a sessionId.");
      }
      startWatch();
    },
    listTools: list,
    async currentRevision(signal) {
      return (await list(signal)).revision;
    },
    waitForChange(at, signal) {
      startWatch();
      return new Promise((resolve) => {
        const wake = (): void => {
          if (revision !== null && revision !== at) {
            waiters.delete(wake);
            resolve();
          }
        };
        waiters.add(wake);
        wake();
        signal.addEventListener("abort", () => waiters.delete(wake), { once: true });
      });
    },
    async invoke(tool, args, options: InvokeOptions): Promise<ToolResult> {
      const traced = startToolSpan(tool.name, options.turnId, options.callId, options.signal);
      const result = await run(tool, args, options, traceHeaders(traced));
      endSpan(traced, result.code === null ? undefined : new AgentError(result.code));
      return result;
    },
    dispose() {
      watching.abort();
      waiters.clear();
    },
  };

  /** One call: its RunTool attempts (each with `headers`) until an outcome, a refusal or the give-up. */
  async function run(
    tool: ChannelTool,
    args: { [key: string]: JsonValue },
    { signal, turnId, timeoutMs, onProgress }: InvokeOptions,
    headers: Record<string, string>,
  ): Promise<ToolResult> {
    const call = { sessionId: options.sessionId, turnId, toolName: tool.name, argumentsJson: JSON.stringify(args) };
    const giveUpAt = Date.now() + timeoutMs;
    // This page's attachments to the invocation: each attempt that got none confirms with the one that did.
    const attachments = new Map<string, string[]>();
    let invocationId = "";
    let lastCause = "TRANSPORT_FAILED";
    for (let attempt = 1; ; attempt += 1) {
      const left = giveUpAt - Date.now();
      if (left <= 0) return noOutcome("CALLER_DEADLINE_EXCEEDED", attempt - 1, invocationId);
      let attachment = "";
      try {
        for await (const event of invocation.runTool({ call }, { signal, timeoutMs: left, headers })) {
          const { case: kind, value } = event.event;
          if (kind === "started") {
            invocationId = value.toolRequestId;
            attachment = value.attachmentId;
          } else if (kind === "progress") {
            onProgress?.({
              progress: value.progress,
              ...(value.total !== undefined ? { total: value.total } : {}),
              message: value.message,
            });
          } else if (kind === "outcome") {
            confirm(value.toolRequestId, [value.attachmentId, ...(attachments.get(value.toolRequestId) ?? [])]);
            return outcomeOf(value);
          }
        }
        lastCause = "TRANSPORT_FAILED"; // the stream ended without its outcome
      } catch (error) {
        if (signal.aborted) {
          // The assistant stopped waiting (Stop, its deadline): stop the tool too, when it is known.
          if (invocationId !== "") {
            void invocation.cancelInvocation({ toolRequestId: invocationId }).catch(() => undefined);
          }
          return failure("ABORTED", "The call was stopped.", "aborted");
        }
        const verdict = classify(error);
        if (verdict.refusal !== undefined) return verdict.refusal;
        if (verdict.final) return noOutcome(verdict.cause, attempt, invocationId);
        lastCause = verdict.cause;
      }
      if (invocationId !== "" && attachment !== "") {
        attachments.set(invocationId, [...(attachments.get(invocationId) ?? []), attachment]);
      }
      // No outcome came back: an exact retry (the same session, tool and arguments) joins the
      // invocation while it runs, or replays its outcome; it never runs the tool again.
      if (attempt >= RETRY_ATTEMPTS) return noOutcome(lastCause, attempt, invocationId);
      const pause = RETRY_BACKOFF_MS * 2 ** (attempt - 1);
      if (giveUpAt - Date.now() <= pause) return noOutcome("CALLER_DEADLINE_EXCEEDED", attempt, invocationId);
      if (!(await paused(pause, signal))) return failure("ABORTED", "The call was stopped.", "aborted");
    }
  }
}
