"""Fuzzing every RPC of every service: generated messages, JSON arguments and schemas, random bytes.

Hypothesis draws a request for each method of the registry, invocation and
bridge services, from the method's own message descriptor: every field set
or not, strings near the limits (empty, long, invalid ids, lone surrogates),
JSON text in the `*_json` fields (values, schemas with nested combinators and
patterns, broken JSON, JSON-escaped lone surrogates), and random bytes in
place of the whole message (invalid UTF-8 included). Each goes to every
listener that serves the method (public, internal) and, for the host-facing
methods, to the bridge's web port over Connect. An answer must come within a
few seconds and, when it is an error, be a typed one: a status other than
UNKNOWN and INTERNAL, with a google.rpc.ErrorInfo (Connect: a code other than
unknown/internal, with details).

tests/system/test_fuzz.py runs a bounded number of examples against in-process
servers; this module also runs for minutes against the services as processes:

    python -m bench.fuzz --minutes N

printing the inputs run, the statuses seen, the untyped answers (with the
method), and each process's RSS before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from toolmesh.auth.policy import INTERNAL, PUBLIC
from toolmesh.v1 import bridge_pb2, invocation_pb2, registry_pb2

SERVICES = [
    module.DESCRIPTOR.services_by_name[name]
    for module, name in (
        (registry_pb2, "RegistryService"),
        (invocation_pb2, "InvocationService"),
        (bridge_pb2, "BridgeService"),
    )
]
METHODS: list[MethodDescriptor] = [method for service in SERVICES for method in service.methods]
# What the bridge's web port serves (Connect, for pages).
WEB_METHODS = frozenset(
    ("OpenHostSession", "SubmitToolResult", "AnswerReadCheck", "DeclareHostTools", "StartToolRequests")
)
UNTYPED = frozenset({"UNKNOWN", "INTERNAL"})
ANSWER_WITHIN_S = 8.0
DETAILS_KEY = "grpc-status-details-bin"

# -- what to send -------------------------------------------------------------

# Strings a caller could send where ids and names go: valid ones, the edges of the rules, and worse.
AWKWARD_TEXT = [
    "",
    "s",
    "session-1",
    "a:b",
    "../etc",
    " ",
    "x" * 129,
    "\u0000",
    "é",
    "\u202e",
    "tool.name",
    "*",
]
# Protobuf cannot encode a lone surrogate: invalid UTF-8 comes in through INVALID_UTF8 below.
unicode = st.characters(exclude_categories=["Cs"])
json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(unicode, max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(unicode, max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
PATTERNS = ["^(a+)+$", "(", "[a-z]*"]
schema_types = st.sampled_from(["object", "string", "integer", "number", "array", "boolean", "null"])
schemas = st.recursive(
    st.fixed_dictionaries({"type": schema_types})
    | st.fixed_dictionaries(
        {"type": st.just("string"), "pattern": st.sampled_from(["^(a+)+$", "(", "[a-z]*"])}
    )
    | st.fixed_dictionaries({"type": st.just("integer"), "maximum": st.integers()})
    | st.just({"$ref": "#"})
    | st.just({"$ref": "http://127.0.0.1:9/x"}),
    lambda inner: (
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)})
        | st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(st.text(unicode, max_size=5), inner)}
        )
        | st.fixed_dictionaries({"not": inner})
    ),
    max_leaves=12,
)
json_text = st.one_of(
    json_values.map(json.dumps),
    schemas.map(json.dumps),
    st.just('{"a": "\\ud800"}'),
    st.just('{"a": '),
    st.just("[1, 2"),
    st.just("1e999999"),
    st.just("[" * 5_000 + "]" * 5_000),
    st.text(unicode, max_size=30),
)
texts = (
    st.sampled_from(AWKWARD_TEXT)
    | st.text(unicode, max_size=40)
    | st.integers(129, 20_000).map(lambda length: "x" * length)
)
# Field 1 (a string in every request that has one) holding bytes that are not UTF-8.
INVALID_UTF8 = [b"\x0a\x02\xff\xfe", b"\x0a\x03\xed\xa0\x80", b"\x12\x01\x80"]

_INT_BOUNDS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_ENUM: (-(2**31), 2**31 - 1),
}


def _scalar(field_descriptor: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field_descriptor.type
    if kind == FieldDescriptor.TYPE_STRING:
        return json_text if field_descriptor.name.endswith("_json") else texts
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(width=32 if kind == FieldDescriptor.TYPE_FLOAT else 64)
    if kind == FieldDescriptor.TYPE_ENUM:
        assert field_descriptor.enum_type is not None
        known = [value.number for value in field_descriptor.enum_type.values]
        low, high = _INT_BOUNDS[kind]
        return st.sampled_from(known) | st.integers(low, high)
    low, high = _INT_BOUNDS[kind]
    small = st.integers(max(low, -3), min(high, 100_000))
    return small | st.sampled_from([low, high])


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`: each field left unset or given a drawn value (oneofs: the last set wins)."""
    cls = message_factory.GetMessageClass(descriptor)
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field_descriptor in descriptor.fields:
        if field_descriptor.message_type is not None:
            if field_descriptor.message_type.GetOptions().map_entry:
                key = field_descriptor.message_type.fields_by_name["key"]
                value = field_descriptor.message_type.fields_by_name["value"]
                if value.message_type is not None:
                    continue
                parts[field_descriptor.name] = st.dictionaries(_scalar(key), _scalar(value), max_size=3)
                continue
            if depth >= 3:
                continue
            inner: st.SearchStrategy[Any] = messages(field_descriptor.message_type, depth + 1)
        else:
            inner = _scalar(field_descriptor)
        if field_descriptor.is_repeated:
            inner = st.lists(inner, max_size=3)
        parts[field_descriptor.name] = st.none() | inner

    def build(values: dict[str, Any]) -> Message:
        built = cls()
        for name, value in values.items():
            if value is None:
                continue
            target = getattr(built, name) if hasattr(built, name) else None
            field_descriptor = descriptor.fields_by_name[name]
            if isinstance(value, dict):
                target.update(value)  # type: ignore[union-attr]
            elif isinstance(value, list):
                if field_descriptor.message_type is not None:
                    for item in value:
                        target.add().CopyFrom(item)  # type: ignore[union-attr]
                else:
                    target.extend(value)  # type: ignore[union-attr]
            elif isinstance(value, Message):
                target.CopyFrom(value)  # type: ignore[union-attr]
            else:
                setattr(built, name, value)
        return built

    return st.fixed_dictionaries(parts).map(build)


