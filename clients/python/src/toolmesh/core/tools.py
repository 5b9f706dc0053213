"""Tool definitions as plain values, and their JSON form (as in tools.json)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolmesh.core import jsontext
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.limits import DEFAULT_TOOL_TIMEOUT_MS, MAX_TOOL_TIMEOUT_MS
from toolmesh.core.names import require_tool_name


@dataclass(frozen=True, slots=True)
class ToolAnnotations:
    read_only: bool = False
    idempotent: bool = False
    requires_confirmation: bool = False


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str = ""
    input_schema_json: str = '{"type":"object"}'
    output_schema_json: str = ""
    # 0 means the default deadline.
    timeout_ms: int = 0
    annotations: ToolAnnotations = field(default_factory=ToolAnnotations)

    @property
    def effective_timeout_ms(self) -> int:
        return self.timeout_ms or DEFAULT_TOOL_TIMEOUT_MS

    def to_json_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "inputSchema": jsontext.parse(self.input_schema_json),
        }
        if self.output_schema_json:
            out["outputSchema"] = jsontext.parse(self.output_schema_json)
        if self.timeout_ms:
            out["timeoutMs"] = self.timeout_ms
        out["annotations"] = {
            "readOnly": self.annotations.read_only,
            "idempotent": self.annotations.idempotent,
            "requiresConfirmation": self.annotations.requires_confirmation,
        }
        return out

    @classmethod
    def from_json_dict(cls, raw: object) -> ToolSpec:
        """Read one tool of a tools.json file; raise ToolmeshError(INVALID_SCHEMA) when malformed.

        A key it does not know is refused by name (a misspelt flag must not pass as unset).
        """
        if not isinstance(raw, dict):
            raise _invalid("", "Each tool must be a JSON object.")
        name = raw.get("name")
        if not isinstance(name, str):
            raise _invalid("", "Each tool needs a string name.")
        require_tool_name(name)
        refuse_unknown_keys(raw, TOOL_KEYS, name, "")
        description = raw.get("description", "")
        if not isinstance(description, str):
            raise _invalid(name, "description must be a string.")
        if "inputSchema" not in raw:
            raise _invalid(name, "inputSchema is required.")
        timeout = raw.get("timeoutMs", 0)
        if isinstance(timeout, bool) or not isinstance(timeout, int):
            raise _invalid(name, "timeoutMs must be an integer.")
        annotations = raw.get("annotations", {})
        if not isinstance(annotations, dict):
            raise _invalid(name, "annotations must be an object.")
        refuse_unknown_keys(annotations, ANNOTATION_KEYS, name, "annotations")
        flags = {
            key: annotations.get(key, False) for key in ("readOnly", "idempotent", "requiresConfirmation")
        }
        if not all(isinstance(value, bool) for value in flags.values()):
            raise _invalid(name, "annotation flags must be booleans.")
        try:
            input_schema = jsontext.dumps(raw["inputSchema"])
            output_schema = jsontext.dumps(raw["outputSchema"]) if raw.get("outputSchema") is not None else ""
        except jsontext.NotPlainJson as exc:
            raise _invalid(name, f"schema is not JSON: {exc}") from None
        spec = cls(
            name=name,
            description=description,
            input_schema_json=input_schema,
            output_schema_json=output_schema,
            timeout_ms=timeout,
            annotations=ToolAnnotations(
                flags["readOnly"], flags["idempotent"], flags["requiresConfirmation"]
            ),
        )
        check_timeout(spec)
        return spec


# The keys of a tool in tools.json (README, "tools.json"), and of its annotations.
TOOL_KEYS = ("name", "description", "inputSchema", "outputSchema", "timeoutMs", "annotations")
ANNOTATION_KEYS = ("readOnly", "idempotent", "requiresConfirmation")


def refuse_unknown_keys(raw: dict[str, object], known: tuple[str, ...], tool: str, where: str) -> None:
    """Raise ToolmeshError(INVALID_SCHEMA) naming the keys of `raw` not in `known`."""
    unknown = [key for key in raw if key not in known]
    if unknown:
        names = ", ".join(f'"{key}"' for key in unknown)
        place = f" in {where}" if where else ""
        raise _invalid(tool, f"unknown key {names}{place}; the keys are {', '.join(known)}.")


def check_timeout(spec: ToolSpec) -> None:
    if not 0 <= spec.timeout_ms <= MAX_TOOL_TIMEOUT_MS:
        raise _invalid(spec.name, f"timeoutMs must be between 0 and {MAX_TOOL_TIMEOUT_MS}.")


def _invalid(tool: str, detail: str) -> ToolmeshError:
    return ToolmeshError(Code.INVALID_SCHEMA, f"{tool}: {detail}" if tool else detail, {"tool": tool})


@dataclass(frozen=True, slots=True)
class ToolSet:
    """A session's tools at one revision (0: nothing was ever put)."""

    revision: int
    tools: tuple[ToolSpec, ...] = ()

    def find(self, name: str) -> ToolSpec | None:
        for tool in self.tools:
            if tool.name == name:
                return tool
        return None
