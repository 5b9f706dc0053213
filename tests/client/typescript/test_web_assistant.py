"""@toolmesh/assistant in a real Chromium: the Assistant, its WebMCP channel and its widget.

The page (clients/typescript/assistant/test/page.ts, bundled by esbuild) runs an
Assistant over the page's WebMCP tools against a scripted chat-completions
server (tests/support/scripted_model.py, over real HTTP). Chromium 156 has
WebMCP behind --enable-features=WebMCP: one test uses it (`mc=native`); the
others use the page's stand-in document.modelContext, which can be made to fail
(absent, incomplete, a throwing getTools) and hands its handlers the call's
signal. Key presses are playwright's, on the focused element.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from assistant_page import PAGE, Page
from browser_driver import TYPESCRIPT, BrowserDriver, build_test_page
from scripted_model import Hold, ScriptedModel, Step, answer, before, failure, raw, running_model, tool_calls
from toolmesh.assistant.errors import TURN_TABLE, TurnCode
from toolmesh.assistant.results import TEXT_LIMIT

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def driver() -> AsyncIterator[BrowserDriver]:
    build_test_page("assistant-test")
    started = await BrowserDriver.start()
    yield started
    await started.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def model() -> AsyncIterator[ScriptedModel]:
    async with running_model(cors=True) as server:
        yield server


_tabs = iter(range(1 << 30))


async def open_page(
    driver: BrowserDriver, model: ScriptedModel, *steps: Step, webmcp: bool = False, **query: str
) -> Page:
    """A tab on the assistant's test page; `query` sets it up (see its header)."""
    model.script(*steps)
    tab = f"a{next(_tabs)}"
    opened = await driver.open(tab, {"model": model.url, **query}, webmcp=webmcp, path="/assistant")
    assert opened["started"], opened
    return Page(driver, tab)


def shown(code: TurnCode) -> str:
    """What the widget shows for a code: the code and the turn table's message."""
    return f"{code.value} {TURN_TABLE[code].message}"


async def test_a_turn_over_the_browsers_own_webmcp(driver: BrowserDriver, model: ScriptedModel) -> None:
    page = await open_page(
        driver,
        model,
        tool_calls(("add_note", {"text": "milk"})),
        answer("Added it."),
        webmcp=True,
        mc="native",
    )
    await page.eval(f"{PAGE}.type('note milk')")
    await page.wait(f"{PAGE}.status() === 'idle' && {PAGE}.assistant.state.messages.length === 4")
    assert await page.eval(f"{PAGE}.notes") == ["milk"]
    [result] = await page.tool_results()
    assert result["ok"] and result["text"] == "Added milk"
    assert "Added it." in await page.eval(f"{PAGE}.log()")
    offered = {tool["function"]["name"] for tool in model.requests[0]["tools"]}
    assert {"add_note", "list_notes", "clear_notes"} <= offered
    assert await page.eval(f"{PAGE}.alertHidden()")
    assert await driver.axe(page.tab) == []
    await page.shot("answered")


ENDING: list[tuple[TurnCode, dict[str, str], list[Step]]] = [
    (TurnCode.UNSUPPORTED_WEBMCP, {"mc": "absent"}, []),
    (TurnCode.UNSUPPORTED_WEBMCP, {"mc": "incomplete"}, []),
    (TurnCode.DISCOVERY_FAILED, {"mc": "throws"}, []),
    (TurnCode.DISCOVERY_FAILED, {"mc": "notlist"}, []),
    (TurnCode.INVALID_SCHEMA, {"schema": "notobject"}, []),
    (TurnCode.INVALID_SCHEMA, {"schema": "dialect"}, []),
    (TurnCode.MODEL_ERROR, {}, [failure(500)]),
    (TurnCode.MODEL_ERROR, {}, [raw(b"this is not json")]),
    (TurnCode.TIMEOUT, {"timeoutMs": "300"}, [Hold()]),
    (
        TurnCode.TURN_LIMIT,
        {"maxRounds": "1"},
        [tool_calls(("list_notes", {})), tool_calls(("list_notes", {}))],
    ),
]


