"""Type names for grpcio objects: grpcio ships no type information, so these are Any."""

from typing import Any, TypeAlias

ServicerContext: TypeAlias = Any
