import { Code, ConnectError, type Client } from "@connectrpc/connect";
import type { BridgeService, ToolResultRefusal } from "./gen/toolmesh/v1/bridge_pb.js";
import type { ToolOutcome } from "./gen/toolmesh/v1/tool_pb.js";
import { MAX_CALLS_PER_MESSAGE, MAX_SUBMIT_RESULTS_BYTES } from "./gen/tables.js";

/** What became of one result: undefined, the bridge took it; else its refusal of this result alone. */
export type Submitted = ToolResultRefusal | undefined;

/**
 * Submit calls in flight per host session at most. A page has six connections to the bridge's
 * origin over HTTP/1.1, one held by the host stream and one by StartToolRequests; the results that
 * end while these calls are under way go together in the next one.
 */
const SUBMITS_IN_FLIGHT = 2;

interface Queued {
  readonly client: Client<typeof BridgeService>;
  readonly toolRequestId: string;
  readonly outcome: ToolOutcome;
  readonly bytes: number;
  readonly timeoutMs: number;
  readonly resolve: (submitted: Submitted) => void;
  readonly reject: (error: unknown) => void;
}

/**
 * The host's result submissions, batched per host session: the results handed in during one task
 * go in one call in the next task (a lone one alone, with SubmitToolResult), and those handed in
 * while SUBMITS_IN_FLIGHT calls are under way go in the next call once one returns
 * (SubmitToolResults, within its limits). Each result is answered on its own; a call that fails
 * as a whole (transport, token) rejects every result in it, for each one's own retry.
 */
export class ResultSubmissions {
  private readonly queues = new Map<string, Queued[]>();
  private readonly inFlight = new Map<string, number>();
  private readonly scheduled = new Set<string>();
  /** The bridge answered SubmitToolResults with UNIMPLEMENTED (an older one): one result a call. */
  private batchesRefused = false;

  constructor(private readonly headers: () => Promise<Record<string, string>>) {}

  /** Hand in `outcome`; the call it goes in waits at most `timeoutMs` (its batch's longest). */
  submit(
    client: Client<typeof BridgeService>,
    hostSessionId: string,
    toolRequestId: string,
    outcome: ToolOutcome,
    timeoutMs: number,
  ): Promise<Submitted> {
    return new Promise<Submitted>((resolve, reject) => {
      const queue = this.queues.get(hostSessionId) ?? [];
      this.queues.set(hostSessionId, queue);
      queue.push({ client, toolRequestId, outcome, bytes: estimatedBytes(outcome), timeoutMs, resolve, reject });
      this.schedule(hostSessionId);
    });
  }

  private schedule(hostSessionId: string): void {
    if (this.scheduled.has(hostSessionId) || (this.inFlight.get(hostSessionId) ?? 0) >= SUBMITS_IN_FLIGHT) {
      return; // sent with the others of this task, or once a call in flight returns
    }
    this.scheduled.add(hostSessionId);
    // The next task, by a message rather than a timer, which a background tab would throttle.
    const next = new MessageChannel();
    next.port1.onmessage = () => {
      next.port1.close();
      this.scheduled.delete(hostSessionId);
      this.flush(hostSessionId);
    };
    next.port2.postMessage(null);
  }

  private flush(hostSessionId: string): void {
    const queue = this.queues.get(hostSessionId) ?? [];
    while (queue.length > 0 && (this.inFlight.get(hostSessionId) ?? 0) < SUBMITS_IN_FLIGHT) {
      const batch = takeBatch(queue);
      this.inFlight.set(hostSessionId, (this.inFlight.get(hostSessionId) ?? 0) + 1);
      void this.send(hostSessionId, batch).finally(() => {
        const left = (this.inFlight.get(hostSessionId) ?? 1) - 1;
        if (left > 0) {
          this.inFlight.set(hostSessionId, left);
        } else {
          this.inFlight.delete(hostSessionId);
        }
        this.flush(hostSessionId); // those queued meanwhile go now, together
      });
    }
    if (queue.length === 0) {
      this.queues.delete(hostSessionId);
    }
  }

  private async send(hostSessionId: string, batch: Queued[]): Promise<void> {
    if (batch.length === 1 || this.batchesRefused) {
      await Promise.all(batch.map((queued) => this.sendOne(hostSessionId, queued)));
      return;
    }
    try {
      const response = await batch[0]!.client.submitToolResults(
        {
          hostSessionId,
          results: batch.map(({ toolRequestId, outcome }) => ({ toolRequestId, outcome })),
        },
        { timeoutMs: Math.max(...batch.map((queued) => queued.timeoutMs)), headers: await this.headers() },
      );
      batch.forEach((queued, index) => queued.resolve(response.answers[index]?.refusal));
    } catch (error) {
      if (error instanceof ConnectError && error.code === Code.Unimplemented) {
        this.batchesRefused = true;
        await Promise.all(batch.map((queued) => this.sendOne(hostSessionId, queued)));
        return;
      }
      batch.forEach((queued) => queued.reject(error));
    }
  }

  /** SubmitToolResult: its error (typed or not) rejects, as a whole call's does. */
  private async sendOne(hostSessionId: string, queued: Queued): Promise<void> {
    try {
      await queued.client.submitToolResult(
        { hostSessionId, toolRequestId: queued.toolRequestId, outcome: queued.outcome },
        { timeoutMs: queued.timeoutMs, headers: await this.headers() },
      );
      queued.resolve(undefined);
    } catch (error) {
      queued.reject(error);
    }
  }
}

/** The first of `queue`, and those after it that fit the call's limits with it. */
function takeBatch(queue: Queued[]): Queued[] {
  let bytes = queue[0]!.bytes;
  let count = 1;
  while (count < queue.length && count < MAX_CALLS_PER_MESSAGE && bytes + queue[count]!.bytes <= MAX_SUBMIT_RESULTS_BYTES) {
    bytes += queue[count]!.bytes;
    count++;
  }
  return queue.splice(0, count);
}

/** At least the outcome's encoded size: UTF-8 takes at most 3 bytes per UTF-16 unit, plus framing. */
function estimatedBytes(outcome: ToolOutcome): number {
  const value = outcome.outcome;
  const text =
    value.case === "resultJson"
      ? value.value.length
      : value.case === "error"
        ? value.value.code.length + value.value.message.length + value.value.detailsJson.length
        : 0;
  return 3 * text + 64;
}