@pytest.mark.parametrize(
    ("code", "query", "steps"), ENDING, ids=[f"{c.value}-{i}" for i, (c, _, _) in enumerate(ENDING)]
)
async def test_codes_that_end_the_turn_land_in_state_error_and_show_their_message(
    driver: BrowserDriver, model: ScriptedModel, code: TurnCode, query: dict[str, str], steps: list[Step]
) -> None:
    model.script(*steps)
    tab = f"a{next(_tabs)}"
    assert (await driver.open(tab, {"model": model.url, **query}, path="/assistant"))["started"]
    page = Page(driver, tab)
    assert await page.outcome(await page.send("hello")) == {"code": code.value}
    assert await page.eval(f"{PAGE}.error()") == code.value
    assert await page.eval(f"{PAGE}.alert()") == shown(code)
    assert TURN_TABLE[code].ends_turn


async def test_failed_tool_results_reach_the_model_and_the_turn_goes_on(
    driver: BrowserDriver, model: ScriptedModel
) -> None:
    page = await open_page(
        driver,
        model,
        tool_calls(
            ("no_such_tool", {}), ("add_note", {"text": 3}), ("add_note", "{not json"), ("fail_note", {})
        ),
        tool_calls(("clear_notes", {}), ("big_note", {})),
        answer("I could not do it."),
    )
    # clear_notes asks first: Escape refuses it.
    index = await page.send("try everything")
    await page.wait(f"{PAGE}.dialogOpen()")
    await driver.press(page.tab, "Escape")
    assert await page.outcome(index) == {"answer": "I could not do it."}
    results = await page.tool_results()
    assert [r["code"] for r in results] == [
        "TOOL_UNAVAILABLE",
        "INVALID_ARGUMENTS",
        "INVALID_ARGUMENTS",
        "EXECUTION_FAILED",
        "CONFIRMATION_DENIED",
        None,
    ]
    # The model read each failure, in its words, in the same turn.
    seen = [m["content"] for m in model.tool_messages(1)]
    assert seen[0].startswith("TOOL_UNAVAILABLE: " + TURN_TABLE[TurnCode.TOOL_UNAVAILABLE].message)
    assert "/text:" in seen[1]
    # The result cap: text cut to TEXT_LIMIT, the too-large data dropped.
    big = results[5]
    assert big["ok"] and len(big["text"]) == TEXT_LIMIT and big["data"] is None
    log = await page.eval(f"{PAGE}.log()")
    for code in ("TOOL_UNAVAILABLE", "INVALID_ARGUMENTS", "EXECUTION_FAILED", "CONFIRMATION_DENIED"):
        assert shown(TurnCode(code)) in log
        assert not TURN_TABLE[TurnCode(code)].ends_turn
    assert await page.eval(f"{PAGE}.error()") is None


async def test_the_confirmation_dialog_by_keyboard(driver: BrowserDriver, model: ScriptedModel) -> None:
    page = await open_page(
        driver,
        model,
        tool_calls(("clear_notes", {})),
        answer("Not cleared."),
        tool_calls(("clear_notes", {})),
        answer("Cleared."),
    )
    await page.eval(f"{PAGE}.notes.push('keep')")
    await page.eval(f"{PAGE}.focusInput()")
    index = await page.send("clear")
    await page.wait(f"{PAGE}.dialogOpen()")
    # Focus moved into the dialog, on Cancel; Enter there refuses.
    assert await page.eval(f"{PAGE}.focused()") == "widget:deny"
    assert await driver.axe(page.tab) == []
    await page.shot("confirmation")
    await driver.press(page.tab, "Enter")
    assert await page.outcome(index) == {"answer": "Not cleared."}
    assert await page.eval(f"{PAGE}.focused()") == "widget:input"
    assert [r["code"] for r in await page.tool_results()] == ["CONFIRMATION_DENIED"]
    assert await page.eval(f"{PAGE}.notes") == ["keep"]

    index = await page.send("clear, really")
    await page.wait(f"{PAGE}.dialogOpen()")
    await driver.press(page.tab, "Tab")
    assert await page.eval(f"{PAGE}.focused()") == "widget:allow"
    await driver.press(page.tab, "Enter")
    assert await page.outcome(index) == {"answer": "Cleared."}
    assert await page.eval(f"{PAGE}.notes") == []
    assert await page.eval(f"{PAGE}.focused()") == "widget:input"


