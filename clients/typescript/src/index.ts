/**
 * @toolmesh/host: serve toolmesh tools from a web page.
 *
 * A ToolHost opens a host session with the bridge's port for pages (Connect
 * or gRPC-Web over HTTP/1.1), receives tool requests for its session, runs
 * their handlers and hands the outcomes back. serveWebMCP serves the tools a
 * page registers with WebMCP (document.modelContext) through it.
 */
export {
  ToolHost,
  type ToolAnnotations,
  type ToolArguments,
  type ToolContext,
  type ToolDeclaration,
  type ToolHandler,
  type ToolHostOptions,
} from "./host.js";
export { Codes, errorInfo, type ErrorInfo, type HostError } from "./errors.js";
export { MAX_RESULT_BYTES, NotPlainJson, checkPlain } from "./results.js";
export {
  WEBMCP_TOOL_ERROR,
  serveWebMCP,
  type ModelContextLike,
  type ServeWebMCPOptions,
  type WebMCPClient,
  type WebMCPRegisterOptions,
  type WebMCPTool,
} from "./webmcp.js";
