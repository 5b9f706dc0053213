import { TURN_TABLE, type TurnCode } from "./gen/turns.js";

export { TEXT_LIMIT, TURN_TABLE, type TurnCode, type TurnSpec } from "./gen/turns.js";

/** The fixed, human-facing message of a turn code (the turn table's, shared with the Python assistant). */
export function messageOf(code: TurnCode): string {
  return TURN_TABLE[code].message;
}

/**
 * A turn that ended with a turn code, or a `send()` refused with BUSY.
 *
 * `message` is the table's message followed by a detail for developers;
 * `humanMessage` is the table's message alone, the one to show people.
 */
export class AgentError extends Error {
  override readonly name = "AgentError";
  readonly code: TurnCode;
  readonly detail: string;

  constructor(code: TurnCode, detail = "") {
    super(`${TURN_TABLE[code].message} ${detail}`.trim());
    this.code = code;
    this.detail = detail;
  }

  /** The turn table's message for the code: plain words, safe to show people. */
  get humanMessage(): string {
    return TURN_TABLE[this.code].message;
  }

  /** Whether the code ends a turn (the others reach the model as failed tool results). */
  get endsTurn(): boolean {
    return TURN_TABLE[this.code].endsTurn;
  }

  /** Whether sending the same message again may succeed. */
  get retryable(): boolean {
    return TURN_TABLE[this.code].retryable;
  }
}
