// Assistant: one conversation with a model over one channel's tools, a turn at a time (the
// Python assistant's semantics, toolmesh.assistant). A failed tool call becomes a failed
// ToolResult the model reads in the same turn, unless its code ends turns (the turn table's
// `endsTurn`); BUSY rejects a send while a turn runs and changes nothing.
import type { ChannelTool, ToolChannel, ToolList, ToolProgressReport } from "./channel.js";
import { AgentError, TURN_TABLE, type TurnCode } from "./errors.js";
import { chatCompletions, type ChatModel, type FunctionTool, type Message, type ModelEndpoint, type ToolCallRequest } from "./model.js";
import { failure, type JsonValue, type ToolResult } from "./results.js";
import { FUNCTION_NAME, describeViolations, schemaProblem, violations } from "./schema.js";
import { INTERNAL, PROVIDER, endSpan, parentFor, startSpan, type Traced } from "./tracing.js";

/** What a person is asked to confirm; `signal` aborts when the prompt is withdrawn. */
export interface ConfirmationRequest {
  readonly turnId: string;
  readonly tool: ChannelTool;
  readonly arguments: { readonly [key: string]: JsonValue };
  /** Aborted when the tools change (STALE_TOOLS) or the turn is cancelled: close the prompt. */
  readonly signal: AbortSignal;
}

/** True runs the tool; false, a rejection or a withdrawn prompt refuses it (CONFIRMATION_DENIED). */
export type Confirm = (request: ConfirmationRequest) => Promise<boolean> | boolean;

export interface AssistantOptions {
  /** A ChatModel, or an OpenAI-compatible endpoint (a same-origin relay). */
  readonly model: ChatModel | ModelEndpoint;
  /** Where the tools come from: `webmcp()` or `toolmesh({...})`. */
  readonly tools: ToolChannel;
  /** Asked before a tool that needs confirmation; without it such tools are refused. */
  readonly confirm?: Confirm;
  /** Rounds of tool calls one turn may take (default 8); one more is TURN_LIMIT. */
  readonly maxRounds?: number;
  /** The longest one model call or one tool call may take, in ms (default 60 000): TIMEOUT. */
  readonly timeoutMs?: number;
  /**
   * The conversation kept, in messages (default 200; Infinity keeps all): each send first drops
   * the oldest whole turns until at most this many remain with its own message, so a long-lived
   * page's memory, its widget and the model's input stay bounded. The running turn is never cut
   * (it adds its own messages); a turn is dropped whole, so the conversation stays valid.
   */
  readonly maxMessages?: number;
}

export type AssistantStatus = "idle" | "running" | "disposed";

/** What the turn is doing now, for a widget to show each tool call as it happens. */
export type Activity =
  | { readonly kind: "model" }
  | {
      readonly kind: "confirming" | "calling";
      readonly call: ToolCallRequest;
      readonly tool: ChannelTool;
      /** The handler's latest progress report, while it runs (channels that have them). */
      readonly progress?: ToolProgressReport;
    };

/** One immutable snapshot of an assistant, as subscribers receive it. */
export interface AssistantState {
  readonly status: AssistantStatus;
  readonly messages: readonly Message[];
  /** The error that ended the last turn; null after a turn that answered. */
  readonly error: AgentError | null;
  readonly turnId: string;
  readonly activity: Activity | null;
}

export type Listener = (state: AssistantState) => void;

const INITIAL: AssistantState = Object.freeze({ status: "idle", messages: [], error: null, turnId: "", activity: null });

