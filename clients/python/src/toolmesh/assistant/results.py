"""What a tool call gives the model: a ToolResult, never an exception.

Size rule: `text` holds at most TEXT_LIMIT characters (longer text is cut and
says so), and `data` is dropped when its JSON form is longer than TEXT_LIMIT
(the text then stands as the summary). Both hold whoever builds the result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from toolmesh.assistant.errors import TURN_TABLE, TurnCode
from toolmesh.core import jsontext
from toolmesh.core.jsontext import JsonValue

TEXT_LIMIT = 8_192


def cap_text(text: str, limit: int = TEXT_LIMIT) -> str:
    """`text` itself when short enough, else its beginning and a note, `limit` characters in all."""
    if len(text) <= limit:
        return text
    note = f"\n[cut: {len(text)} characters in all]"
    return text[: limit - len(note)] + note


def json_length(value: JsonValue) -> int:
    """The length in characters of `value`'s compact JSON form."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


@dataclass(frozen=True, slots=True)
class ToolResult:
    """`ok` with the result, or a failure with a turn `code`.

    `text` is what the model reads. `data` is the structured result (or a
    failure's details). `cause` names what lies behind a failure: the runtime
    code, the handler's own error code, or the assistant's own check.
    """

    ok: bool
    text: str
    code: TurnCode | None = None
    data: JsonValue = None
    cause: str = ""

    def __post_init__(self) -> None:
        if self.ok != (self.code is None):
            raise ValueError("a result is ok, or it has a code")
        object.__setattr__(self, "text", cap_text(self.text))
        if self.data is not None and json_length(self.data) > TEXT_LIMIT:
            object.__setattr__(self, "data", None)

    @classmethod
    def success(cls, result_json: str) -> ToolResult:
        """The result of a call that succeeded; raises jsontext.NotPlainJson if `result_json` is not JSON."""
        value = jsontext.parse(result_json)
        return cls(True, value if isinstance(value, str) else result_json, data=value)

    @classmethod
    def failure(
        cls, code: TurnCode, detail: str = "", *, cause: str = "", data: JsonValue = None
    ) -> ToolResult:
        """A failed result: the text is `CODE: <table message> <detail>`."""
        text = f"{code.value}: {TURN_TABLE[code].message}"
        return cls(False, f"{text} {detail}" if detail else text, code, data, cause)
