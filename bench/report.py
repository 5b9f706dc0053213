"""Ratios, targets and the printed table."""

from __future__ import annotations

from typing import Any

from bench import cluster, replicas

LABELS = {
    "floor": "floor: bare grpc.aio chain, 3 processes",
    "floor+lookup": "floor + a lookup hop (as registry GetTool)",
    "toolmesh": "toolmesh: 3 services + host, async no-op",
    "toolmesh-stream": "toolmesh, calls on one InvokeTools stream",
    "toolmesh-sync": "toolmesh, sync no-op (worker thread)",
    "mcp-stdio": "MCP SDK over stdio",
    "mcp-http": "MCP SDK over streamable HTTP",
}
PEERS = {"floor": "floor", "mcp-http": "MCP streamable HTTP", "mcp-stdio": "MCP stdio"}
# Issue 10's targets: the Redis store against the embedded memory.
MAX_P50_VS_MEMORY = 1.25
MIN_THROUGHPUT_VS_MEMORY = 0.8
# Issue 6's targets.
MAX_P50_VS_FLOOR = 1.3
MIN_THROUGHPUT_VS_FLOOR = 0.8
MAX_KB_PER_HELD_CALL = 10.0
# Issue 11's target: TLS on every hop and a token on every call cost at most this much.
MAX_SECURED_VS_PLAIN = 1.15
# The floor process that holds a held call the way each toolmesh service does.
FLOOR_COUNTERPARTS = {"invocation": "front", "bridge": "back", "host": "host"}


def _figures(system: dict[str, Any]) -> dict[str, float]:
    return {
        "p50_ms": system["latency"]["p50_ms"],
        "p99_ms": system["latency"]["p99_ms"],
        "calls_per_s": system["throughput"]["calls_per_s"],
    }


# toolmesh's ways of calling a tool that the targets apply to: unary InvokeTool
# calls (the default client) and calls on one InvokeTools stream (multiplex=True).
OURS = ("toolmesh", "toolmesh-stream")


