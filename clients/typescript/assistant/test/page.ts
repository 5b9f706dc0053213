// The assistant's browser-test page: an Assistant over WebMCP tools and its widget, driven from
// tests/client/typescript/test_web_assistant.py. Query: model (the scripted endpoint), mc
// (native | standin | absent | incomplete | throws | notlist), schema (ok | notobject |
// dialect), timeoutMs, maxRounds, maxMessages; with baseUrl, session and token, the tools are that toolmesh
// session's instead (the toolmesh() channel, over the services' web port; registryUrl when the
// registry's is another; protocol: connect or grpc-web). traced=1: a tracer provider registered
// through @opentelemetry/api, its spans on `spans`.
import { registerCollectingTracer, type CollectedSpan } from "../../test/browser/collecting_tracer.js";
import { AgentError, Assistant, webmcp, type JsonValue } from "../src/index.js";
import { toolmesh } from "../src/toolmesh.js";
import { defineAssistantElement, type ToolmeshAssistantElement } from "../src/widget.js";

type Execute = (input: Record<string, JsonValue>, client: { signal?: AbortSignal }) => unknown;
interface Tool {
  name: string;
  description: string;
  inputSchema?: unknown;
  annotations?: Record<string, boolean>;
  execute: Execute;
}

/** A stand-in document.modelContext: getTools, executeTool (with the signal), toolchange. */
class StandInModelContext extends EventTarget {
  private readonly tools = new Map<string, Tool>();
  registerTool(tool: Tool): void {
    this.tools.set(tool.name, tool);
    this.dispatchEvent(new Event("toolchange"));
  }
  unregisterTool(name: string): void {
    this.tools.delete(name);
    this.dispatchEvent(new Event("toolchange"));
  }
  getTools(): unknown {
    return [...this.tools.values()].map(({ execute: _, ...rest }) => rest);
  }
  async executeTool(tool: { name: string }, input: Record<string, JsonValue>, options: { signal?: AbortSignal } = {}) {
    const found = this.tools.get(tool.name);
    if (found === undefined) throw new DOMException("no such tool", "NotFoundError");
    return found.execute(input, options.signal === undefined ? {} : { signal: options.signal });
  }
}

const query = new URLSearchParams(location.search);
const mode = query.get("mc") ?? "standin";
const spans: CollectedSpan[] = query.get("traced") === "1" ? registerCollectingTracer() : [];
const doc = document as unknown as { modelContext?: unknown };
const notes: string[] = [];
const aborts: string[] = [];
let releaseSlow: (() => void) | null = null;

if (mode === "standin") {
  Object.defineProperty(document, "modelContext", { value: new StandInModelContext(), configurable: true });
} else if (mode === "absent") {
  Object.defineProperty(document, "modelContext", { value: undefined, configurable: true });
} else if (mode === "incomplete") {
  Object.defineProperty(document, "modelContext", { value: { registerTool() {} }, configurable: true });
} else if (mode === "throws" || mode === "notlist") {
  Object.defineProperty(document, "modelContext", {
    value: {
      registerTool() {},
      executeTool() {},
      getTools() {
        if (mode === "throws") throw new Error("broken");
        return { not: "a list" };
      },
    },
    configurable: true,
  });
}
const context = doc.modelContext as { registerTool?(tool: Tool): unknown; unregisterTool?(name: string): unknown };

const render = (): void => {
  document.getElementById("notes")!.replaceChildren(
    ...notes.map((note) => Object.assign(document.createElement("li"), { textContent: note })),
  );
};

