// The example page: a small notes app whose tools toolmesh serves (see README, "Tools served from a page").
import { ToolHost, serveWebMCP, type ToolContext } from "../src/index.js";

const query = new URLSearchParams(location.search);
const session = query.get("session") ?? "demo";
const baseUrl = query.get("bridge") ?? "http://127.0.0.1:7404";
const notes: string[] = [];

const $ = (id: string): HTMLElement => document.getElementById(id) as HTMLElement;
$("session").textContent = session;
$("try").textContent =
  `toolmesh tool-call --thread-id ${session} --tool add_note --args '{"text": "buy milk"}'\n` +
  `toolmesh tool-call --thread-id ${session} --tool list_notes`;

function logLine(kind: "in" | "out" | "err", text: string): void {
  const line = document.createElement("div");
  line.className = kind;
  line.textContent = `${new Date().toLocaleTimeString()}  ${text}`;
  $("calls").prepend(line);
}

function render(): void {
  $("notes").replaceChildren(
    ...notes.map((note) => {
      const item = document.createElement("li");
      item.textContent = note;
      return item;
    }),
  );
}

/** Logs each call as it arrives and as it is answered. */
function logged<T>(name: string, handler: (args: Record<string, unknown>, ctx: ToolContext) => T) {
  return async (args: Record<string, unknown>, ctx: ToolContext): Promise<Awaited<T>> => {
    logLine("in", `→ ${name} ${JSON.stringify(args)}  (turn ${ctx.turnId}, ${ctx.toolRequestId})`);
    const result = await handler(args, ctx);
    logLine("out", `← ${name} ${JSON.stringify(result)}`);
    return result;
  };
}

const host = new ToolHost({ baseUrl, sessionId: session });
host.onError((error) => logLine("err", `${error.code} ${error.toolName} ${error.cause} ${error.message}`));

host.onTool(
  "add_note",
  logged("add_note", (args) => {
    notes.push(String(args["text"]));
    render();
    return { added: args["text"], count: notes.length };
  }),
  {
    description: "Add a note to the page's list.",
    inputSchema: { type: "object", properties: { text: { type: "string", minLength: 1 } }, required: ["text"] },
  },
);
host.onTool(
  "list_notes",
  logged("list_notes", () => ({ notes })),
  { description: "List the page's notes.", annotations: { readOnly: true, idempotent: true } },
);

// Tools the page registers with WebMCP are served through toolmesh too.
serveWebMCP(host);
const modelContext = (document as unknown as { modelContext: { registerTool(tool: object): Promise<void> } })
  .modelContext;
await modelContext.registerTool({
  name: "clear_notes",
  description: "Remove every note.",
  annotations: { destructiveHint: true },
  execute: logged("clear_notes", () => {
    notes.length = 0;
    render();
    return { content: [{ type: "text", text: "Cleared." }] };
  }),
});

setInterval(() => {
  $("status").textContent = host.connected ? `connected (${host.hostSessionId})` : "reconnecting…";
  $("status").className = host.connected ? "on" : "off";
}, 250);
await host.start({ timeoutMs: 60_000 });
