import { BinaryReader, WireType } from "@bufbuild/protobuf/wire";
import { ConnectError } from "@connectrpc/connect";
import type { ErrorCode } from "./gen/tables.js";

/** An object naming each of `codes` by itself, as the table spells them. */
function named<const C extends ErrorCode>(...codes: C[]): { readonly [K in C]: K } {
  return Object.fromEntries(codes.map((code) => [code, code])) as { readonly [K in C]: K };
}

/**
 * The codes of toolmesh's error table that a host meets. The table itself
 * (status, retryability, message) lives with the runtime; src/gen/tables.ts is
 * generated from it.
 */
export const Codes = named(
  "TOOL_HANDLER_NOT_FOUND",
  "TOOL_HANDLER_ERROR",
  "TOOL_RESULT_INVALID",
  "SUBMIT_TOOL_RESULT_FAILED",
  "TRANSPORT_FAILED",
  "RESULT_NOT_JSON",
  "RESULT_TOO_LARGE",
  "REQUEST_ENDED",
  "SHUTTING_DOWN",
  "INVALID_SCHEMA",
  "INVALID_REQUEST",
  "REGISTRY_UNAVAILABLE",
  "HOST_SESSION_UNKNOWN",
  "UNAUTHENTICATED",
  "PERMISSION_DENIED",
  "WRONG_LISTENER",
);

/** The codes the SDK writes into outcomes itself, with the table's message and retryability. */
export type RuntimeErrorCode = "TOOL_HANDLER_NOT_FOUND" | "TOOL_HANDLER_ERROR" | "TOOL_RESULT_INVALID";

/**
 * What `onError` callbacks receive. Never carries arguments, results or an
 * exception's text: a handler's exception is named by its `name` alone.
 */
export interface HostError {
  /**
   * TOOL_HANDLER_ERROR, SUBMIT_TOOL_RESULT_FAILED, for a declaration the refusal's code, or
   * UNAUTHENTICATED / PERMISSION_DENIED / WRONG_LISTENER when the bridge refuses the host itself
   * (`cause`: the token's fault, e.g. "expired", "missing").
   */
  readonly code: string;
  readonly message: string;
  readonly sessionId: string;
  readonly turnId: string;
  readonly toolRequestId: string;
  readonly toolName: string;
  /**
   * For SUBMIT_TOOL_RESULT_FAILED: the bridge's reason (REQUEST_ENDED, ...), or
   * TRANSPORT_FAILED / RESULT_NOT_JSON / RESULT_TOO_LARGE; REQUEST_ENDED (or
   * SHUTTING_DOWN, when stop() ended it) for a value the handler returned
   * after its call ended.
   */
  readonly cause: string;
}

/** The google.rpc.ErrorInfo a toolmesh service attaches to a failed call. */
export interface ErrorInfo {
  readonly reason: string;
  readonly domain: string;
  readonly metadata: Readonly<Record<string, string>>;
}

const ERROR_INFO = "google.rpc.ErrorInfo";

/** The ErrorInfo of a failed call, when the server attached one. */
export function errorInfo(error: unknown): ErrorInfo | undefined {
  if (!(error instanceof ConnectError)) {
    return undefined;
  }
  for (const detail of error.details) {
    if ("type" in detail && detail.type === ERROR_INFO) {
      return decodeErrorInfo(detail.value);
    }
  }
  return undefined;
}

// ErrorInfo is three fields; reading them here keeps googleapis' protos out of the bundle.
function decodeErrorInfo(bytes: Uint8Array): ErrorInfo | undefined {
  let reason = "";
  let domain = "";
  const metadata: Record<string, string> = {};
  try {
    const reader = new BinaryReader(bytes);
    while (reader.pos < reader.len) {
      const [field, wireType] = reader.tag();
      if (field === 1 && wireType === WireType.LengthDelimited) {
        reason = reader.string();
      } else if (field === 2 && wireType === WireType.LengthDelimited) {
        domain = reader.string();
      } else if (field === 3 && wireType === WireType.LengthDelimited) {
        const entry = new BinaryReader(reader.bytes());
        let key = "";
        let value = "";
        while (entry.pos < entry.len) {
          const [entryField, entryType] = entry.tag();
          if (entryField === 1) {
            key = entry.string();
          } else if (entryField === 2) {
            value = entry.string();
          } else {
            entry.skip(entryType);
          }
        }
        metadata[key] = value;
      } else {
        reader.skip(wireType);
      }
    }
  } catch {
    return undefined;
  }
  return { reason, domain, metadata };
}
