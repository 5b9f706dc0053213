// The page's own tools through WebMCP (document.modelContext: getTools, executeTool, toolchange).
import type { ChannelTool, InvokeOptions, ToolChannel, ToolList } from "./channel.js";
import { AgentError } from "./errors.js";
import { failure, plainJson, success, type JsonValue, type ToolResult } from "./results.js";
import { endSpan, startToolSpan } from "./tracing.js";

/** `document.modelContext`, as far as the assistant uses it. */
export interface ModelContextTools {
  getTools(): unknown;
  executeTool(tool: unknown, input: { [key: string]: JsonValue }, options?: { signal?: AbortSignal }): unknown;
  addEventListener?(type: "toolchange", listener: () => void): void;
  removeEventListener?(type: "toolchange", listener: () => void): void;
}

export interface WebMCPChannelOptions {
  /** The ModelContext to use; default `document.modelContext` (read at each turn). */
  modelContext?: unknown;
}

interface Listed extends ChannelTool {
  readonly entry: unknown;
}

const isRecord = (value: unknown): value is { readonly [key: string]: unknown } =>
  typeof value === "object" && value !== null;

/**
 * The tools the page registered with WebMCP. A turn fails with UNSUPPORTED_WEBMCP when
 * document.modelContext is absent, lacks getTools or executeTool, or the page is not a secure
 * context; with DISCOVERY_FAILED when getTools() throws or gives something that is not a list.
 * Each `toolchange` event moves the revision (STALE_TOOLS for a call planned before it).
 */
export function webmcp(options: WebMCPChannelOptions = {}): ToolChannel {
  let revision = 0;
  const waiters = new Set<() => void>();
  let listening: ModelContextTools | null = null;
  const changed = (): void => {
    revision += 1;
    for (const wake of [...waiters]) wake();
  };

  const context = (): ModelContextTools => {
    const doc = (globalThis as { document?: { modelContext?: unknown } }).document;
    const found = options.modelContext ?? doc?.modelContext;
    if (!isRecord(found)) {
      throw new AgentError("UNSUPPORTED_WEBMCP", "document.modelContext is absent.");
    }
    if (typeof found["getTools"] !== "function" || typeof found["executeTool"] !== "function") {
      throw new AgentError("UNSUPPORTED_WEBMCP", "document.modelContext has no getTools() or executeTool().");
    }
    if ((globalThis as { isSecureContext?: boolean }).isSecureContext === false) {
      throw new AgentError("UNSUPPORTED_WEBMCP", "The page is not a secure context.");
    }
    const tools = found as unknown as ModelContextTools;
    if (listening !== tools) {
      listening?.removeEventListener?.("toolchange", changed);
      tools.addEventListener?.("toolchange", changed);
      listening = tools;
    }
    return tools;
  };

  const execute = async (tool: ChannelTool, args: { [key: string]: JsonValue }, signal: AbortSignal): Promise<ToolResult> => {
    let raw: unknown;
    try {
      raw = await context().executeTool((tool as Listed).entry ?? tool, args, { signal });
    } catch (error) {
      const name = (error as Error)?.name ?? "an error";
      return failure("EXECUTION_FAILED", `${tool.name} threw (${name}).`, "threw");
    }
    return webmcpResult(raw);
  };
  const toTool = (entry: unknown): Listed => {
    if (!isRecord(entry) || typeof entry["name"] !== "string") {
      throw new AgentError("DISCOVERY_FAILED", "getTools() gave an entry that is not a tool.");
    }
    let schema: unknown = entry["inputSchema"] ?? { type: "object", properties: {} };
    if (typeof schema === "string") {
      try {
        schema = JSON.parse(schema) as unknown;
      } catch {
        // Left as text: offering it fails with INVALID_SCHEMA.
      }
    }
    const annotations = isRecord(entry["annotations"]) ? entry["annotations"] : {};
    return {
      name: entry["name"],
      description: typeof entry["description"] === "string" ? entry["description"] : "",
      inputSchema: schema,
      requiresConfirmation: annotations["destructiveHint"] === true || annotations["requiresConfirmation"] === true,
      entry,
    };
  };

  return {
    async check() {
      context();
    },
    async listTools(): Promise<ToolList> {
      const tools = context();
      const at = revision;
      let listed: unknown;
      try {
        listed = await tools.getTools();
      } catch (error) {
        throw new AgentError("DISCOVERY_FAILED", `getTools() threw ${(error as Error)?.name ?? "an error"}.`);
      }
      if (!Array.isArray(listed)) {
        throw new AgentError("DISCOVERY_FAILED", "getTools() did not give a list.");
      }
      return { revision: at, tools: listed.map(toTool) };
    },
    async currentRevision() {
      return revision;
    },
    waitForChange(at: number, signal: AbortSignal): Promise<void> {
      return new Promise((resolve) => {
        if (revision !== at) {
          resolve();
          return;
        }
        const wake = (): void => {
          waiters.delete(wake);
          resolve();
        };
        waiters.add(wake);
        signal.addEventListener("abort", () => waiters.delete(wake), { once: true });
      });
    },
    async invoke(tool: ChannelTool, args, { signal, turnId, callId }: InvokeOptions): Promise<ToolResult> {
      const traced = startToolSpan(tool.name, turnId, callId, signal);
      if (traced === undefined) return await execute(tool, args, signal);
      // A handler may ignore the signal: the span ends when the call is given up on.
      let open = true;
      const finish = (failed?: unknown): void => {
        if (open) endSpan(traced, failed);
        open = false;
      };
      signal.addEventListener("abort", () => finish(signal.reason), { once: true });
      const result = await execute(tool, args, signal);
      finish(result.code === null ? undefined : new AgentError(result.code));
      return result;
    },
    dispose() {
      listening?.removeEventListener?.("toolchange", changed);
      listening = null;
      waiters.clear();
    },
  };
}

/**
 * A WebMCP result as a ToolResult. Chromium's executeTool gives the result's JSON text; a
 * stand-in may give the value itself. `{ content: [{type: "text", text}], isError }` reads as
 * its texts (isError: EXECUTION_FAILED); any other JSON value is the result; the rest fails.
 */
export function webmcpResult(raw: unknown): ToolResult {
  let value: JsonValue;
  try {
    value = plainJson(typeof raw === "string" ? parseOr(raw) : raw === undefined ? null : raw);
  } catch (error) {
    return failure("EXECUTION_FAILED", `The result is not JSON: ${(error as Error).message}.`, "not_json");
  }
  if (isRecord(value) && !Array.isArray(value) && Array.isArray(value["content"])) {
    const texts = (value["content"] as JsonValue[])
      .map((part) => (isRecord(part) && !Array.isArray(part) && typeof part["text"] === "string" ? part["text"] : ""))
      .filter((text) => text !== "");
    if (value["isError"] === true) {
      return failure("EXECUTION_FAILED", texts.join("\n"), "tool_error", value);
    }
    return success(value, texts.length > 0 ? texts.join("\n") : JSON.stringify(value));
  }
  return success(value);
}

function parseOr(text: string): unknown {
  try {
    return JSON.parse(text) as unknown;
  } catch {
    return text;
  }
}
