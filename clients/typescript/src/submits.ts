import { Code, ConnectError, type Client } from "@connectrpc/connect";
import type { BridgeService, ToolResultRefusal } from "./gen/toolmesh/v1/bridge_pb.js";
import type { ToolOutcome } from "./gen/toolmesh/v1/tool_pb.js";
import { MAX_CALLS_PER_MESSAGE, MAX_SUBMIT_RESULTS_BYTES } from "./gen/tables.js";

/** What became of one result: undefined, the bridge took it; else its refusal of this result alone. */
export type Submitted = ToolResultRefusal | undefined;

/**
 * A submit whose host stream was given up before the bridge answered (the bridge stopped talking:
 * frozen, cut off): queued or in flight, it is not waited for; the result goes to the next
 * connection. The bridge may have taken it all the same (an answer lost on the way back).
 */
export class SubmitCut extends Error {
  constructor() {
    super("The result's host stream was given up before the bridge answered.");
    this.name = "SubmitCut";
  }
}

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
  /** Its stream's: aborted when the stream was given up. */
  readonly cut: AbortSignal;
  readonly resolve: (submitted: Submitted) => void;
  readonly reject: (error: unknown) => void;
}

/**
 * The host's result submissions, batched per host session: the results handed in during one task
 * go in one call in the next task (a lone one alone, with SubmitToolResult), and those handed in
 * while SUBMITS_IN_FLIGHT calls are under way go in the next call once one returns
 * (SubmitToolResults, within its limits). Each result is answered on its own; a call that fails
 * as a whole (transport, token) rejects every result in it, for each one's own retry. When the
 * host session's stream is given up, its results queued and in flight are rejected at once with
 * SubmitCut (a frozen bridge would leave them unanswered until their timeout). A stream that ends
 * otherwise leaves them be: the bridge may answer them still, and a broken connection fails them.
 */
export class ResultSubmissions {
  private readonly queues = new Map<string, Queued[]>();
  private readonly inFlight = new Map<string, number>();
  private readonly scheduled = new Set<string>();
  /** The bridge answered SubmitToolResults with UNIMPLEMENTED (an older one): one result a call. */
  private batchesRefused = false;

  constructor(private readonly headers: () => Promise<Record<string, string>>) {}

  /**
   * Hand in `outcome`; the call it goes in waits at most `timeoutMs` (its batch's longest). `cut`:
   * the host session's stream's, aborted when it is given up; the submit then rejects with
   * SubmitCut, queued or in flight.
   */
  submit(
    client: Client<typeof BridgeService>,
    hostSessionId: string,
    toolRequestId: string,
    outcome: ToolOutcome,
    timeoutMs: number,
    cut: AbortSignal,
  ): Promise<Submitted> {
    return new Promise<Submitted>((resolve, reject) => {
      if (cut.aborted) {
        reject(new SubmitCut());
        return;
      }
      const queue = this.queues.get(hostSessionId) ?? [];
      this.queues.set(hostSessionId, queue);
      const onCut = (): void => {
        // Still queued: out of the queue. In flight: its call is aborted with the same signal.
        const at = queue.indexOf(queued);
        if (at >= 0) {
          queue.splice(at, 1);
        }
        if (queue.length === 0 && this.queues.get(hostSessionId) === queue) {
          this.queues.delete(hostSessionId);
        }
        reject(new SubmitCut());
      };
      const settled = <T>(settle: (value: T) => void) => (value: T) => {
        cut.removeEventListener("abort", onCut);
        settle(value);
      };
      const queued: Queued = {
        client,
        toolRequestId,
        outcome,
        bytes: estimatedBytes(outcome),
        timeoutMs,
        cut,
        resolve: settled(resolve),
        reject: settled(reject),
      };
      cut.addEventListener("abort", onCut, { once: true });
      queue.push(queued);
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
        {
          timeoutMs: Math.max(...batch.map((queued) => queued.timeoutMs)),
          headers: await this.headers(),
          // One host session's results, so one stream's signal.
          signal: batch[0]!.cut,
        },
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
        { timeoutMs: queued.timeoutMs, headers: await this.headers(), signal: queued.cut },
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
