"""What may be said of an exception: its type and frames, never its text.

An exception's text can quote the arguments or results it was raised over.
Standard library only, so that domain modules can use it without the
transport or the telemetry.
"""

from __future__ import annotations

import traceback

__all__ = ["exception_fields", "traceback_without_text"]


def exception_fields(exc: BaseException) -> dict[str, str]:
    """What a log line may say about `exc`: its type and the frame it was raised in, never its text."""
    frames = traceback.extract_tb(exc.__traceback__)
    raised_at = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return {"exception": type(exc).__qualname__, "raised_at": raised_at}


def traceback_without_text(exc: BaseException) -> str:
    """A traceback of `exc` and the exceptions it chains: the frames and each exception's type only."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = "".join(traceback.format_list(traceback.extract_tb(current.__traceback__)))
        parts.append(f"Traceback (most recent call last):\n{frames}{type(current).__qualname__}")
        current = current.__cause__ or current.__context__
    return "\n\nwhile handling the one below:\n".join(parts)