function newTurnId(): string {
  const bytes = crypto.getRandomValues(new Uint8Array(8));
  return `turn_${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

/** Settle with `work`, or reject with the signal's reason as soon as it aborts. */
function raced<T>(work: Promise<T>, signal: AbortSignal): Promise<T> {
  if (signal.aborted) return Promise.reject(signal.reason);
  return new Promise<T>((resolve, reject) => {
    const stop = (): void => reject(signal.reason);
    signal.addEventListener("abort", stop, { once: true });
    work.then(
      (value) => {
        signal.removeEventListener("abort", stop);
        resolve(value);
      },
      (error: unknown) => {
        signal.removeEventListener("abort", stop);
        reject(error);
      },
    );
  });
}

/** A signal that aborts with the parent's reason, or with TIMEOUT after `ms`; `done` clears the timer. */
function deadline(parent: AbortSignal, ms: number, what: string): { signal: AbortSignal; done: () => void } {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(new AgentError("TIMEOUT", `${what} took longer than ${ms} ms.`)), ms);
  const follow = (): void => controller.abort(parent.reason);
  if (parent.aborted) follow();
  parent.addEventListener("abort", follow, { once: true });
  return {
    signal: controller.signal,
    done: () => {
      clearTimeout(timer);
      parent.removeEventListener("abort", follow);
    },
  };
}

/** The conversation an assistant keeps by default, in messages (AssistantOptions.maxMessages). */
export const DEFAULT_MAX_MESSAGES = 200;

/** The latest whole turns of `messages` (each from a user message on) that fit in `room` messages. */
function kept(messages: readonly Message[], room: number): readonly Message[] {
  if (messages.length <= room) return messages;
  for (let start = messages.length - room; start < messages.length; start += 1) {
    if (messages[start]?.role === "user") return messages.slice(start);
  }
  return [];
}

/** Every tool call of the last assistant message that no tool message answers. */
function unanswered(messages: readonly Message[]): ToolCallRequest[] {
  for (let index = messages.length - 1; index >= 0; index -= 1) {
    const message = messages[index];
    if (message?.role === "assistant") {
      const answered = new Set(messages.slice(index + 1).flatMap((m) => (m.role === "tool" ? [m.call.id] : [])));
      return message.toolCalls.filter((call) => !answered.has(call.id));
    }
  }
  return [];
}

/**
 * `send()` runs one turn and resolves with the model's answer; `cancel()`, `clear()` and
 * `dispose()` end it with ABORTED. A send while a turn runs rejects with AgentError(BUSY)
 * and changes nothing; a turn that ends without an answer rejects with the AgentError that
 * is also `state.error`.
 */
export class Assistant {
  private readonly model: ChatModel;
  /** The endpoint's model, for the turn's span; unknown for a ChatModel object. */
  private readonly endpointModel: string | undefined;
  private readonly channel: ToolChannel;
  private readonly confirmer: Confirm | undefined;
  private readonly maxRounds: number;
  private readonly timeoutMs: number;
  private readonly maxMessages: number;
  private current: AssistantState = INITIAL;
  private readonly listeners = new Set<Listener>();
  private generation = 0;
  private running: AbortController | null = null;

  constructor(options: AssistantOptions) {
    this.model = "complete" in options.model ? options.model : chatCompletions(options.model);
    this.endpointModel = "complete" in options.model ? undefined : options.model.model;
    this.channel = options.tools;
    this.confirmer = options.confirm;
    this.maxRounds = options.maxRounds ?? 8;
    this.timeoutMs = options.timeoutMs ?? 60_000;
    this.maxMessages = options.maxMessages ?? DEFAULT_MAX_MESSAGES;
  }

  /** The state now: status, conversation, the last turn's error. */
  get state(): AssistantState {
    return this.current;
  }

  /** Call `listener` with every new state; returns the function that unsubscribes. */
  subscribe(listener: Listener): () => void {
    this.listeners.add(listener);
    return () => {
      this.listeners.delete(listener);
    };
  }

  /** Run one turn on the person's `text`; resolves with the model's answer. */
  async send(text: string): Promise<string> {
    if (this.current.status === "disposed") {
      throw new AgentError("ABORTED", "The assistant was disposed.");
    }
    if (this.running !== null) {
      throw new AgentError("BUSY");
    }
    const controller = new AbortController();
    this.running = controller;
    const generation = ++this.generation;
    const turnId = newTurnId();
    this.set({
      ...this.current,
      status: "running",
      messages: [...kept(this.current.messages, this.maxMessages - 1), { role: "user", text }],
      error: null,
      turnId,
      activity: null,
    });
    let error: AgentError | null = null;
    const traced = this.turnSpan(turnId);
    try {
      return await this.turn(turnId, generation, controller.signal, traced);
    } catch (thrown) {
      error =
        thrown instanceof AgentError
          ? thrown
          : new AgentError("INTERNAL", (thrown as Error)?.name ?? "error");
      throw error;
    } finally {
      endSpan(traced, error ?? undefined);
      if (generation === this.generation) {
        this.end(error);
      }
      if (this.running === controller) {
        this.running = null;
      }
    }
  }

  /** End the running turn with ABORTED (the state says so at once); false when none runs. */
  cancel(): boolean {
    const controller = this.running;
    if (controller === null) return false;
    this.running = null;
    this.generation += 1;
    const error = new AgentError("ABORTED", "cancel() ran.");
    this.end(error);
    controller.abort(error);
    return true;
  }

  /** End the running turn (ABORTED) and forget the conversation. */
  clear(): void {
    this.cancel();
    this.generation += 1;
    this.set(INITIAL);
  }

  /** End the running turn (ABORTED) and release the channel; every later send is ABORTED. */
  dispose(): void {
    this.cancel();
    this.generation += 1;
    this.set({ ...this.current, status: "disposed", activity: null });
    this.listeners.clear();
    this.channel.dispose();
  }

  private set(state: AssistantState): void {
    this.current = Object.freeze(state);
    for (const listener of [...this.listeners]) {
      try {
        listener(this.current);
      } catch (error) {
        console.error("toolmesh assistant: a state listener failed", error);
      }
    }
  }

  private end(error: AgentError | null): void {
    let messages = this.current.messages;
    if (error !== null) {
      // Every call the model asked for gets an answer, so the conversation stays valid.
      const notRun = unanswered(messages).map(
        (call): Message => {
          const result = failure(error.code, "The call was not run.", "not_run");
          return { role: "tool", text: result.text, call, result };
        },
      );
      messages = [...messages, ...notRun];
    }
    this.set({ ...this.current, status: "idle", messages, error, activity: null });
  }

  private record(generation: number, message: Message): void {
    if (generation === this.generation) {
      this.set({ ...this.current, messages: [...this.current.messages, message] });
    }
  }

  private activity(generation: number, activity: Activity | null): void {
    if (generation === this.generation) {
      this.set({ ...this.current, activity });
    }
  }

  /** The turn's `invoke_agent` span (the conventions' in-process agent), when the page traces. */
  private turnSpan(turnId: string): Traced | undefined {
    return startSpan("invoke_agent", INTERNAL, {
      "gen_ai.operation.name": "invoke_agent",
      ...(this.endpointModel === undefined
        ? {}
        : { "gen_ai.provider.name": PROVIDER, "gen_ai.request.model": this.endpointModel }),
      "toolmesh.turn_id": turnId,
    });
  }

  private async turn(turnId: string, generation: number, signal: AbortSignal, traced: Traced | undefined): Promise<string> {
    await raced(this.channel.check(signal), signal);
    for (let round = 1; ; round += 1) {
      const planned = await raced(this.channel.listTools(signal), signal);
      const functions = offer(planned);
      this.activity(generation, { kind: "model" });
      const call = deadline(signal, this.timeoutMs, "The model call");
      parentFor(call.signal, traced);
      let reply;
      try {
        reply = await raced(this.model.complete(this.current.messages, functions, call.signal), call.signal);
      } finally {
        call.done();
      }
      if (generation !== this.generation) throw signal.reason;
      this.record(generation, { role: "assistant", text: reply.text, toolCalls: reply.toolCalls });
      if (reply.toolCalls.length === 0) {
        return reply.text;
      }
      if (round > this.maxRounds) {
        throw new AgentError("TURN_LIMIT", `The model asked for tools in more than ${this.maxRounds} rounds.`);
      }
      for (const request of reply.toolCalls) {
        const result = await this.callTool(turnId, generation, request, planned, signal, traced);
        this.record(generation, { role: "tool", text: result.text, call: request, result });
        if (result.code !== null && TURN_TABLE[result.code].endsTurn) {
          throw new AgentError(result.code, `${request.name}: ${result.cause}.`);
        }
      }
    }
  }

  private async callTool(
    turnId: string,
    generation: number,
    request: ToolCallRequest,
    planned: ToolList,
    signal: AbortSignal,
    traced: Traced | undefined,
  ): Promise<ToolResult> {
    const tool = planned.tools.find((t) => t.name === request.name);
    if (tool === undefined) {
      return failure("TOOL_UNAVAILABLE", `No tool is named ${JSON.stringify(request.name)} here.`, "not_listed");
    }
    let args: unknown;
    try {
      args = JSON.parse(request.argumentsJson);
    } catch {
      return failure("INVALID_ARGUMENTS", "The arguments are not JSON.", "not_json");
    }
    if (typeof args !== "object" || args === null || Array.isArray(args)) {
      return failure("INVALID_ARGUMENTS", "The arguments must be a JSON object.", "not_object");
    }
    const input = args as { [key: string]: JsonValue };
    const found = violations(tool.inputSchema, input);
    if (found.length > 0) {
      return failure("INVALID_ARGUMENTS", describeViolations(found), "schema");
    }
    if (tool.requiresConfirmation) {
      this.activity(generation, { kind: "confirming", call: request, tool });
      const refused = await this.confirm(turnId, tool, input, planned.revision, signal);
      if (refused === "STALE_TOOLS") return stale(planned.revision);
      if (refused !== null) {
        return failure(refused, "The person did not confirm the call.", "not_confirmed");
      }
    }
    const now = await raced(this.channel.currentRevision(signal), signal);
    if (now !== planned.revision) {
      return stale(planned.revision, now);
    }
    this.activity(generation, { kind: "calling", call: request, tool });
    const ms = Math.min(this.timeoutMs, tool.timeoutMs ?? Infinity);
    const call = deadline(signal, ms, `The tool ${tool.name}`);
    parentFor(call.signal, traced);
    const onProgress = (progress: ToolProgressReport): void => {
      if (!call.signal.aborted) this.activity(generation, { kind: "calling", call: request, tool, progress });
    };
    try {
      return await raced(
        this.channel.invoke(tool, input, { signal: call.signal, turnId, timeoutMs: ms, onProgress, callId: request.id }),
        call.signal,
      );
    } finally {
      call.done();
    }
  }

  private async confirm(
    turnId: string,
    tool: ChannelTool,
    input: { [key: string]: JsonValue },
    revision: number,
    signal: AbortSignal,
  ): Promise<TurnCode | null> {
    const confirmer = this.confirmer;
    if (confirmer === undefined) return "CONFIRMATION_DENIED";
    const prompt = new AbortController();
    const follow = (): void => prompt.abort(signal.reason);
    signal.addEventListener("abort", follow, { once: true });
    try {
      const moved = this.channel.waitForChange(revision, prompt.signal).then(() => "moved" as const);
      const answer = Promise.resolve()
        .then(() => confirmer({ turnId, tool, arguments: input, signal: prompt.signal }))
        .then(
          (yes) => (yes === true ? ("yes" as const) : ("no" as const)),
          () => "no" as const,
        );
      const outcome = await raced(Promise.race([answer, moved]), signal);
      if (outcome === "moved") return "STALE_TOOLS";
      return outcome === "yes" ? null : "CONFIRMATION_DENIED";
    } finally {
      signal.removeEventListener("abort", follow);
      prompt.abort(new AgentError("ABORTED", "The prompt was withdrawn."));
    }
  }
}

function stale(planned: number, current?: number): ToolResult {
  const now = current === undefined ? "" : ` to ${current}`;
  return failure(
    "STALE_TOOLS",
    `The tool list moved from revision ${planned}${now} after the call was planned; it was not run.`,
    "revision_moved",
  );
}

/** The tools as functions a model can be offered; AgentError(INVALID_SCHEMA) for the first that cannot be. */
export function offer(list: ToolList): FunctionTool[] {
  return list.tools.map((tool) => {
    if (!FUNCTION_NAME.test(tool.name)) {
      throw new AgentError(
        "INVALID_SCHEMA",
        `${tool.name}: a tool offered to a model needs a name matching [A-Za-z0-9_-]{1,64}.`,
      );
    }
    const problem = schemaProblem(tool.inputSchema);
    if (problem !== null) {
      throw new AgentError("INVALID_SCHEMA", `${tool.name}: ${problem}.`);
    }
    return { name: tool.name, description: tool.description, parameters: tool.inputSchema as JsonValue };
  });
}
