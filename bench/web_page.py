"""A page as handler host, against the Python host, in one run: `python -m bench.web_page`.

Registry, bridge (with its web port) and invocation run as `python -m toolmesh.*`
processes. Two hosts serve a no-op tool: the Python SDK in a process of its own
(`bench.host`, session `bench-py`), and the TypeScript SDK in a page in
Debian's Chromium (the browser tests' page, session `bench-page`, Connect over
HTTP/1.1). Each is called through `InvocationClient`: p50/p99 of sequential
calls, and calls/s with `--concurrency` in flight, with the CPU per call of the bridge
and the invocation service (where the web port's Python shows) and of every
Chromium process (idle while the Python host is measured), and, for the
page, the requests it made per call by RPC (its resource timings: what
batching saves). Also the package's size:
`src/index.ts` bundled and minified by esbuild, and gzipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import procs
from bench.host import READY
from bench.measure import Call, sequential, throughput
from bench.stack import NOOP_SCHEMA
from browser_driver import TYPESCRIPT, BrowserDriver, build_test_page
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.tools import ToolSpec

WEB_PORT_LINE = re.compile(r"serves pages \(Connect, gRPC-Web\) on port (\d+)")
RESULTS = Path(__file__).resolve().parent / "results"
# Free ports for both listeners: the defaults' fixed internal ports would clash with a running system.
LISTEN = ["--listen", "127.0.0.1:0", "--internal-listen", "127.0.0.1:0"]


def package_size() -> dict[str, int]:
    out = subprocess.run(
        ["node", "scripts/bundle.mjs", "size"], cwd=TYPESCRIPT, check=True, capture_output=True, text=True
    ).stdout
    size: dict[str, int] = json.loads(out)
    return size


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (the driver's Chromium: its browser, renderer, network and GPU processes)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


def noop_call(client: InvocationClient, session: str) -> Call:
    counter = iter(range(1 << 62))

    async def call() -> None:
        # Distinct arguments each time: identical calls would join.
        result = await client.invoke(
            session, "noop", turn_id="bench", arguments_json=f'{{"n":{next(counter)}}}'
        )
        if result.outcome is None or result.outcome.result_json != '{"ok":true}':
            raise AssertionError(f"unexpected outcome: {result.to_json()}")

    return call


# The page's requests by RPC since its resource timings were last cleared.
PAGE_REQUESTS = (
    "performance.getEntriesByType('resource').map((e) => e.name).filter((n) => n.includes('/toolmesh.v1.'))"
    ".reduce((by, n) => { const rpc = n.split('/').pop(); by[rpc] = (by[rpc] ?? 0) + 1; return by; }, {})"
)
CLEAR_REQUESTS = (
    "performance.setResourceTimingBufferSize(1000000) || performance.clearResourceTimings() || true"
)


async def run(calls: int, warmup: int, concurrency: int, seconds: float) -> dict[str, Any]:
    await asyncio.to_thread(build_test_page)
    driver = await BrowserDriver.start()
    started: list[procs.Proc] = []
    try:
        registry = await procs.start("registry", ["-m", "toolmesh.registry", *LISTEN])
        started.append(registry)
        registry_internal = await registry.internal_target()
        bridge = await procs.start(
            "bridge",
            [
                "-m", "toolmesh.bridge", *LISTEN, "--registry", registry_internal,
                "--web-listen", "127.0.0.1:0", "--web-origins", driver.origins[0],
            ],
        )  # fmt: skip
        started.append(bridge)
        web_port = int((await bridge.wait_for(WEB_PORT_LINE)).group(1))
        invocation = await procs.start(
            "invocation",
            [
                "-m",
                "toolmesh.invocation",
                "--listen",
                "127.0.0.1:0",
                "--registry",
                registry_internal,
                "--bridge",
                await bridge.internal_target(),
            ],
        )
        started.append(invocation)
        host = await procs.start(
            "host", ["-m", "bench.host", "--bridge", bridge.target, "--session", "bench-py"], port_line=False
        )
        started.append(host)
        await host.wait_for(READY)
        async with RegistryClient(registry.target) as registry_client:
            await registry_client.put_tools("bench-py", [ToolSpec("noop", "Does nothing", NOOP_SCHEMA)])
        opened = await driver.open(
            "page", {"session": "bench-page", "baseUrl": f"http://127.0.0.1:{web_port}"}
        )
        if not opened["started"]:
            raise AssertionError(f"the page did not start: {opened}")

        figures: dict[str, Any] = {"package": package_size()}

        browser = descendants(driver.process.pid)

        def cpu() -> dict[str, float]:
            used = {proc.name: procs.cpu_seconds(proc.pid) for proc in (bridge, invocation)}
            return used | {"chromium": sum(procs.cpu_seconds(pid) for pid in browser)}

        async with InvocationClient(invocation.target) as client:
            for name, session in (("python host", "bench-py"), ("page (Chromium)", "bench-page")):
                call = noop_call(client, session)
                row: dict[str, Any] = {"sequential": await sequential(call, calls, warmup)}
                await driver.eval("page", CLEAR_REQUESTS)
                done = [0]

                async def counted(call: Call = call, done: list[int] = done) -> None:
                    await call()
                    done[0] += 1

                row["throughput"] = await throughput(
                    counted, concurrency, seconds, warmup_s=1.0, cpu_seconds=cpu
                )
                if session == "bench-page":
                    # Over the whole run, warm-up included: per call answered.
                    requests: dict[str, int] = await driver.eval("page", PAGE_REQUESTS)
                    row["page_requests_per_call"] = {rpc: n / max(1, done[0]) for rpc, n in requests.items()}
                figures[name] = row
        return figures
    finally:
        await procs.stop_all(started)
        await driver.stop()


def print_table(figures: dict[str, Any], concurrency: int) -> None:
    print(
        f"{'host':<18}{'p50 ms':>9}{'p99 ms':>9}{f'calls/s ({concurrency} in flight)':>28}"
        f"{'bridge CPU ms/call':>20}{'invocation CPU ms/call':>24}{'Chromium CPU ms/call':>22}"
    )
    for name in ("python host", "page (Chromium)"):
        row = figures[name]
        cpu = row["throughput"]["cpu_ms_per_call"]
        print(
            f"{name:<18}{row['sequential']['p50_ms']:>9.2f}{row['sequential']['p99_ms']:>9.2f}"
            f"{row['throughput']['calls_per_s']:>28,.0f}{cpu['bridge']:>20.2f}{cpu['invocation']:>24.2f}"
            f"{cpu['chromium']:>22.2f}"
        )
    per_call = figures["page (Chromium)"]["page_requests_per_call"]
    print(
        "page requests per call under load: "
        + ", ".join(f"{rpc} {n:.2f}" for rpc, n in sorted(per_call.items()))
    )
    size = figures["package"]
    print(
        f"@toolmesh/host bundled with its generated code: {size['minifiedBytes'] / 1024:.1f} KB minified, "
        f"{size['gzippedBytes'] / 1024:.1f} KB gzipped"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.web_page", description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    figures = asyncio.run(run(args.calls, args.warmup, args.concurrency, args.seconds))
    print_table(figures, args.concurrency)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"web_page-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(figures, indent=2))
    print(f"figures: {out}")


if __name__ == "__main__":
    main()
