import type { ToolAnnotations, ToolArguments, ToolDeclaration, ToolHost } from "./host.js";

/** The slice of a WebMCP tool (W3C Web Machine Learning CG draft) that toolmesh serves. */
export interface WebMCPTool {
  name: string;
  title?: string;
  description: string;
  inputSchema?: Record<string, unknown>;
  execute: (input: ToolArguments, client: WebMCPClient) => unknown;
  annotations?: {
    readOnlyHint?: boolean;
    untrustedContentHint?: boolean;
    /** Not in the WebMCP draft; MCP's hints, which some pages pass too. */
    idempotentHint?: boolean;
    destructiveHint?: boolean;
  };
}

/** What `execute` receives as its second argument (earlier drafts): the page asks its own user. */
export interface WebMCPClient {
  requestUserInteraction<T>(callback: () => Promise<T> | T): Promise<T>;
}

export interface WebMCPRegisterOptions {
  signal?: AbortSignal;
  exposedTo?: string[];
}

/** `document.modelContext`, as far as toolmesh uses it. */
export interface ModelContextLike {
  registerTool(tool: WebMCPTool, options?: WebMCPRegisterOptions): Promise<void> | void;
  unregisterTool?(name: string): unknown;
}

export interface ServeWebMCPOptions {
  /** The ModelContext to serve; default `document.modelContext`. */
  modelContext?: ModelContextLike;
  /** The deadline toolmesh gives these tools, in ms; default the runtime's (60 s). */
  timeoutMs?: number;
}

/** The domain error code of a WebMCP result with `isError: true`. */
export const WEBMCP_TOOL_ERROR = "WEBMCP_TOOL_ERROR";
const NAME = /^[A-Za-z0-9_.-]{1,128}$/;

/**
 * Serve through toolmesh the tools the page registers with WebMCP
 * (`document.modelContext.registerTool`), from now on: each registration is
 * also declared to the session with its description, input schema and
 * annotations, and served by its `execute`; aborting its `signal` (or
 * `unregisterTool`) withdraws it. Where the browser has no WebMCP, a minimal
 * `document.modelContext` is put in place so the same page code works, served
 * through toolmesh alone.
 *
 * Annotations: readOnlyHint → readOnly; idempotentHint → idempotent;
 * destructiveHint → requiresConfirmation; untrustedContentHint has no toolmesh
 * counterpart. A result `{ isError: true, content }` becomes the domain error
 * WEBMCP_TOOL_ERROR with the content's text as its message.
 *
 * Returns a function that stops: the wrapper is removed and the tools served
 * through toolmesh are withdrawn (the browser keeps its own registrations).
 */
export function serveWebMCP(host: ToolHost, options: ServeWebMCPOptions = {}): () => void {
  const doc = (globalThis as { document?: { modelContext?: ModelContextLike } }).document;
  let context = options.modelContext ?? doc?.modelContext;
  let standIn = false;
  if (context === undefined) {
    if (doc === undefined) {
      throw new TypeError("toolmesh: serveWebMCP needs a document or a modelContext");
    }
    context = standInModelContext();
    Object.defineProperty(doc, "modelContext", { value: context, configurable: true });
    standIn = true;
  }
  const target = context;
  const native = target.registerTool.bind(target);
  const nativeUnregister = target.unregisterTool?.bind(target);
  const served = new Map<string, () => void>();

  const withdraw = (name: string): void => {
    served.get(name)?.();
    served.delete(name);
  };

  target.registerTool = async (tool: WebMCPTool, registerOptions: WebMCPRegisterOptions = {}) => {
    await native(tool, registerOptions);
    const signal = registerOptions.signal;
    if (signal?.aborted) {
      return;
    }
    served.get(tool.name)?.();
    const off = host.onTool(tool.name, (args) => run(tool, args), declarationOf(tool, options));
    served.set(tool.name, off);
    signal?.addEventListener(
      "abort",
      () => {
        if (served.get(tool.name) === off) {
          withdraw(tool.name);
        }
      },
      { once: true },
    );
  };
  if (nativeUnregister !== undefined) {
    target.unregisterTool = (name: string) => {
      withdraw(name);
      return nativeUnregister(name);
    };
  }

  return () => {
    target.registerTool = native;
    if (nativeUnregister !== undefined) {
      target.unregisterTool = nativeUnregister;
    }
    for (const name of [...served.keys()]) {
      withdraw(name);
    }
    if (standIn && doc !== undefined) {
      delete (doc as { modelContext?: unknown }).modelContext;
    }
  };
}

function declarationOf(tool: WebMCPTool, options: ServeWebMCPOptions): ToolDeclaration {
  const hints = tool.annotations ?? {};
  const annotations: ToolAnnotations = {
    readOnly: hints.readOnlyHint === true,
    idempotent: hints.idempotentHint === true,
    requiresConfirmation: hints.destructiveHint === true,
  };
  const declaration: ToolDeclaration = { description: tool.description, annotations };
  if (tool.inputSchema !== undefined) {
    declaration.inputSchema = tool.inputSchema;
  }
  if (options.timeoutMs !== undefined) {
    declaration.timeoutMs = options.timeoutMs;
  }
  return declaration;
}

const client: WebMCPClient = {
  async requestUserInteraction(callback) {
    return await callback();
  },
};

async function run(tool: WebMCPTool, args: ToolArguments): Promise<unknown> {
  const result = await tool.execute(args, client);
  if (isErrorResult(result)) {
    const text = result.content
      .map((part) => (typeof part === "object" && part !== null && "text" in part ? String(part.text) : ""))
      .join(" ")
      .trim()
      .slice(0, 1_000);
    return {
      error: {
        code: WEBMCP_TOOL_ERROR,
        message: text || "The tool reported an error.",
        details: { content: result.content },
      },
    };
  }
  return result;
}

function isErrorResult(value: unknown): value is { isError: true; content: unknown[] } {
  return (
    typeof value === "object" &&
    value !== null &&
    (value as { isError?: unknown }).isError === true &&
    Array.isArray((value as { content?: unknown }).content)
  );
}

/** A ModelContext for browsers without WebMCP: it checks what the draft checks and keeps the names. */
function standInModelContext(): ModelContextLike {
  const names = new Set<string>();
  return {
    async registerTool(tool, options = {}) {
      if (options.signal?.aborted) {
        throw options.signal.reason;
      }
      if (!NAME.test(tool.name) || !tool.description || typeof tool.execute !== "function") {
        throw new DOMException("The tool's name, description or execute is not valid.", "InvalidStateError");
      }
      if (names.has(tool.name)) {
        throw new DOMException(`A tool named ${tool.name} is registered already.`, "InvalidStateError");
      }
      names.add(tool.name);
      options.signal?.addEventListener("abort", () => names.delete(tool.name), { once: true });
    },
    unregisterTool(name) {
      names.delete(name);
    },
  };
}
