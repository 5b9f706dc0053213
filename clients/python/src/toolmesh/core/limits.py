"""Limits shared by every part of toolmesh."""

DEFAULT_TOOL_TIMEOUT_MS = 60_000
MAX_TOOL_TIMEOUT_MS = 15 * 60_000
# Results and arguments larger than this travel as an application-owned id.
MAX_RESULT_BYTES = 1024 * 1024
MAX_ARGUMENTS_BYTES = 1024 * 1024
MAX_TOOLS_PER_SESSION = 512
MAX_SCHEMA_BYTES = 256 * 1024
# gRPC messages must carry the largest result plus its envelope.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# A TOOL_ARGS_INVALID outcome lists at most this many schema violations, each
# path and message cut to MAX_VIOLATION_TEXT characters (a message may quote the
# value, as large as the arguments). Arguments longer than
# FULL_VIOLATION_REPORT_CHARS get their first violation only: finding them all
# costs time in proportion to their number.
MAX_REPORTED_VIOLATIONS = 20
MAX_VIOLATION_TEXT = 200
FULL_VIOLATION_REPORT_CHARS = 8 * 1024
# Calls in one InvokeToolsRequest; requests and cancellations together in one
# DispatchToolRequestsRequest. A message with more ends its stream with
# INVALID_REQUEST (after the calls already taken are answered). Senders batch
# at most this many, and so do the services in their responses.
MAX_CALLS_PER_MESSAGE = 1_000
# BridgeService.SubmitToolResults: at most MAX_CALLS_PER_MESSAGE results, their encoded outcomes
# at most this many bytes together (a result alone, up to MAX_RESULT_BYTES, always fits), well
# under the transport's MAX_MESSAGE_BYTES so that the refusal is a typed LIMIT_EXCEEDED.
MAX_SUBMIT_RESULTS_BYTES = 2 * 1024 * 1024
# An InvokeTools stream whose caller reads its results slower than its calls
# end: while more than UNREAD_RESULTS_PAUSE_BYTES of results wait to be sent,
# the service takes no more calls from it (the caller's sends then wait, as
# HTTP/2 flow control says); beyond UNREAD_RESULTS_MAX_BYTES (calls taken
# earlier kept ending) it drops them and ends the stream with RESULTS_NOT_READ.
# The dropped outcomes stay in the ledger: an exact retry replays them.
UNREAD_RESULTS_PAUSE_BYTES = 1024 * 1024
UNREAD_RESULTS_MAX_BYTES = 16 * 1024 * 1024
# Reconnecting to a service that went away: the first retry after
# RECONNECT_BACKOFF_FIRST_MS, growing to at most RECONNECT_BACKOFF_MAX_MS (with
# jitter), so that a dependency that comes back is reached within about a second
# however long it was gone. Channels (gRPC's own backoff), host sessions and the
# bridge's re-declarations all follow it.
RECONNECT_BACKOFF_FIRST_MS = 100
RECONNECT_BACKOFF_MAX_MS = 1_000
# Read checks (BridgeService.AnswerReadCheck): the bridge sends one when a host
# session opens, with heartbeats, and when a request has waited READ_CHECK_AFTER_MS
# on a host without an answer; a host whose check has waited longer than that
# gets requests only when no host that answers serves the session. A host that
# answered before and leaves one unanswered for READ_CHECK_TIMEOUT_MS has
# stopped reading its stream: it is taken for gone. Long enough that a host
# merely busy is not (a result it submits for a request sent after the check
# answers it too).
READ_CHECK_AFTER_MS = 500
READ_CHECK_TIMEOUT_MS = 10_000
# Progress reports (BridgeService.ReportToolProgress): a report's message is cut
# to PROGRESS_MESSAGE_MAX_CHARS characters, and the bridge forwards at most one
# report per tool request every PROGRESS_INTERVAL_MS (the latest of those made
# meanwhile), so a chatty handler costs its callers at most ten reports a second.
PROGRESS_MESSAGE_MAX_CHARS = 512
PROGRESS_INTERVAL_MS = 100
# A call whose caller's own deadline (InvokeToolRequest.deadline_unix_ms) the invocation service
# finds passed by more than this, by its clock, is refused before it becomes an invocation: it was
# held in a paused or overloaded service, and its caller gave up. The slack is for clocks that
# disagree a little.
CALLER_DEADLINE_SLACK_MS = 2_000
