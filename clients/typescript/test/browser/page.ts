// The page the browser tests drive: a ToolHost serving test tools, its state on `window.toolmesh`.
// Query: session, baseUrl (several bridge replicas' separated by commas), protocol (connect|grpc-web),
// mode (handlers|webmcp).
import { ToolHost, serveWebMCP, type HostError, type ToolContext } from "../../src/index.js";
import { registerCollectingTracer, type CollectedSpan } from "./collecting_tracer.js";

interface Seen {
  tool: string;
  sessionId: string;
  toolRequestId: string;
  traceContext: Record<string, string>;
}

interface AbortRecord {
  toolRequestId: string;
  reason: string;
}

interface WebMCPDocument {
  modelContext: {
    registerTool(tool: object, options?: { signal?: AbortSignal }): Promise<void>;
    getTools?(): Promise<{ name: string }[]>;
  };
}

const query = new URLSearchParams(location.search);
// traced=1: a tracer provider registered through @opentelemetry/api, its spans on `spans`.
const spans: CollectedSpan[] = query.get("traced") === "1" ? registerCollectingTracer() : [];
const protocol = query.get("protocol") === "grpc-web" ? "grpc-web" : "connect";
const host = new ToolHost({
  baseUrl: (query.get("baseUrl") ?? "").split(","),
  sessionId: query.get("session") ?? "",
  protocol,
  maxBackoffMs: 500,
  // A token from the query, given as a callback (asked before each request), as a page would;
  // the test hands it fresher ones with setToken().
  ...(query.get("token") === null ? {} : { token: async () => currentToken }),
});
let currentToken = query.get("token") ?? "";
const seen: Seen[] = [];
const aborts: AbortRecord[] = [];
const errors: HostError[] = [];
const controllers = new Map<string, AbortController>();
const todos: string[] = [];
// What the SDK warned of on the console (its first argument), in order.
const warnings: string[] = [];
const warn = console.warn.bind(console);
console.warn = (...args: unknown[]) => {
  warnings.push(String(args[0]));
  warn(...args);
};
// The "held" and "held_short" handlers waiting for release(), each with the function that makes it answer.
const held: (() => void)[] = [];

const state = {
  spans,
  seen,
  aborts,
  errors,
  todos,
  warnings,
  started: false,
  startError: "",
  connected: () => host.connected,
  /** Let the first `count` "held" and "held_short" handlers answer (all of them by default), in the
   * order they began; how many there were. */
  release: (count = Infinity) => held.splice(0, count).map((answer) => answer()).length,
  hostSessionId: () => host.hostSessionId,
  /** The token the host's callback gives from now on. */
  setToken: (token: string) => {
    currentToken = token;
  },
  /** Withdraw a WebMCP tool by aborting the signal it was registered with. */
  unregister: (name: string) => controllers.get(name)?.abort(),
  nativeTools: async () => {
    const context = (document as unknown as WebMCPDocument).modelContext;
    return context.getTools ? (await context.getTools()).map((tool) => tool.name) : null;
  },
};
(window as unknown as { toolmesh: typeof state }).toolmesh = state;

function note(tool: string, ctx: ToolContext): void {
  const traceContext = { ...ctx.traceContext };
  seen.push({ tool, sessionId: ctx.sessionId, toolRequestId: ctx.toolRequestId, traceContext });
}

host.onError((error) => errors.push(error));

if (query.get("mode") === "webmcp") {
  serveWebMCP(host);
  const context = (document as unknown as WebMCPDocument).modelContext;
  await context.registerTool({
    name: "add_todo",
    description: "Add an item to the to-do list.",
    inputSchema: { type: "object", properties: { text: { type: "string" } }, required: ["text"] },
    annotations: { idempotentHint: false },
    execute: async (input: { text: string }) => {
      todos.push(input.text);
      return { content: [{ type: "text", text: `Added ${input.text}` }] };
    },
  });
  for (const [name, description, execute] of [
    ["list_todos", "List the to-do items.", async () => ({ todos })],
    ["fail_todo", "Always reports an error.", async () => ({ isError: true, content: [{ type: "text", text: "No such list." }] })],
  ] as const) {
    const controller = new AbortController();
    controllers.set(name, controller);
    await context.registerTool(
      { name, description, annotations: { readOnlyHint: true }, execute },
      { signal: controller.signal },
    );
  }
} else {
  host.onTool(
    "echo",
    (args, ctx) => {
      note("echo", ctx);
      return { echo: args, sessionId: ctx.sessionId, turnId: ctx.turnId, toolRequestId: ctx.toolRequestId };
    },
    {
      description: "Echo the arguments.",
      inputSchema: { type: "object", properties: { text: { type: "string" } } },
      annotations: { readOnly: true, idempotent: true },
    },
  );
  host.onTool(
    "domain_fail",
    () => ({
      error: {
        code: "NO_ACTIVE_SELECTION",
        message: "Select text before using replace_selection.",
        details: { documentId: "doc-7" },
        retryable: true,
      },
    }),
    { description: "Answers with a domain error." },
  );
  host.onTool(
    "boom",
    () => {
      throw new RangeError("database password is hunter2");
    },
    { description: "Throws." },
  );
  host.onTool("not_json", () => ({ value: new Map([["a", 1]]) }), { description: "Returns a Map." });
  host.onTool(
    "slow",
    (_args, ctx) =>
      new Promise((_resolve, reject) => {
        note("slow", ctx);
        ctx.signal.addEventListener("abort", () => {
          aborts.push({ toolRequestId: ctx.toolRequestId, reason: (ctx.signal.reason as DOMException).name });
          reject(ctx.signal.reason);
        });
      }),
    { description: "Waits until told to stop.", timeoutMs: 700 },
  );
  host.onTool(
    "late",
    (_args, ctx) =>
      new Promise((resolve) => {
        // Told to stop, it answers anyway: the value goes nowhere, and onError hears of it.
        ctx.signal.addEventListener("abort", () => resolve({ late: true }));
      }),
    { description: "Answers only once told to stop.", timeoutMs: 700 },
  );
  host.onTool(
    "steps",
    async (args, ctx) => {
      const count = Number(args.count ?? 3);
      for (let step = 1; step <= count; step++) {
        await ctx.reportProgress(step, count, `step ${step}`);
        // Past the bridge's interval, so that no report is coalesced away.
        await new Promise((resolve) => setTimeout(resolve, 150));
      }
      return { done: count };
    },
    { description: "Reports progress in steps, then answers." },
  );
  host.onTool("noop", () => ({ ok: true }), {
    description: "Does nothing (the benchmark's tool).",
    inputSchema: { type: "object", properties: { n: { type: "integer" } } },
  });
  for (const [name, description, timeoutMs] of [
    ["held", "Answers once the test releases it.", 30_000],
    ["held_short", "Answers once the test releases it, within a short timeout.", 5_000],
  ] as const) {
    host.onTool(
      name,
      (args, ctx) =>
        new Promise((resolve) => {
          note(name, ctx);
          held.push(() => resolve({ held: args, toolRequestId: ctx.toolRequestId }));
        }),
      { description, timeoutMs },
    );
  }
  host.onTool(
    "pause",
    (args) => new Promise((resolve) => setTimeout(() => resolve({ n: args.n }), 200)),
    { description: "Answers after 200 ms, so that calls overlap a stream's renewal." },
  );
  // Served but not declared: the tests put it themselves.
  host.onTool("undeclared", () => "served");
}

try {
  await host.start({ timeoutMs: Number(query.get("startTimeoutMs") ?? 10_000) });
  state.started = true;
} catch (error) {
  state.startError = String(error);
}
