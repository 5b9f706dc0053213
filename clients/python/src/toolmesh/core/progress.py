"""Progress of a running tool call: what a handler reports and what its callers are told.

Progress is best effort and informational: it never changes an outcome and
never extends a deadline. The one rule that bounds it (a message cap, finite
numbers) is here, used by the bridge that takes reports and by the SDKs.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from toolmesh.core.limits import PROGRESS_MESSAGE_MAX_CHARS


@dataclass(frozen=True)
class ToolProgress:
    """One progress report of a running invocation, as its callers receive it.

    `progress` is on the handler's own scale; `total`, when known, is the
    value it reaches when the work is done. `message` is the handler's own
    text for people (None when it gave none), at most 512 characters.
    """

    tool_request_id: str
    progress: float
    total: float | None
    message: str | None


class ProgressVerdict(enum.Enum):
    """What became of a progress report (the wire's ProgressReportStatus)."""

    ACCEPTED = "accepted"
    INVALID = "invalid"
    REQUEST_UNKNOWN = "request_unknown"
    REQUEST_ENDED = "request_ended"


def valid_numbers(progress: float, total: float | None) -> bool:
    """Whether `progress` is finite and `total` (when given) is finite and above 0."""
    if not math.isfinite(progress):
        return False
    return total is None or (math.isfinite(total) and total > 0)


def capped_message(message: str | None) -> tuple[str, bool]:
    """The message cut to PROGRESS_MESSAGE_MAX_CHARS ("" for none), and whether it was cut."""
    if not message:
        return "", False
    if len(message) <= PROGRESS_MESSAGE_MAX_CHARS:
        return message, False
    return message[:PROGRESS_MESSAGE_MAX_CHARS], True
