// The assistant example: a notes page whose WebMCP tools the assistant calls (README, "Example").
import { Assistant, webmcp } from "../src/index.js";
import { defineAssistantElement, type ToolmeshAssistantElement } from "../src/widget.js";

interface Tool {
  name: string;
  description: string;
  inputSchema: object;
  annotations?: Record<string, boolean>;
  execute: (input: Record<string, unknown>) => unknown;
}

// Where the browser has no WebMCP: a stand-in with getTools, executeTool and toolchange.
if (!("modelContext" in document)) {
  const tools = new Map<string, Tool>();
  const context = Object.assign(new EventTarget(), {
    registerTool(tool: Tool) {
      tools.set(tool.name, tool);
      context.dispatchEvent(new Event("toolchange"));
    },
    getTools: () => [...tools.values()],
    executeTool: async (tool: Tool, input: Record<string, unknown>) => tools.get(tool.name)?.execute(input),
  });
  Object.defineProperty(document, "modelContext", { value: context });
}
const modelContext = (document as unknown as { modelContext: { registerTool(tool: Tool): unknown } }).modelContext;

const notes: string[] = [];
const render = (): void => {
  document.getElementById("notes")!.replaceChildren(
    ...notes.map((note) => Object.assign(document.createElement("li"), { textContent: note })),
  );
};
const text = (value: string) => ({ content: [{ type: "text", text: value }] });

await modelContext.registerTool({
  name: "add_note",
  description: "Add a note to the page's list.",
  inputSchema: { type: "object", properties: { text: { type: "string", minLength: 1 } }, required: ["text"] },
  execute: (input) => {
    notes.push(String(input["text"]));
    render();
    return text(`Added "${String(input["text"])}" (${notes.length} notes).`);
  },
});
await modelContext.registerTool({
  name: "list_notes",
  description: "List the page's notes.",
  inputSchema: { type: "object", properties: {} },
  annotations: { readOnlyHint: true },
  execute: () => text(notes.length ? notes.map((n, i) => `${i + 1}. ${n}`).join("\n") : "No notes."),
});
await modelContext.registerTool({
  name: "clear_notes",
  description: "Remove every note.",
  inputSchema: { type: "object", properties: {} },
  annotations: { destructiveHint: true },
  execute: () => {
    notes.length = 0;
    render();
    return text("Cleared.");
  },
});

const config = (await (await fetch("/config.json")).json()) as { url: string; model: string };
defineAssistantElement();
const element = document.querySelector("toolmesh-assistant") as ToolmeshAssistantElement;
element.assistant = new Assistant({
  model: { ...config, systemPrompt: "You help the person with the notes on this page, using its tools." },
  tools: webmcp(),
  confirm: element.confirm,
});
