import { create } from "@bufbuild/protobuf";
import { ErrorKind, type ToolOutcome, ToolOutcomeSchema } from "./gen/toolmesh/v1/tool_pb.js";
import { Codes, type RuntimeErrorCode } from "./errors.js";
import { ERROR_TABLE, MAX_RESULT_BYTES } from "./gen/tables.js";

/** Results and arguments larger than this travel as an application-owned id (toolmesh.core.limits). */
export { MAX_RESULT_BYTES };

/** A value JSON cannot carry as it is. `path` points at the first offending part. */
export class NotPlainJson extends Error {
  constructor(
    readonly path: string,
    readonly problem: string,
  ) {
    super(`${problem} at ${path}`);
    this.name = "NotPlainJson";
  }
}

/**
 * Throw NotPlainJson for the first part of `value` that is not plain JSON:
 * objects with string keys (plain objects only), arrays, strings, finite
 * numbers, booleans and null. An object property whose value is `undefined` is
 * left out, as JSON.stringify does; `undefined` anywhere else is refused.
 */
export function checkPlain(value: unknown, path = "$", open: Set<object> = new Set()): void {
  if (value === null || typeof value === "string" || typeof value === "boolean") {
    return;
  }
  if (typeof value === "number") {
    if (!Number.isFinite(value)) {
      throw new NotPlainJson(path, `${String(value)} is not a finite number`);
    }
    return;
  }
  if (typeof value !== "object") {
    throw new NotPlainJson(path, `a value of type ${typeof value} is not JSON`);
  }
  if (open.has(value)) {
    throw new NotPlainJson(path, "the value contains itself (a cycle)");
  }
  open.add(value);
  if (Array.isArray(value)) {
    value.forEach((child, index) => checkPlain(child, `${path}[${index}]`, open));
  } else {
    const prototype: unknown = Object.getPrototypeOf(value);
    if (prototype !== Object.prototype && prototype !== null) {
      const kind = (value as { constructor?: { name?: string } }).constructor?.name ?? "object";
      throw new NotPlainJson(path, `a value of type ${kind} is not JSON`);
    }
    for (const [key, child] of Object.entries(value)) {
      if (child !== undefined) {
        checkPlain(child, `${path}.${key}`, open);
      }
    }
  }
  open.delete(value);
}

/** What a handler returned, as the outcome to hand back. */
export interface Converted {
  readonly outcome: ToolOutcome;
  /** Set when the handler's own value could not be handed back: RESULT_NOT_JSON or RESULT_TOO_LARGE. */
  readonly refusedBecause?: string;
}

/** An outcome of a runtime error written by the SDK (TOOL_HANDLER_ERROR, ...). */
export function runtimeError(code: RuntimeErrorCode, detail: string, details: Record<string, unknown>): ToolOutcome {
  return create(ToolOutcomeSchema, {
    outcome: {
      case: "error",
      value: {
        kind: ErrorKind.RUNTIME,
        code,
        message: `${ERROR_TABLE[code].message} ${detail}`.trim(),
        detailsJson: JSON.stringify(details),
        retryable: ERROR_TABLE[code].retryable,
      },
    },
  });
}

/**
 * A returned `{ error: { code, message, details?, retryable? } }` is a domain
 * error passed through; anything else is the result, which must be plain JSON
 * of at most MAX_RESULT_BYTES (`undefined` is null).
 */
export function convertReturn(value: unknown): Converted {
  if (isPlainObject(value) && Object.keys(value).length === 1 && isPlainObject(value["error"])) {
    return domainError(value["error"]);
  }
  let text: string;
  try {
    checkPlain(value === undefined ? null : value);
    text = JSON.stringify(value ?? null);
  } catch (problem) {
    const path = problem instanceof NotPlainJson ? problem.path : "$";
    const what = problem instanceof NotPlainJson ? problem.message : "it cannot be encoded";
    return {
      outcome: runtimeError("TOOL_RESULT_INVALID", `The result is not plain JSON: ${what}.`, {
        reason: "not_json",
        path,
      }),
      refusedBecause: Codes.RESULT_NOT_JSON,
    };
  }
  const size = new TextEncoder().encode(text).length;
  if (size > MAX_RESULT_BYTES) {
    return {
      outcome: runtimeError(
        "TOOL_RESULT_INVALID",
        `The result is ${size} bytes; the limit is ${MAX_RESULT_BYTES}. Return an id for large data.`,
        { reason: "too_large", size, limit: MAX_RESULT_BYTES },
      ),
      refusedBecause: Codes.RESULT_TOO_LARGE,
    };
  }
  return { outcome: create(ToolOutcomeSchema, { outcome: { case: "resultJson", value: text } }) };
}

function domainError(error: Record<string, unknown>): Converted {
  const { code, message, details, retryable = false } = error;
  const wellFormed =
    typeof code === "string" &&
    code !== "" &&
    typeof message === "string" &&
    (details === undefined || details === null || isPlainObject(details)) &&
    typeof retryable === "boolean" &&
    Object.keys(error).every((key) => ["code", "message", "details", "retryable"].includes(key));
  if (!wellFormed) {
    return {
      outcome: runtimeError(
        "TOOL_RESULT_INVALID",
        "A returned error needs a string code and message, and optional object details and boolean retryable.",
        { reason: "malformed_error" },
      ),
    };
  }
  try {
    checkPlain(details ?? null);
  } catch (problem) {
    const path = problem instanceof NotPlainJson ? problem.path : "$";
    return {
      outcome: runtimeError(
        "TOOL_RESULT_INVALID",
        `The error's details are not plain JSON: ${String((problem as Error).message)}.`,
        { reason: "not_json", path },
      ),
      refusedBecause: Codes.RESULT_NOT_JSON,
    };
  }
  return {
    outcome: create(ToolOutcomeSchema, {
      outcome: {
        case: "error",
        value: {
          kind: ErrorKind.DOMAIN,
          code,
          message,
          detailsJson: details ? JSON.stringify(details) : "",
          retryable,
        },
      },
    }),
  };
}

function isPlainObject(value: unknown): value is Record<string, unknown> {
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    return false;
  }
  const prototype: unknown = Object.getPrototypeOf(value);
  return prototype === Object.prototype || prototype === null;
}