const schemaMode = query.get("schema") ?? "ok";
const tools: Tool[] = [
  {
    name: "add_note",
    description: "Add a note to the page's list.",
    inputSchema:
      schemaMode === "notobject"
        ? "a string is not a schema"
        : schemaMode === "dialect"
          ? { $schema: "http://json-schema.org/draft-04/schema#", type: "object" }
          : { type: "object", properties: { text: { type: "string", minLength: 1 } }, required: ["text"] },
    execute: (input) => {
      notes.push(String(input["text"]));
      render();
      return { content: [{ type: "text", text: `Added ${String(input["text"])}` }] };
    },
  },
  {
    name: "list_notes",
    description: "List the page's notes.",
    inputSchema: { type: "object", properties: {} },
    annotations: { readOnlyHint: true },
    execute: () => ({ notes }),
  },
  {
    name: "clear_notes",
    description: "Remove every note.",
    inputSchema: { type: "object", properties: {} },
    annotations: { destructiveHint: true },
    execute: () => {
      notes.length = 0;
      render();
      return { content: [{ type: "text", text: "Cleared." }] };
    },
  },
  {
    name: "fail_note",
    description: "Always throws.",
    inputSchema: { type: "object", properties: {} },
    execute: () => {
      throw new Error("the handler failed");
    },
  },
  {
    name: "slow_note",
    description: "Waits until released or aborted.",
    inputSchema: { type: "object", properties: {} },
    execute: (_input, client) =>
      new Promise((resolve) => {
        releaseSlow = () => resolve({ slow: true });
        client.signal?.addEventListener("abort", () => aborts.push(String(client.signal?.reason?.code ?? "aborted")));
      }),
  },
  {
    name: "big_note",
    description: "A result longer than the cap.",
    inputSchema: { type: "object", properties: {} },
    execute: () => ({ text: "x".repeat(20_000) }),
  },
];
if (context?.registerTool !== undefined && mode !== "throws" && mode !== "notlist") {
  for (const tool of tools) await context.registerTool(tool);
}

/** The RunTool requests the toolmesh() channel sent (each attempt of a call is one). */
const runToolRequests: string[] = [];
const countingFetch: typeof fetch = (input, init) => {
  const url = input instanceof Request ? input.url : String(input);
  if (url.endsWith("/RunTool")) runToolRequests.push(url);
  return fetch(input, init);
};

defineAssistantElement();
const element = document.querySelector("toolmesh-assistant") as ToolmeshAssistantElement;
const assistant = new Assistant({
  model: { url: query.get("model") ?? "/v1", model: "scripted" },
  tools: query.has("baseUrl")
    ? toolmesh({
        baseUrl: query.get("baseUrl")!,
        ...(query.has("registryUrl") ? { registryUrl: query.get("registryUrl")! } : {}),
        sessionId: query.get("session") ?? "",
        token: query.get("token") ?? "",
        fetch: countingFetch,
        protocol: query.get("protocol") === "grpc-web" ? "grpc-web" : "connect",
      })
    : webmcp(),
  confirm: element.confirm,
  ...(query.has("timeoutMs") ? { timeoutMs: Number(query.get("timeoutMs")) } : {}),
  ...(query.has("maxRounds") ? { maxRounds: Number(query.get("maxRounds")) } : {}),
  ...(query.has("maxMessages") ? { maxMessages: Number(query.get("maxMessages")) } : {}),
});
element.assistant = assistant;

interface Sent {
  answer?: string;
  code?: string;
}
const sent: Sent[] = [];

