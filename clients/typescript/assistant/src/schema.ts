// Input schemas: which can be offered to a model (INVALID_SCHEMA otherwise), and the check of
// the model's arguments against them (INVALID_ARGUMENTS). The dialects are the registry's:
// JSON Schema 2020-12 (the default) and draft-07. The check covers the keywords tools use
// for their input (type, enum, const, properties, required, additionalProperties, items,
// string and number bounds, pattern, array bounds); a tool behind toolmesh is also checked
// by the invocation service with the full validator.
import type { JsonValue } from "./results.js";

const DIALECTS = new Set(["json-schema.org/draft/2020-12/schema", "json-schema.org/draft-07/schema"]);
export const FUNCTION_NAME = /^[A-Za-z0-9_-]{1,64}$/;

type Schema = { readonly [key: string]: unknown };

const isObject = (value: unknown): value is Schema =>
  typeof value === "object" && value !== null && !Array.isArray(value);

/** Why `schema` cannot be a tool's input schema, or null when it can. */
export function schemaProblem(schema: unknown): string | null {
  if (!isObject(schema)) {
    return "its inputSchema is not a JSON object";
  }
  const dialect = schema["$schema"];
  if (dialect !== undefined) {
    const bare = typeof dialect === "string" ? dialect.replace(/^https?:\/\//, "").replace(/#$/, "") : "";
    if (!DIALECTS.has(bare)) {
      return "its inputSchema uses an unsupported dialect (supported: JSON Schema 2020-12, draft-07)";
    }
  }
  const type = schema["type"];
  if (type !== undefined && type !== "object") {
    return "its inputSchema does not describe an object";
  }
  return null;
}

export interface Violation {
  readonly path: string;
  readonly message: string;
}

function typeOf(value: JsonValue): string {
  if (value === null) return "null";
  if (Array.isArray(value)) return "array";
  if (typeof value === "number") return Number.isInteger(value) ? "integer" : "number";
  return typeof value;
}

function typeMatches(want: unknown, value: JsonValue): boolean {
  const have = typeOf(value);
  const wanted = Array.isArray(want) ? want : [want];
  return wanted.some((one) => one === have || (one === "number" && have === "integer"));
}

/** The violations of `value` against `schema` (the subset above), each with a JSON pointer. */
export function violations(schema: unknown, value: JsonValue, path = ""): Violation[] {
  if (schema === false) return [{ path, message: "no value is allowed here" }];
  if (!isObject(schema)) return [];
  const found: Violation[] = [];
  const add = (message: string): void => {
    found.push({ path, message });
  };
  const s = schema;
  if (s["type"] !== undefined && !typeMatches(s["type"], value)) {
    add(`${JSON.stringify(value)} is not of type ${JSON.stringify(s["type"])}`);
    return found;
  }
  if (Array.isArray(s["enum"]) && !s["enum"].some((one) => JSON.stringify(one) === JSON.stringify(value))) {
    add(`${JSON.stringify(value)} is not one of ${JSON.stringify(s["enum"])}`);
  }
  if ("const" in s && JSON.stringify(s["const"]) !== JSON.stringify(value)) {
    add(`${JSON.stringify(s["const"])} was expected`);
  }
  if (typeof value === "string") {
    const length = [...value].length;
    if (typeof s["minLength"] === "number" && length < s["minLength"]) add(`is shorter than ${s["minLength"]}`);
    if (typeof s["maxLength"] === "number" && length > s["maxLength"]) add(`is longer than ${s["maxLength"]}`);
    if (typeof s["pattern"] === "string" && !new RegExp(s["pattern"], "u").test(value)) {
      add(`does not match ${JSON.stringify(s["pattern"])}`);
    }
  }
  if (typeof value === "number") {
    if (typeof s["minimum"] === "number" && value < s["minimum"]) add(`is less than ${s["minimum"]}`);
    if (typeof s["maximum"] === "number" && value > s["maximum"]) add(`is greater than ${s["maximum"]}`);
    if (typeof s["exclusiveMinimum"] === "number" && value <= s["exclusiveMinimum"]) {
      add(`is not greater than ${s["exclusiveMinimum"]}`);
    }
    if (typeof s["exclusiveMaximum"] === "number" && value >= s["exclusiveMaximum"]) {
      add(`is not less than ${s["exclusiveMaximum"]}`);
    }
  }
  if (Array.isArray(value)) {
    if (typeof s["minItems"] === "number" && value.length < s["minItems"]) add(`has fewer than ${s["minItems"]} items`);
    if (typeof s["maxItems"] === "number" && value.length > s["maxItems"]) add(`has more than ${s["maxItems"]} items`);
    if (s["items"] !== undefined) {
      value.forEach((item, index) => found.push(...violations(s["items"], item, `${path}/${index}`)));
    }
  }
  if (isObject(value)) {
    const object = value as { [key: string]: JsonValue };
    const properties = isObject(s["properties"]) ? s["properties"] : {};
    if (Array.isArray(s["required"])) {
      for (const name of s["required"]) {
        if (typeof name === "string" && !(name in object)) add(`${JSON.stringify(name)} is a required property`);
      }
    }
    for (const [name, item] of Object.entries(object)) {
      const where = `${path}/${name.replace(/~/g, "~0").replace(/\//g, "~1")}`;
      if (name in properties) {
        found.push(...violations(properties[name], item, where));
      } else if (s["additionalProperties"] === false) {
        found.push({ path: where, message: "is not an allowed property" });
      } else if (isObject(s["additionalProperties"])) {
        found.push(...violations(s["additionalProperties"], item, where));
      }
    }
  }
  return found;
}

/** Violations as one line the model can act on: `/path: message; ...` (as the Python assistant). */
export function describeViolations(found: readonly Violation[]): string {
  return found.map((v) => `${v.path || "/"}: ${v.message}`).join("; ");
}