def ratios(systems: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each of OURS / each peer, for each figure."""
    out: dict[str, dict[str, float]] = {}
    for name in OURS:
        if name not in systems:
            continue
        ours = _figures(systems[name])
        for peer in PEERS:
            if peer in systems:
                theirs = _figures(systems[peer])
                out[f"{name}/{peer}"] = {key: ours[key] / theirs[key] for key in ours}
    return out


def targets(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 6's targets that this run could check, each with its value and whether it was met."""
    found: dict[str, dict[str, Any]] = {}
    for name in OURS:
        way = "unary" if name == "toolmesh" else "stream"
        versus_floor = results.get("ratios", {}).get(f"{name}/floor")
        if versus_floor is not None:
            found[f"{way}: p50 <= 1.3x floor"] = {
                "value": versus_floor["p50_ms"],
                "met": versus_floor["p50_ms"] <= MAX_P50_VS_FLOOR,
            }
            found[f"{way}: calls/s >= 0.8x floor"] = {
                "value": versus_floor["calls_per_s"],
                "met": versus_floor["calls_per_s"] >= MIN_THROUGHPUT_VS_FLOOR,
            }
        versus_http = results.get("ratios", {}).get(f"{name}/mcp-http")
        if versus_http is not None:
            found[f"{way}: calls/s > MCP streamable HTTP"] = {
                "value": versus_http["calls_per_s"],
                "met": versus_http["calls_per_s"] > 1.0,
            }
    for key, way in (("scale", "stream"), ("scale_unary", "unary")):
        scale = results.get(key)
        if scale is None:
            continue
        found[f"{way}: all held calls correct"] = {
            "value": scale["correct"],
            "met": scale["correct"] == scale["calls"] and scale["held_together"] == scale["calls"],
        }
        for service in ("invocation", "bridge"):
            per_call = scale["memory"][service]["per_call_kb"]
            found[f"{way}: {service} < 10 KB per held call"] = {
                "value": per_call,
                "met": per_call < MAX_KB_PER_HELD_CALL,
            }
    stored = results.get("store")
    if stored is not None:
        versus_memory = stored["redis/memory"]
        found[f"redis store: p50 <= {MAX_P50_VS_MEMORY}x memory (issue 10)"] = {
            "value": versus_memory["p50"],
            "met": versus_memory["p50"] <= MAX_P50_VS_MEMORY,
        }
        found[f"redis store: calls/s >= {MIN_THROUGHPUT_VS_MEMORY}x memory (issue 10)"] = {
            "value": versus_memory["calls_per_s"],
            "met": versus_memory["calls_per_s"] >= MIN_THROUGHPUT_VS_MEMORY,
        }
    sharded = results.get("cluster")
    if sharded is not None:
        found |= cluster.targets(sharded)
    secured = results.get("security")
    if secured is not None:
        for name, ratio in secured["tls+tokens/plain"].items():
            way = "unary" if name == "toolmesh" else "stream"
            p50, rate = ratio["p50"]["median"], ratio["calls_per_s"]["median"]
            found[f"{way}: TLS+tokens p50 <= 1.15x plain (issue 11)"] = {
                "value": p50,
                "met": p50 <= MAX_SECURED_VS_PLAIN,
            }
            found[f"{way}: TLS+tokens calls/s >= plain/1.15 (issue 11)"] = {
                "value": rate,
                "met": rate >= 1 / MAX_SECURED_VS_PLAIN,
            }
    join = results.get("join_storm")
    if join is not None:
        found["join storm: one execution"] = {
            "value": join["handler_executions"],
            "met": join["handler_executions"] == 1,
        }
    return found


def table(results: dict[str, Any]) -> str:
    meta = results["meta"]
    sizes = meta["sizes"]
    lines = [
        f"toolmesh benchmark  commit {meta['commit']}  {meta['cpus']} CPUs  Python {meta['python']}"
        f"  grpcio {meta['grpcio']}  mcp {meta['mcp'] or '-'}  load average {meta['load_before']}"
        f" before, {meta.get('load_after', '-')} after",
    ]
    systems = results.get("systems")
    if systems is not None:
        lines += [
            "",
            f"One no-op tool call: latency over {sizes['calls']} sequential calls;"
            f" throughput with {sizes['concurrency']} in flight for {sizes['seconds']:g} s",
            f"  {'system':<44} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9} {'CPU ms/call':>12}",
        ]
        for name, system in systems.items():
            figures = _figures(system)
            lines.append(
                f"  {LABELS.get(name, name):<44} {figures['p50_ms']:>8.2f} {figures['p99_ms']:>8.2f}"
                f" {figures['calls_per_s']:>9.0f} {system['latency']['cpu_ms_per_call']['total']:>12.2f}"
            )
        for name, reason in results.get("skipped", {}).items():
            lines.append(f"  {name}: skipped, {reason}")
        in_flight = f"call, {sizes['concurrency']} in flight"
        for phase, title in (("latency", "sequential call"), ("throughput", in_flight)):
            lines += ["", f"  CPU ms per {title}, by process (all processes of the system and the caller)"]
            for name, system in systems.items():
                cpu = system[phase].get("cpu_ms_per_call", {})
                parts = "  ".join(f"{process} {ms:.2f}" for process, ms in cpu.items())
                lines.append(f"  {name:<16} {parts}")
        lines += ["", f"  {'ratio':<44} {'p50':>8} {'p99':>8} {'calls/s':>9}"]
        for name, ratio in results["ratios"].items():
            p50, p99, rate = ratio["p50_ms"], ratio["p99_ms"], ratio["calls_per_s"]
            lines.append(f"  {name:<44} {p50:>7.2f}x {p99:>7.2f}x {rate:>8.2f}x")
    lines += _state_lines(results)
    traced = results.get("tracing")
    if traced is not None:
        lines += [
            "",
            "Tracing overhead on a no-op toolmesh call (every service and the host exporting over OTLP)",
            f"  {'tracing':<44} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9} {'CPU ms/call':>12}",
        ]
        for label in ("off", "on"):
            figures = _figures(traced[label])
            cpu = traced[label]["latency"]["cpu_ms_per_call"]["total"]
            lines.append(
                f"  {label:<44} {figures['p50_ms']:>8.2f} {figures['p99_ms']:>8.2f}"
                f" {figures['calls_per_s']:>9.0f} {cpu:>12.2f}"
            )
        ratio = traced["on/off"]
        lines.append(
            f"  {'on/off':<44} {ratio['p50']:>7.2f}x {ratio['p99']:>7.2f}x {ratio['calls_per_s']:>8.2f}x"
            f" {ratio['cpu_per_call']:>11.2f}x   ({traced['spans_exported']} spans exported)"
        )
    secured = results.get("security")
    if secured is not None:
        lines += _security_lines(secured)
    for key in ("scale", "scale_unary"):
        scale = results.get(key)
        if scale is not None:
            lines += _scale_lines(scale, results.get("scale_floor"))
    join = results.get("join_storm")
    if join is not None:
        lines += [
            "",
            f"Join storm: {join['calls']} identical calls (handler takes {join['execution_s']:g} s):"
            f" {join['handler_executions']} handler executions, {join['distinct_tool_request_ids']} distinct"
            f" tool request ids, {join['answered_ok']} answered OK, all in {join['seconds']:.2f} s",
        ]
        if join["failures"]:
            lines.append(f"  failures: {join['failures']}")
    checks = results.get("validation")
    if checks is not None:
        lines += [
            "",
            f"Argument validation alone: {checks['fields']}-field nested schema,"
            f" {checks['violations_in_invalid']} violations in the invalid arguments",
            f"  {'validator':<44} {'calls/s':>9} {'us/call':>9}",
        ]
        for name, row in checks["rows"].items():
            lines.append(f"  {name:<44} {row['calls_per_s']:>9.0f} {row['us_per_call']:>9.1f}")
    found = results.get("targets", {})
    if found:
        lines += ["", "Targets (issues 6, 10 and 11)"]
        for name, target in found.items():
            value = target["value"]
            shown = f"{value:.2f}" if isinstance(value, float) else str(value)
            lines.append(f"  {'met   ' if target['met'] else 'MISSED'} {name:<46} {shown}")
    return "\n".join(lines)


def _state_lines(results: dict[str, Any]) -> list[str]:
    """The store and replicas sections, those that ran."""
    lines = []
    stored = results.get("store")
    if stored is not None:
        lines += _store_lines(stored)
    sharded = results.get("cluster")
    if sharded is not None:
        lines += cluster.lines(sharded, _figures)
    replicated = results.get("replicas")
    if replicated is not None:
        lines += replicas.lines(replicated, _figures)
    return lines


def _store_lines(stored: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"State store: unary no-op calls to two systems, state in memory or in Redis ({stored['redis_url']}),"
        f" measured in {stored['rounds']} alternating turns",
        f"  {'store':<30} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9} {'CPU ms/call':>12} {'under load':>11}",
    ]
    for label in ("memory", "redis"):
        figures = _figures(stored[label])
        sequential = stored[label]["latency"]["cpu_ms_per_call"]["total"]
        loaded = stored[label]["throughput"]["cpu_ms_per_call"]["total"]
        lines.append(
            f"  {label:<30} {figures['p50_ms']:>8.2f} {figures['p99_ms']:>8.2f}"
            f" {figures['calls_per_s']:>9.0f} {sequential:>12.2f} {loaded:>11.2f}"
        )
    ratio = stored["redis/memory"]
    lines.append(
        f"  {'redis/memory':<30} {ratio['p50']:>7.2f}x {ratio['p99']:>7.2f}x {ratio['calls_per_s']:>8.2f}x"
        f" {'':>12} {ratio['cpu_per_call']:>10.2f}x"
    )
    seen = "counts" if stored["redis_cpu_counted"] else "is not seen (not on this machine)"
    lines.append(f"  (CPU: every process of the system and the caller; the Redis server's {seen})")
    return lines


def _scale_lines(scale: dict[str, Any], floor: dict[str, Any] | None) -> list[str]:
    lines = [
        "",
        f"Scale: {scale['calls']} slow calls held at once, on {scale['calls_travel_on']}"
        f" (released together, then {scale['hold_s']:g} s):"
        f" {scale['correct']}/{scale['calls']} correct, {scale['held_together']} held together,"
        f" all started in {scale['seconds_to_start_all']:.1f} s, answered in {scale['seconds']:.1f} s",
    ]
    if scale["failures"]:
        lines.append(f"  failures: {scale['failures']}")
    if scale["host_errors"]:
        lines.append(f"  host errors: {scale['host_errors']}")
    lines.append(
        f"  {'process':<12} {'baseline RSS':>14} {'peak RSS':>12} {'per held call':>15}"
        + (f" {'floor':>26} {'vs floor':>9}" if floor else "")
    )
    for name, memory in scale["memory"].items():
        baseline_mb, peak_mb = memory["baseline_rss_kb"] / 1024, memory["peak_rss_kb"] / 1024
        per_call = memory["per_call_kb"]
        line = f"  {name:<12} {baseline_mb:>11.1f} MB {peak_mb:>9.1f} MB {per_call:>12.2f} KB"
        counterpart = FLOOR_COUNTERPARTS.get(name)
        if floor and counterpart:
            floor_kb = floor["memory"][counterpart]["per_call_kb"]
            line += f" {counterpart:>14} {floor_kb:>8.2f} KB {per_call / floor_kb:>8.2f}x"
        lines.append(line)
    if floor:
        lines.append(
            f"  floor: {floor['correct']}/{floor['calls']} correct, answered in {floor['seconds']:.1f} s"
            + (f"; failures: {floor['failures']}" if floor["failures"] else "")
        )
    return lines


def _security_lines(secured: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "TLS and tokens: plaintext without tokens against TLS on every hop (mutual between services)"
        f" and a token verified on every call; medians of {secured['rounds']} rounds taken in turns",
        f"  {'system':<44} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9} {'CPU ms/call':>12}",
    ]
    for label in ("plain", "tls+tokens"):
        for way, figures in secured[label].items():
            lines.append(
                f"  {f'{way}, {label}':<44} {figures['p50']:>8.2f} {figures['p99']:>8.2f}"
                f" {figures['calls_per_s']:>9.0f} {figures['cpu_per_call']:>12.2f}"
            )
    lines.append(f"  {'tls+tokens/plain, per round: median (low-high)':<44}")
    for way, ratio in secured["tls+tokens/plain"].items():
        shown = "  ".join(
            f"{name} {r['median']:.2f}x ({r['low']:.2f}-{r['high']:.2f})" for name, r in ratio.items()
        )
        lines.append(f"  {way:<16} {shown}")
    lines.append(
        f"  token, in process: signature check (first sight) {secured['signature_check_us']:.1f} us,"
        f" admission of a call with a token seen before {secured['admission_cached_us']:.2f} us"
    )
    return lines