(window as unknown as { toolmesh: unknown }).toolmesh = {
  started: true,
  startError: "",
  assistant,
  notes,
  aborts,
  sent,
  runToolRequests,
  spans,
  /** send() from the page; the outcome lands in `sent`. */
  send(text: string): number {
    const index = sent.length;
    sent.push({});
    assistant.send(text).then(
      (answer) => (sent[index] = { answer }),
      (error: unknown) => (sent[index] = { code: error instanceof AgentError ? error.code : String(error) }),
    );
    return index;
  },
  /** Type into the widget's input and submit it, as a person would. */
  type(text: string): void {
    const root = element.shadowRoot!;
    (root.querySelector("#input") as HTMLTextAreaElement).value = text;
    void element.submit();
  },
  /** Change the tools: a toolchange event. */
  touch(): void {
    context.unregisterTool?.("big_note");
  },
  releaseSlow: () => releaseSlow?.(),
  error: () => assistant.state.error?.code ?? null,
  /** The widget's status line and progress bar: [text, value or null, max, hidden]. */
  progress: () => {
    const bar = element.shadowRoot!.querySelector("progress") as HTMLProgressElement;
    return [
      (element.shadowRoot!.querySelector("[role=status]") as HTMLElement).textContent,
      bar.hasAttribute("value") ? bar.value : null,
      bar.max,
      bar.hidden,
    ];
  },
  status: () => assistant.state.status,
  alert: () => (element.shadowRoot!.querySelector("[role=alert]") as HTMLElement).textContent,
  alertHidden: () => (element.shadowRoot!.querySelector("[role=alert]") as HTMLElement).hidden,
  log: () => (element.shadowRoot!.querySelector("ol") as HTMLElement).textContent,
  items: () => Array.from(element.shadowRoot!.querySelectorAll("li"), (item) => item.textContent),
  toolResults: () =>
    assistant.state.messages.flatMap((m) =>
      m.role === "tool"
        ? [{ name: m.call.name, ok: m.result.ok, code: m.result.code, text: m.result.text, data: m.result.data, cause: m.result.cause }]
        : [],
    ),
  dialogOpen: () => (element.shadowRoot!.querySelector("dialog") as HTMLDialogElement).open,
  /** The id of the focused element, through the shadow root. */
  focused: () => {
    const active = document.activeElement;
    return active === element ? `widget:${element.shadowRoot!.activeElement?.id ?? ""}` : (active?.id ?? active?.tagName ?? "");
  },
  focusInput: () => (element.shadowRoot!.querySelector("#input") as HTMLElement).focus(),
  stop: () => (element.shadowRoot!.querySelector("#stop") as HTMLButtonElement).click(),
};

/** The bench: `calls` direct executeTool calls of list_notes, then `calls` turns that each make
 * that one call through an Assistant (an in-page model: no network), each in ms per call. */
async function bench(calls: number): Promise<{ directMs: number; turnMs: number }> {
  const mc = doc.modelContext as { getTools(): Promise<{ name: string }[]>; executeTool(t: unknown, i: object): Promise<unknown> };
  const listed = (await mc.getTools()).find((t) => t.name === "list_notes");
  let start = performance.now();
  for (let i = 0; i < calls; i += 1) await mc.executeTool(listed, {});
  const directMs = (performance.now() - start) / calls;
  let round = 0;
  const benched = new Assistant({
    tools: webmcp(),
    model: {
      async complete() {
        round += 1;
        return round % 2 === 1
          ? { text: "", toolCalls: [{ id: `c${round}`, name: "list_notes", argumentsJson: "{}" }] }
          : { text: "done", toolCalls: [] };
      },
    },
  });
  start = performance.now();
  for (let i = 0; i < calls; i += 1) {
    await benched.send("list");
    benched.clear();
  }
  const turnMs = (performance.now() - start) / calls;
  benched.dispose();
  return { directMs, turnMs };
}
(window as unknown as { toolmesh: { bench: typeof bench } }).toolmesh.bench = bench;

/** The memory bench: `count` more turns, each one list_notes call and an answer, through an
 * Assistant the widget shows (an in-page model: no network). `maxMessages` as the option; the
 * assistant is made on the first call and kept for the next. Returns the widget's list length. */
let memoryAssistant: Assistant | null = null;
async function memoryTurns(count: number, maxMessages: number | null): Promise<number> {
  if (memoryAssistant === null) {
    let round = 0;
    memoryAssistant = new Assistant({
      tools: webmcp(),
      ...(maxMessages === null ? {} : { maxMessages }),
      model: {
        async complete() {
          round += 1;
          return round % 2 === 1
            ? { text: "", toolCalls: [{ id: `c${round}`, name: "list_notes", argumentsJson: "{}" }] }
            : { text: `Turn ${round / 2}: there are no notes.`, toolCalls: [] };
        },
      },
    });
    element.assistant = memoryAssistant;
  }
  for (let i = 0; i < count; i += 1) await memoryAssistant.send(`list the notes (${i})`);
  return element.shadowRoot!.querySelectorAll("li").length;
}
(window as unknown as { toolmesh: { memoryTurns: typeof memoryTurns } }).toolmesh.memoryTurns = memoryTurns;
