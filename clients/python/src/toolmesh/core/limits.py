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
