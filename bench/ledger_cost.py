"""The invocation ledger's cost on the call path, and its memory per finished entry.

In one process, no network: the invoker with the real ledger against the
invoker with a ledger that keeps nothing (the baseline), both around a tool
lookup and a dispatch that answer at once, so the difference is the ledger's
own work (claim, finish, confirm). Then tracemalloc measures what finished
entries hold in the in-memory store, unconfirmed (replayable) and confirmed.

    python -m bench.ledger_cost [--calls N] [--entries N] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolmesh.contracts.ledger import Claim, InvocationRecord, InvocationState, Ledger
from toolmesh.core.calls import ToolCall, ToolRequest
from toolmesh.core.outcome import Outcome
from toolmesh.core.tools import ToolSpec
from toolmesh.invocation.invoker import Invoker
from toolmesh.invocation.observability import InvocationTelemetry
from toolmesh.store.ledger import Delivered, LeaseTerms
from toolmesh.store.memory import MemoryLedgerStore

TOOL = ToolSpec("noop", "", '{"type":"object","properties":{"n":{"type":"integer"}}}')
RESULT = Outcome.success('{"ok":true}')


class Catalog:
    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        return TOOL


class InstantHost:
    async def dispatch(self, request: ToolRequest, on_progress: object = None) -> Outcome:
        return RESULT


class KeepNothing(Ledger):
    """Baseline: every call is new and nothing is stored."""

    async def claim(
        self,
        call: ToolCall,
        new_id: str,
        timeout_ms: int,
        idempotency_key: str = "",
        trace_context: dict[str, str] | None = None,
        *,
        arguments: Any = None,
        confirmed: Sequence[Delivered] = (),
        lease: LeaseTerms | None = None,
    ) -> Claim:
        record = InvocationRecord(
            new_id, call.session_id, call.turn_id, call.tool_name, "", InvocationState.RUNNING, 0.0
        )
        return Claim(record, True)

    async def finish(
        self,
        tool_request_id: str,
        outcome: Outcome,
        *,
        replayable: bool = True,
        claimed: InvocationRecord | None = None,
    ) -> bool:
        return True

    async def confirm_all(self, deliveries: Sequence[Delivered]) -> list[str]:
        return []


async def calls_per_second(invoker: Invoker, calls: int) -> float:
    started = time.perf_counter()
    for n in range(calls):
        result = await invoker.invoke(ToolCall("bench", "turn", "noop", f'{{"n": {n}}}'))
        await invoker.confirm_delivery([Delivered(result.tool_request_id, result.attachment_id)])
    return calls / (time.perf_counter() - started)


async def bytes_per_entry(entries: int, confirm: bool) -> float:
    ledger = Ledger(MemoryLedgerStore())
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for n in range(entries):
        request_id = f"tr_{n:032x}"
        await ledger.claim(ToolCall("bench-session", "turn-1", "noop", f'{{"n": {n}}}'), request_id, 60_000)
        await ledger.finish(request_id, RESULT)
        if confirm:
            await ledger.confirm(request_id)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / entries


async def measure(calls: int, entries: int) -> dict[str, Any]:
    # Observed as the service is (with no OpenTelemetry SDK installed, as when nothing exports).
    with_ledger = Invoker(
        Catalog(), InstantHost(), Ledger(MemoryLedgerStore()), observer=InvocationTelemetry()
    )
    without = Invoker(
        Catalog(), InstantHost(), KeepNothing(MemoryLedgerStore()), observer=InvocationTelemetry()
    )
    await calls_per_second(with_ledger, min(calls, 500))  # warm up both
    await calls_per_second(without, min(calls, 500))
    rate_with = await calls_per_second(with_ledger, calls)
    rate_without = await calls_per_second(without, calls)
    return {
        "calls": calls,
        "calls_per_s_with_ledger": rate_with,
        "calls_per_s_without_ledger": rate_without,
        "ledger_us_per_call": (1 / rate_with - 1 / rate_without) * 1e6,
        "ratio_with_over_without_time": rate_without / rate_with,
        "entries": entries,
        "bytes_per_unconfirmed_entry": await bytes_per_entry(entries, confirm=False),
        "bytes_per_confirmed_entry": await bytes_per_entry(entries, confirm=True),
    }


def print_table(figures: dict[str, Any]) -> None:
    print("ledger on the call path (in process, no network)")
    print(f"  calls/s with ledger        {figures['calls_per_s_with_ledger']:>10,.0f}")
    print(f"  calls/s without (baseline) {figures['calls_per_s_without_ledger']:>10,.0f}")
    print(f"  ledger cost per call       {figures['ledger_us_per_call']:>10,.1f} us")
    print(f"  time ratio with/without    {figures['ratio_with_over_without_time']:>10.2f}x")
    print(f"memory per finished entry ({figures['entries']:,} entries, in-memory store)")
    print(f"  unconfirmed (replayable)   {figures['bytes_per_unconfirmed_entry']:>10,.0f} B")
    print(f"  confirmed                  {figures['bytes_per_confirmed_entry']:>10,.0f} B")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--entries", type=int, default=20_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures = asyncio.run(measure(args.calls, args.entries))
    print_table(figures)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
