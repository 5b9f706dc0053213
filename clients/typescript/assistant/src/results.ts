// What a tool call gives the model: a ToolResult, never an exception. Size rule, as in the
// Python assistant (toolmesh.assistant.results): `text` holds at most TEXT_LIMIT characters
// (longer text is cut and says so), and `data` is dropped when its JSON is longer than that.
import { TEXT_LIMIT, TURN_TABLE, type TurnCode } from "./gen/turns.js";

export type JsonValue = null | boolean | number | string | JsonValue[] | { [key: string]: JsonValue };

/** `ok` with the result, or a failure with a turn `code`; `text` is what the model reads. */
export interface ToolResult {
  readonly ok: boolean;
  readonly code: TurnCode | null;
  readonly text: string;
  /** The structured result (or a failure's details); null when absent or too large. */
  readonly data: JsonValue;
  /** What lies behind a failure: the runtime code, the handler's own, or the assistant's check. */
  readonly cause: string;
}

/** `text` itself when short enough, else its beginning and a note, `limit` characters in all. */
export function capText(text: string, limit: number = TEXT_LIMIT): string {
  if (text.length <= limit) {
    return text;
  }
  const note = `\n[cut: ${text.length} characters in all]`;
  return text.slice(0, limit - note.length) + note;
}

/** The value as plain JSON, or a TypeError naming what is not (functions, cycles, NaN, Maps, ...). */
export function plainJson(value: unknown, seen: Set<object> = new Set()): JsonValue {
  if (value === null || typeof value === "string" || typeof value === "boolean") {
    return value;
  }
  if (typeof value === "number") {
    if (!Number.isFinite(value)) {
      throw new TypeError(`${value} is not a JSON number`);
    }
    return value;
  }
  if (typeof value !== "object") {
    throw new TypeError(`a ${typeof value} is not JSON`);
  }
  if (seen.has(value)) {
    throw new TypeError("a cycle is not JSON");
  }
  seen.add(value);
  try {
    if (Array.isArray(value)) {
      return value.map((item: unknown) => plainJson(item, seen));
    }
    const proto: unknown = Object.getPrototypeOf(value);
    if (proto !== Object.prototype && proto !== null) {
      throw new TypeError(`a ${(value as object).constructor?.name ?? "object"} is not JSON`);
    }
    const out: { [key: string]: JsonValue } = {};
    for (const [key, item] of Object.entries(value)) {
      out[key] = plainJson(item, seen);
    }
    return out;
  } finally {
    seen.delete(value);
  }
}

function make(ok: boolean, code: TurnCode | null, text: string, data: JsonValue, cause: string): ToolResult {
  const kept = data !== null && JSON.stringify(data).length > TEXT_LIMIT ? null : data;
  return Object.freeze({ ok, code, text: capText(text), data: kept, cause });
}

/** The result of a call that succeeded: its text is the value (a string) or its JSON. */
export function success(value: JsonValue, text?: string): ToolResult {
  return make(true, null, text ?? (typeof value === "string" ? value : JSON.stringify(value)), value, "");
}

/** A failed result: the text is `CODE: <table message> <detail>`. */
export function failure(code: TurnCode, detail = "", cause = "", data: JsonValue = null): ToolResult {
  const text = `${code}: ${TURN_TABLE[code].message}`;
  return make(false, code, detail ? `${text} ${detail}` : text, data, cause);
}
