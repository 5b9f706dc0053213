/**
 * @toolmesh/assistant: an assistant in the page, over the page's WebMCP tools or a toolmesh
 * session's, with an OpenAI-compatible model behind a same-origin relay. Headless: the
 * widget, <toolmesh-assistant>, is `@toolmesh/assistant/widget`.
 */
export {
  Assistant,
  DEFAULT_MAX_MESSAGES,
  offer,
  type Activity,
  type AssistantOptions,
  type AssistantState,
  type AssistantStatus,
  type Confirm,
  type ConfirmationRequest,
  type Listener,
} from "./assistant.js";
export type { ChannelTool, InvokeOptions, ToolChannel, ToolList, ToolProgressReport } from "./channel.js";
export { AgentError, TEXT_LIMIT, TURN_TABLE, messageOf, type TurnCode, type TurnSpec } from "./errors.js";
export {
  chatCompletions,
  parseReply,
  requestBody,
  type ChatModel,
  type FunctionTool,
  type Message,
  type ModelEndpoint,
  type ModelReply,
  type ToolCallRequest,
} from "./model.js";
export { capText, failure, plainJson, success, type JsonValue, type ToolResult } from "./results.js";
export { webmcp, webmcpResult, type ModelContextTools, type WebMCPChannelOptions } from "./webmcp.js";
