"""The contract documents itself: every service, method, message, field, enum and value of the protos
has a comment, and the descriptors the servers' reflection serves carry them."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DESCRIPTORS = ROOT / "services" / "src" / "toolmesh" / "runtime" / "descriptors.binpb"

# Paths into a FileDescriptorProto (descriptor.proto's field numbers).
MESSAGES, ENUMS, SERVICES = 4, 5, 6
FIELDS, NESTED, ONEOFS = 2, 3, 8
VALUES, METHODS = 2, 2


def described(path: tuple[int, ...], comments: dict[tuple[int, ...], str]) -> bool:
    return bool(comments.get(path, "").strip())


def undocumented_message(
    proto: descriptor_pb2.DescriptorProto,
    path: tuple[int, ...],
    name: str,
    comments: dict[tuple[int, ...], str],
) -> list[str]:
    """The parts of one message (and its nested ones) without a comment."""
    missing = []
    if not described(path, comments) and not proto.name.endswith(("Request", "Response")):
        missing.append(name)
    for index, field in enumerate(proto.field):
        if not described((*path, FIELDS, index), comments):
            missing.append(f"{name}.{field.name}")
    for index, oneof in enumerate(proto.oneof_decl):
        # A proto3 `optional` field's own oneof (_name) is not written in the file.
        if not oneof.name.startswith("_") and not described((*path, ONEOFS, index), comments):
            missing.append(f"{name}.{oneof.name} (oneof)")
    for index, nested in enumerate(proto.nested_type):
        if not nested.options.map_entry:
            missing += undocumented_message(nested, (*path, NESTED, index), f"{name}.{nested.name}", comments)
    return missing


def undocumented() -> list[str]:
    files = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTORS.read_bytes()).file
    missing: list[str] = []
    for file in files:
        comments = {
            tuple(location.path): location.leading_comments + location.trailing_comments
            for location in file.source_code_info.location
        }
        for index, proto in enumerate(file.message_type):
            missing += undocumented_message(proto, (MESSAGES, index), proto.name, comments)
        for index, enum in enumerate(file.enum_type):
            if not described((ENUMS, index), comments):
                missing.append(enum.name)
            for value_index, value in enumerate(enum.value):
                if not described((ENUMS, index, VALUES, value_index), comments):
                    missing.append(f"{enum.name}.{value.name}")
        for index, service in enumerate(file.service):
            if not described((SERVICES, index), comments):
                missing.append(service.name)
            for method_index, method in enumerate(service.method):
                if not described((SERVICES, index, METHODS, method_index), comments):
                    missing.append(f"{service.name}.{method.name}")
    return missing


def test_every_part_of_the_contract_has_a_comment() -> None:
    # A request or response message says what it is by its RPC's comment; all else says so itself.
    assert undocumented() == []
