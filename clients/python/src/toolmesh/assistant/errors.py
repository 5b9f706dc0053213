"""The error an assistant raises: one code of toolmesh's error table, turn codes mostly."""

from __future__ import annotations

from toolmesh.core.errors import ERROR_TABLE, ToolmeshError


class AssistantError(ToolmeshError):
    """A turn that ended with a turn code, or a send refused with BUSY.

    `message` is the table's message followed by a detail for developers;
    `human_message` is the table's message alone, the one to show people.
    """

    @property
    def human_message(self) -> str:
        """The error table's message for the code: plain words, safe to show people."""
        return ERROR_TABLE[self.code].message

    @property
    def ends_turn(self) -> bool:
        """Whether the code ends a turn (the error table's `ends_turn`)."""
        return ERROR_TABLE[self.code].ends_turn
