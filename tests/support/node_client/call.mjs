// A tool call from Node, as a client author in another language makes one: the services'
// contract read from protos/ as it is (no generated code), @grpc/grpc-js for the calls.
//
// node call.mjs REGISTRY INVOCATION SESSION prints one JSON line per step.
import path from "node:path";
import { fileURLToPath } from "node:url";
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const [registryTarget, invocationTarget, session] = process.argv.slice(2);
const protos = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../../../protos");
const definition = protoLoader.loadSync(
  ["toolmesh/v1/registry.proto", "toolmesh/v1/invocation.proto"],
  { includeDirs: [protos], keepCase: true, longs: String, enums: String, defaults: true, oneofs: true },
);
const v1 = grpc.loadPackageDefinition(definition).toolmesh.v1;
const credentials = grpc.credentials.createInsecure();
const registry = new v1.RegistryService(registryTarget, credentials);
const invocation = new v1.InvocationService(invocationTarget, credentials);

function unary(client, method, request) {
  return new Promise((resolve) => {
    client[method](request, { deadline: Date.now() + 10_000 }, (error, response) =>
      resolve(error ? { error: { code: error.code, details: error.details } } : { response }),
    );
  });
}

const echo = {
  name: "echo",
  description: "Echo the arguments",
  input_schema_json: JSON.stringify({ type: "object", properties: { n: { type: "integer" } } }),
  timeout_ms: 5000,
  annotations: { read_only: true },
};
const put = await unary(registry, "PutTools", { session_id: session, tools: [echo] });
console.log(JSON.stringify({ step: "put", ...put }));
for (const [step, args] of [["ok", { n: 5 }], ["invalid", { n: "x" }]]) {
  const called = await unary(invocation, "InvokeTool", {
    session_id: session,
    turn_id: "turn-node",
    tool_name: "echo",
    arguments_json: JSON.stringify(args),
  });
  console.log(JSON.stringify({ step, ...called }));
}
const refused = await unary(invocation, "InvokeTool", { session_id: "has space", turn_id: "t", tool_name: "echo" });
console.log(JSON.stringify({ step: "refused", ...refused }));
registry.close();
invocation.close();
