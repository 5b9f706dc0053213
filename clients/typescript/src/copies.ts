import type { Client } from "@connectrpc/connect";
import type { BridgeService } from "./gen/toolmesh/v1/bridge_pb.js";
import type { ToolOutcome } from "./gen/toolmesh/v1/tool_pb.js";
import { Codes, errorInfo } from "./errors.js";

/**
 * A result's copies, handed to the other bridge replicas while its own replica leaves it
 * unanswered. A frozen replica (a stopped process, a stuck event loop) or one cut off answers
 * nothing, and the page waits its attempt's share of the time before it leaves that replica for
 * another (leaving ends the requests the page runs there, so it is not done at the first hiccup). A
 * page closed meanwhile takes its result with it, although another replica was up all along. So
 * once a result's answer is COPY_AFTER_MS late, with nothing heard from the replica since it went
 * out, a copy goes to every other replica as well. A replica that shares the ledger records it while
 * the invocation runs (the first outcome written wins, and a copy is the same outcome, so the two
 * never disagree); the wait for the first answer goes on beside it. As the Python host does
 * (toolmesh.host.copies).
 */
export const COPY_AFTER_MS = 500;

/** What a copy names: the result's own host session (on another replica), its request, its outcome. */
export interface Copy {
  readonly hostSessionId: string;
  readonly toolRequestId: string;
  readonly outcome: ToolOutcome;
}

/**
 * Send `copy` to every replica of `clients` at once: whether one of them has the outcome (took it,
 * or refused it as already answered with it: REQUEST_ENDED, ended "answered"). Any other answer, or
 * none within `timeoutMs`, says nothing: the result's own replica may still take it.
 */
export async function handInCopies(
  clients: readonly Client<typeof BridgeService>[],
  copy: Copy,
  timeoutMs: number,
  headers: Record<string, string>,
): Promise<boolean> {
  const done = new AbortController();
  const sends = clients.map(async (client) => {
    try {
      await client.submitToolResult(copy, { timeoutMs, headers, signal: done.signal });
      return true;
    } catch (error) {
      return answeredBefore(errorInfo(error));
    }
  });
  try {
    return await new Promise<boolean>((resolve) => {
      let left = sends.length;
      if (left === 0) {
        resolve(false);
      }
      for (const send of sends) {
        void send.then((taken) => {
          left -= 1;
          if (taken || left === 0) {
            resolve(taken);
          }
        });
      }
    });
  } finally {
    done.abort();
  }
}

/**
 * Whether a submit's refusal (its ErrorInfo, or a batch's refusal of this result) says the request
 * already ended with this very outcome: a send of it before this one got through.
 */
export function answeredBefore(
  refusal: { readonly reason: string; readonly metadata: Readonly<Record<string, string>> } | undefined,
): boolean {
  return refusal?.reason === Codes.REQUEST_ENDED && refusal.metadata["ended"] === "answered";
}
