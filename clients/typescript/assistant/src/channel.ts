import type { JsonValue, ToolResult } from "./results.js";

/** One tool as a channel lists it. */
export interface ChannelTool {
  readonly name: string;
  readonly description: string;
  /** The input schema as the tool gave it (checked when it is offered to the model). */
  readonly inputSchema: unknown;
  /** A person is asked before the tool runs (WebMCP's destructiveHint, toolmesh's requiresConfirmation). */
  readonly requiresConfirmation: boolean;
  /** The tool's own deadline, when it has one. */
  readonly timeoutMs?: number;
}

/** The tools at one revision; the revision moves whenever the list changes. */
export interface ToolList {
  readonly revision: number;
  readonly tools: readonly ChannelTool[];
}

export interface InvokeOptions {
  /** Aborted when the turn is cancelled or the call passes its deadline; the handler's signal. */
  readonly signal: AbortSignal;
  readonly turnId: string;
  readonly timeoutMs: number;
  /** The model's id of the tool call, when a model asked for it. */
  readonly callId?: string;
  /** Told each progress report of the handler, as the call runs (best effort; toolmesh() only). */
  readonly onProgress?: (progress: ToolProgressReport) => void;
}

/** A handler's report of how far it has got (toolmesh's ToolProgress). */
export interface ToolProgressReport {
  /** On the handler's own scale, growing from one report to the next. */
  readonly progress: number;
  /** What `progress` reaches when done, when the handler knows. */
  readonly total?: number;
  /** The handler's words for people; empty when it gave none. */
  readonly message: string;
}

/**
 * Where an assistant's tools come from and how they are called: `webmcp()` (the page's own,
 * through document.modelContext) or `toolmesh()` (a session's, through the registry and the
 * invocation service over Connect). A channel raises AgentError only from `check` and
 * `listTools`; `invoke` never throws, every failure is a ToolResult.
 */
export interface ToolChannel {
  /** Raise AgentError(UNSUPPORTED_WEBMCP) when the channel cannot serve an assistant here. */
  check(signal: AbortSignal): Promise<void>;
  /** The current tools; raise AgentError(DISCOVERY_FAILED) when they cannot be read. */
  listTools(signal: AbortSignal): Promise<ToolList>;
  /** The current revision, without reading the list again where the channel can. */
  currentRevision(signal: AbortSignal): Promise<number>;
  /** Resolve once the revision differs from `revision`; never rejects (stays pending when aborted). */
  waitForChange(revision: number, signal: AbortSignal): Promise<void>;
  /** One call of `tool`; never throws. */
  invoke(tool: ChannelTool, args: { [key: string]: JsonValue }, options: InvokeOptions): Promise<ToolResult>;
  /** Stop listening; later calls may fail. */
  dispose(): void;
}
