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
        return ERROR_TABLE[self.code].message

    @property
    def ends_turn(self) -> bool:
        return ERROR_TABLE[self.code].ends_turn
