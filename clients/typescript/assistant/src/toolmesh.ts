// A toolmesh session's tools: listed and watched through the registry, called through the
// invocation service, both over Connect from the page (`@toolmesh/assistant/toolmesh`).
// The services' caller RPCs on the web port are the server side's to provide; until they
// are, check() reports UNSUPPORTED_WEBMCP (the services this assistant needs are missing).
import { Code, ConnectError, createClient, type Interceptor } from "@connectrpc/connect";
import { createConnectTransport } from "@connectrpc/connect-web";
import { InvocationService } from "../../src/gen/toolmesh/v1/invocation_pb.js";
import { RegistryService } from "../../src/gen/toolmesh/v1/registry_pb.js";
import { ErrorKind, type ToolDefinition } from "../../src/gen/toolmesh/v1/tool_pb.js";
import type { ChannelTool, InvokeOptions, ToolChannel, ToolList } from "./channel.js";
import { AgentError } from "./errors.js";
import { DOMAIN_ERROR_TURN, RUNTIME_TO_TURN, UNKNOWN_CODE_TURN } from "./gen/turns.js";
import { failure, plainJson, success, type JsonValue, type ToolResult } from "./results.js";

export interface ToolmeshChannelOptions {
  /** The web port of toolmesh's services (Connect over HTTP/1.1). */
  readonly baseUrl: string;
  readonly sessionId: string;
  /** A caller token (role `call`) naming the session, or a function asked before each request. */
  readonly token?: string | (() => string | Promise<string>);
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
  const transport = createConnectTransport({ baseUrl: options.baseUrl, interceptors: [auth] });
  const registry = createClient(RegistryService, transport);
  const invocation = createClient(InvocationService, transport);
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
    async invoke(tool, args, { signal, turnId, timeoutMs }: InvokeOptions): Promise<ToolResult> {
      let response;
      try {
        response = await invocation.invokeTool(
          { sessionId: options.sessionId, turnId, toolName: tool.name, argumentsJson: JSON.stringify(args) },
          { signal, timeoutMs },
        );
      } catch (error) {
        const code = ConnectError.from(error).code;
        const runtime = code === Code.DeadlineExceeded ? "CALLER_DEADLINE_EXCEEDED" : "TRANSPORT_FAILED";
        return failure(
          RUNTIME_TO_TURN[runtime] ?? UNKNOWN_CODE_TURN,
          `No outcome arrived (${runtime}); the tool may or may not have run.`,
          runtime,
        );
      }
      // The result arrived: the invocation service need not keep it for a replay.
      void invocation.confirmDelivery({ toolRequestIds: [response.toolRequestId] }).catch(() => undefined);
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
      const code =
        error.kind === ErrorKind.DOMAIN ? DOMAIN_ERROR_TURN : (RUNTIME_TO_TURN[error.code] ?? UNKNOWN_CODE_TURN);
      return failure(code, `[${error.code}] ${error.message}`, error.code, details);
    },
    dispose() {
      watching.abort();
      waiters.clear();
    },
  };
}