async def test_busy_rejects_a_send_and_changes_nothing(driver: BrowserDriver, model: ScriptedModel) -> None:
    hold = Hold(answer("finally"))
    page = await open_page(driver, model, hold)
    first = await page.send("one")
    await page.wait(f"{PAGE}.status() === 'running'")
    before_busy = await page.eval(f"JSON.stringify({PAGE}.assistant.state)")
    assert await page.outcome(await page.send("two")) == {"code": "BUSY"}
    assert await page.eval(f"JSON.stringify({PAGE}.assistant.state)") == before_busy
    # Through the widget, BUSY shows its message.
    await page.eval(f"{PAGE}.type('three')")
    await page.wait(f"{PAGE}.alert() === {json.dumps(shown(TurnCode.BUSY))}")
    await page.shot("busy")
    hold.released.set()
    assert await page.outcome(first) == {"answer": "finally"}
    assert await page.eval(f"{PAGE}.assistant.state.messages.length") == 2


async def test_stop_while_a_tool_runs_aborts_its_signal(driver: BrowserDriver, model: ScriptedModel) -> None:
    page = await open_page(driver, model, tool_calls(("slow_note", {})))
    index = await page.send("slow")
    await page.wait(f"{PAGE}.assistant.state.activity?.kind === 'calling'")
    await page.shot("running-tool")
    await page.eval(f"{PAGE}.stop()")
    assert await page.outcome(index) == {"code": "ABORTED"}
    assert await page.eval(f"{PAGE}.aborts") == ["ABORTED"]
    assert await page.eval(f"{PAGE}.error()") == "ABORTED"
    assert await page.eval(f"{PAGE}.alert()") == shown(TurnCode.ABORTED)
    # The call the model asked for is answered, so the next turn's conversation is valid.
    assert [r["code"] for r in await page.tool_results()] == ["ABORTED"]


async def test_stale_tools_when_the_list_changes_during_the_confirmation(
    driver: BrowserDriver, model: ScriptedModel
) -> None:
    page = await open_page(driver, model, tool_calls(("clear_notes", {})), answer("The tools changed."))
    await page.eval(f"{PAGE}.notes.push('keep')")
    index = await page.send("clear")
    await page.wait(f"{PAGE}.dialogOpen()")
    await page.eval(f"{PAGE}.touch()")
    assert await page.outcome(index) == {"answer": "The tools changed."}
    assert not await page.eval(f"{PAGE}.dialogOpen()")
    assert [r["code"] for r in await page.tool_results()] == ["STALE_TOOLS"]
    assert await page.eval(f"{PAGE}.notes") == ["keep"]
    assert shown(TurnCode.STALE_TOOLS) in await page.eval(f"{PAGE}.log()")


async def test_stale_tools_when_the_list_changes_after_planning(
    driver: BrowserDriver, model: ScriptedModel
) -> None:
    holder: dict[str, Page] = {}

    async def touch() -> None:
        await holder["page"].eval(f"{PAGE}.touch()")

    page = await open_page(
        driver, model, before(touch, tool_calls(("add_note", {"text": "x"}))), answer("Changed.")
    )
    holder["page"] = page
    assert await page.outcome(await page.send("add x")) == {"answer": "Changed."}
    assert [r["code"] for r in await page.tool_results()] == ["STALE_TOOLS"]
    assert await page.eval(f"{PAGE}.notes") == []


async def test_the_turn_table_is_the_python_one() -> None:
    generated = (TYPESCRIPT / "assistant" / "src" / "gen" / "turns.ts").read_text()
    for code, spec in TURN_TABLE.items():
        assert f"  {code.value}: {{" in generated and json.dumps(spec.message) in generated


async def test_the_conversation_keeps_its_latest_whole_turns(
    driver: BrowserDriver, model: ScriptedModel
) -> None:
    page = await open_page(driver, model, *(answer(f"a{n}") for n in range(1, 5)), maxMessages="5")
    for n in range(1, 5):
        assert await page.outcome(await page.send(f"u{n}")) == {"answer": f"a{n}"}
    # Before u4: u1 and a1 went, whole, so that u4 fitted beside what was left.
    kept = ["u2", "a2", "u3", "a3", "u4", "a4"]
    assert await page.eval(f"{PAGE}.assistant.state.messages.map(m => m.text)") == kept
    assert [m["content"] for m in model.requests[3]["messages"] if m["role"] != "system"] == kept[:-1]
    # The widget dropped the same items and drew only the new ones.
    assert await page.eval(f"{PAGE}.items()") == kept
