"""The terminal side of `toolmesh chat` (toolmesh.cli.chat): an assistant that uses a session's tools.

Tool calls, their results and the human messages of errors (with what lies
behind them) are shown as they happen; arguments and results as previews cut
to a few lines' length. While a turn waits, a terminal shows that it works.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys
import threading
from typing import TextIO

from toolmesh.assistant import (
    Assistant,
    AssistantError,
    AssistantState,
    Author,
    ConfirmationRequest,
    ModelEndpoint,
    ToolServices,
    TurnLimits,
)
from toolmesh.cli.output import EXIT_USAGE
from toolmesh.core import jsontext

PREVIEW_CHARS = 60
RESULT_PREVIEW_CHARS = 240
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
HELP = "Type a message. /clear forgets the conversation, /quit (or Ctrl-D) leaves, Ctrl-C stops a turn."


class Lines:
    """Lines typed on stdin, read by a daemon thread so that waiting for one can be cancelled."""

    def __init__(self, stream: TextIO) -> None:
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def read() -> None:
            while line := stream.readline():
                loop.call_soon_threadsafe(self._queue.put_nowait, line.rstrip("\r\n"))
            loop.call_soon_threadsafe(self._queue.put_nowait, None)

        threading.Thread(target=read, name="toolmesh-chat-stdin", daemon=True).start()

    def close(self) -> None:
        """End the input: the waiting and every later `read` return None."""
        self._queue.put_nowait(None)

    async def read(self, prompt: str, *, fresh: bool = False) -> str | None:
        """The next line, or None at the end of input. `fresh`: not one typed before the prompt."""
        while fresh and not self._queue.empty():
            if self._queue.get_nowait() is None:
                self._queue.put_nowait(None)
                break
        say(prompt, end="")
        line = await self._queue.get()
        if line is None:
            self._queue.put_nowait(None)  # stays at the end
        return line


class Working:
    """A spinner on the terminal's last line while a turn waits; erased before anything else is printed.

    Nothing at all when stdout is not a terminal.
    """

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._shown = False
        self._enabled = sys.stdout.isatty()

    def start(self) -> None:
        """Show the spinner until `stop()`."""
        if self._enabled and self._task is None:
            self._task = asyncio.create_task(self._spin())

    def stop(self) -> None:
        """Hide the spinner for good (until the next `start()`)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.erase()

    def erase(self) -> None:
        """Clear the spinner's line, if it is shown."""
        if self._shown:
            print("\r\x1b[K", end="", flush=True)
            self._shown = False

    async def _spin(self) -> None:
        for frame in itertools.cycle(SPINNER):
            print(f"\r{frame} working… (Ctrl-C stops)", end="", flush=True)
            self._shown = True
            await asyncio.sleep(0.15)


WORKING = Working()


def say(text: str, end: str = "\n") -> None:
    """Print to the terminal at once (flushed), over the spinner if it shows."""
    WORKING.erase()
    print(text, end=end, flush=True)


def preview(value: object, limit: int = PREVIEW_CHARS) -> str:
    """`value` as JSON, cut to `limit` characters: enough to recognise it, not to dump it."""
    text = value if isinstance(value, str) else jsontext.dumps(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def describe_error(error: AssistantError) -> str:
    """The error as a person reads it: the table's message and the code, then what lies behind it."""
    said = f"{error.human_message} ({error.code.value})"
    return f"{said}: {error.detail}" if error.detail else said


class Transcript:
    """Prints each new tool call and tool result of the state as it arrives."""

    def __init__(self) -> None:
        self._shown = 0

    def __call__(self, state: AssistantState) -> None:
        """Print what is new in `state` since the last call (a subscriber of the assistant)."""
        self._shown = min(self._shown, len(state.messages))
        for message in state.messages[self._shown :]:
            for call in message.tool_calls:
                try:
                    arguments = preview(jsontext.parse(call.arguments_json))
                except jsontext.NotPlainJson:
                    arguments = "(not JSON)"
                say(f"  → {call.name} {arguments}")
            if message.role is Author.TOOL and message.call is not None and message.result is not None:
                result = message.result
                if result.code is None:
                    shown = result.data if result.data is not None else result.text
                    say(f"  ← {message.call.name}: ok {preview(shown, RESULT_PREVIEW_CHARS)}")
                else:
                    cause = f" [{result.cause}]" if result.cause else ""
                    failed = AssistantError(result.code)
                    say(f"  ← {message.call.name}: {failed.human_message} ({result.code.value}){cause}")
        self._shown = len(state.messages)


async def run(args: argparse.Namespace) -> int:
    """Chat until /quit or the end of input; returns the exit code (2 for a bad model setting)."""
    try:
        endpoint = ModelEndpoint.from_env(args.model_url, args.model, args.model_api_key, args.model_timeout)
        limits = TurnLimits(max_rounds=args.max_rounds, system_prompt=args.system)
        services = ToolServices.from_env(
            args.registry,
            args.invocation,
            tls=args.tls,
            require_tls=args.require_tls,
            token=args.token,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    except (OSError, ValueError) as exc:
        print(f"toolmesh chat: {exc}", file=sys.stderr)
        return EXIT_USAGE
    lines = Lines(sys.stdin)

    async def confirm(request: ConfirmationRequest) -> bool:
        WORKING.stop()  # a question waits for the person, not for the turn
        answer = await lines.read(
            f"  ? {request.tool.name} {preview(request.arguments)} needs your confirmation. Run it? [y/N] ",
            fresh=True,
        )
        WORKING.start()
        return answer is not None and answer.strip().lower() in {"y", "yes"}

    assistant = Assistant.connect(
        args.session_id, model=endpoint, services=services, confirm=confirm, limits=limits
    )
    assistant.subscribe(Transcript())
    loop = asyncio.get_running_loop()

    def interrupt() -> None:
        # Ctrl-C stops the running turn; with none running, it leaves.
        if not assistant.cancel():
            lines.close()

    loop.add_signal_handler(signal.SIGINT, interrupt)
    say(f"toolmesh chat: session {args.session_id}, model {endpoint.model}. {HELP}")
    try:
        while (line := await lines.read("you> ")) is not None:
            text = line.strip()
            if text == "/quit":
                break
            if text == "/clear":
                assistant.clear()
                say("(conversation cleared)")
            elif text:
                WORKING.start()
                try:
                    reply = await assistant.send(text)
                except AssistantError as error:
                    WORKING.stop()
                    say(f"! {describe_error(error)}")
                else:
                    WORKING.stop()
                    say(f"assistant> {reply}")
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        await assistant.dispose()
    say("")
    return 0