def serialized(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """A message as bytes; lone surrogates (which protobuf cannot encode) go in as invalid UTF-8."""
    return messages(descriptor).map(lambda message: message.SerializeToString())


def payloads(method: MethodDescriptor) -> st.SearchStrategy[bytes]:
    """What is sent as one request message: a drawn message, or random bytes."""
    return serialized(method.input_type) | st.sampled_from(INVALID_UTF8) | st.binary(max_size=200)


# -- where it goes ------------------------------------------------------------


@dataclass(frozen=True)
class Targets:
    """The listeners under test."""

    registry: str
    registry_internal: str
    invocation: str
    bridge: str
    bridge_internal: str
    web_url: str | None = None

    def listeners(self, method: MethodDescriptor) -> list[str]:
        """Every listener that serves `method`, and one that does not (WRONG_LISTENER)."""
        service = method.containing_service.full_name
        public, internal = {
            "toolmesh.v1.RegistryService": (self.registry, self.registry_internal),
            "toolmesh.v1.InvocationService": (self.invocation, None),
            "toolmesh.v1.BridgeService": (self.bridge, self.bridge_internal),
        }[service]
        full = f"{service}/{method.name}"
        found = [public]
        if internal is not None and (full in INTERNAL or full in PUBLIC):
            found.append(internal)
        return found


@dataclass
class Tally:
    """What a fuzz run saw."""

    inputs: int = 0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    untyped: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def saw(self, status: str, method: str, typed: bool) -> None:
        with self.lock:
            self.inputs += 1
            self.statuses[status] += 1
            if not typed:
                self.untyped.append(f"{method}: {status}")


def _identity(raw: bytes) -> bytes:
    return raw


class Prober:
    """Sends payloads over plain gRPC channels (and Connect over HTTP) and judges the answers."""

    def __init__(self, targets: Targets, tally: Tally) -> None:
        self.targets = targets
        self.tally = tally
        self._channels: dict[str, grpc.Channel] = {}
        self._http = httpx.Client(timeout=ANSWER_WITHIN_S)

    def _channel(self, target: str) -> grpc.Channel:
        if target not in self._channels:
            self._channels[target] = grpc.insecure_channel(target)
        return self._channels[target]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._http.close()

    def probe(self, method: MethodDescriptor, payload: bytes) -> None:
        for target in self.targets.listeners(method):
            self._grpc(target, method, payload)
        if self.targets.web_url is not None and method.name in WEB_METHODS:
            self._connect(method, payload)

    def _grpc(self, target: str, method: MethodDescriptor, payload: bytes) -> None:
        path = f"/{method.containing_service.full_name}/{method.name}"
        channel = self._channel(target)
        name = f"{path} @ {target}"
        try:
            if method.client_streaming:
                call: Any = channel.stream_stream(path, _identity, _identity)(
                    iter([payload]), timeout=ANSWER_WITHIN_S
                )
                for _ in call:
                    break  # one answer is enough: the stream lives on until cancelled
                call.cancel()
            elif method.server_streaming:
                call = channel.unary_stream(path, _identity, _identity)(payload, timeout=ANSWER_WITHIN_S)
                for _ in call:
                    break
                call.cancel()
            else:
                channel.unary_unary(path, _identity, _identity)(payload, timeout=ANSWER_WITHIN_S)
        except grpc.RpcError as error:
            status = error.code().name
            if status == "CANCELLED":  # ours, after the first answer
                self.tally.saw("OK", name, typed=True)
                return
            if status == "DEADLINE_EXCEEDED":
                self.tally.saw("NO_ANSWER", name, typed=False)
                return
            keys = {entry.key for entry in error.trailing_metadata() or ()}
            typed = status not in UNTYPED and DETAILS_KEY in keys
            self.tally.saw(status, name if typed else f"{name} ({(error.details() or '')[:60]})", typed)
            return
        self.tally.saw("OK", name, typed=True)

    def _connect(self, method: MethodDescriptor, payload: bytes) -> None:
        assert self.targets.web_url is not None
        url = f"{self.targets.web_url}/{method.containing_service.full_name}/{method.name}"
        name = f"connect {method.name}"
        try:
            if method.server_streaming:
                body = struct.pack(">BI", 0, len(payload)) + payload
                headers = {"content-type": "application/connect+proto"}
                with self._http.stream("POST", url, content=body, headers=headers) as response:
                    status, typed = _connect_stream_answer(response)
            else:
                response = self._http.post(
                    url, content=payload, headers={"content-type": "application/proto"}
                )
                status, typed = _connect_unary_answer(response)
        except httpx.TimeoutException:
            self.tally.saw("NO_ANSWER", name, typed=False)
            return
        self.tally.saw(f"connect:{status}", f"{name} ({payload[:40]!r})", typed)


def _connect_unary_answer(response: httpx.Response) -> tuple[str, bool]:
    if response.status_code == 200:
        return "ok", True
    return _connect_error(response.content)


def _connect_error(body: bytes) -> tuple[str, bool]:
    try:
        error = json.loads(body)
    except ValueError:
        return "not_json", False
    code = str(error.get("code", "none"))
    return code, code not in {"unknown", "internal", "none"} and bool(error.get("details"))


def _connect_stream_answer(response: httpx.Response) -> tuple[str, bool]:
    """The first enveloped message: a message (fine) or the end of the stream (its error, if any)."""
    if response.status_code != 200:
        return _connect_error(response.read())
    buffer = b""
    for chunk in response.iter_bytes():
        buffer += chunk
        if len(buffer) >= 5:
            flags, size = struct.unpack(">BI", buffer[:5])
            if flags & 0x02 == 0:
                return "ok", True
            if len(buffer) >= 5 + size:
                end = json.loads(buffer[5 : 5 + size] or b"{}")
                if "error" not in end:
                    return "ok", True
                return _connect_error(json.dumps(end["error"]).encode())
    return "empty", False


# -- health -------------------------------------------------------------------


def serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        response = check(health_pb2.HealthCheckRequest(), timeout=5)
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


# -- running ------------------------------------------------------------------


def fuzz(prober: Prober, examples: int, seed: int | None = None) -> None:
    """`examples` drawn inputs for each method, each sent to every listener of it."""
    for method in METHODS:
        run_method(prober, method, examples, seed)


def run_method(prober: Prober, method: MethodDescriptor, examples: int, seed: int | None = None) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=seed is None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(payloads(method))
    def one(payload: bytes) -> None:
        prober.probe(method, payload)

    if seed is not None:
        from hypothesis import seed as with_seed  # noqa: PLC0415

        one = with_seed(seed)(one)
    one()


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status").read().splitlines():  # noqa: SIM115
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def _start_processes() -> tuple[list[Any], Targets]:
    from bench import procs  # noqa: PLC0415

    listen = ["--listen", "127.0.0.1:0", "--internal-listen", "127.0.0.1:0"]
    registry, bridge = await asyncio.gather(
        procs.start("registry", ["-m", "toolmesh.registry", *listen]),
        procs.start("bridge", ["-m", "toolmesh.bridge", *listen, "--web-listen", "127.0.0.1:0"]),
    )
    dependencies = ["--registry", await registry.internal_target()]
    dependencies += ["--bridge", await bridge.internal_target()]
    invocation = await procs.start(
        "invocation", ["-m", "toolmesh.invocation", "--listen", "127.0.0.1:0", *dependencies]
    )
    web = await bridge.wait_for(r"serves pages \(Connect, gRPC-Web\) on port (\d+)")
    targets = Targets(
        registry.target,
        await registry.internal_target(),
        invocation.target,
        bridge.target,
        await bridge.internal_target(),
        f"http://127.0.0.1:{web.group(1)}",
    )
    return [registry, bridge, invocation], targets


def _rounds(minutes: float) -> Iterator[int]:
    until = time.monotonic() + minutes * 60
    round_number = 0
    while time.monotonic() < until:
        round_number += 1
        yield round_number


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz")
    parser.add_argument("--minutes", type=float, default=3.0, help="how long to fuzz (default %(default)s)")
    parser.add_argument("--examples", type=int, default=50, help="examples per method and round")
    args = parser.parse_args(argv)
    loop = asyncio.new_event_loop()
    running, targets = loop.run_until_complete(_start_processes())
    tally = Tally()
    prober = Prober(targets, tally)
    try:
        before = {proc.name: _rss_kib(proc.pid) for proc in running}
        started = time.monotonic()
        rounds = 0
        for rounds in _rounds(args.minutes):
            for method in METHODS:
                run_method(prober, method, args.examples, seed=rounds)
        elapsed = time.monotonic() - started
        after = {proc.name: _rss_kib(proc.pid) for proc in running}
        healthy = {name: serving(target) for name, target in _health_targets(targets)}
    finally:
        prober.close()
        loop.run_until_complete(_stop(running))
        loop.close()
    _report(tally, rounds=rounds, elapsed=elapsed, before=before, after=after, healthy=healthy)


def _health_targets(targets: Targets) -> list[tuple[str, str]]:
    return [("registry", targets.registry), ("invocation", targets.invocation), ("bridge", targets.bridge)]


async def _stop(running: list[Any]) -> None:
    from bench import procs  # noqa: PLC0415

    await procs.stop_all(running)


def _report(
    tally: Tally,
    *,
    rounds: int,
    elapsed: float,
    before: dict[str, int],
    after: dict[str, int],
    healthy: dict[str, bool],
) -> None:
    print(f"{tally.inputs} inputs in {elapsed:.0f} s ({rounds} rounds over {len(METHODS)} methods)")
    print("statuses seen:")
    for status, count in tally.statuses.most_common():
        print(f"  {status:<28}{count:>8}")
    print(f"untyped answers (UNKNOWN, INTERNAL, no ErrorInfo, no answer): {len(tally.untyped)}")
    for line in collections.Counter(tally.untyped).most_common(20):
        print(f"  {line[1]:>6} x {line[0]}")
    print(f"{'process':<12}{'RSS before MiB':>16}{'RSS after MiB':>15}")
    for name, kib in before.items():
        print(f"{name:<12}{kib / 1024:>16.1f}{after[name] / 1024:>15.1f}")
    print(
        "health afterwards: "
        + ", ".join(f"{n} {'SERVING' if ok else 'NOT SERVING'}" for n, ok in healthy.items())
    )


if __name__ == "__main__":
    main()
