"""What every tool-call format shares: the call types, the parser contract, and the
streaming machinery that makes `feed`/`finish` agree with `parse` by construction.

A format is a `Scanner`: it reads output text from a settled point and returns the pieces it
can already decide (content text, accepted calls; rejected calls produce no piece) and how
many characters those pieces used. Whatever it cannot decide yet (a partial marker, a call
whose JSON has not closed) stays unread, and the streaming parser offers it again with more
text. `parse` is the same scanner run once over the whole output with `final=True`, so a
stream split anywhere produces the same content and the same calls as `parse`.

Content is stripped at both ends (SGLang strips the text before a call:
`normal_text = text[:idx].strip()`, python/sglang/srt/function_call/hermes_detector.py). A
stream therefore never sends leading whitespace, and holds trailing whitespace until text
follows it; whitespace still held at `finish` is dropped.
"""

from __future__ import annotations

import enum
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "MarkerScanner",
    "ParsedCall",
    "Rejected",
    "ScannedParser",
    "Scanner",
    "Settled",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolSpec",
    "decode_container",
    "held_suffix",
    "pick",
    "skip_blanks",
]

T = TypeVar("T")

#: What a scanner settles: the pieces (content text, accepted calls) and how many
#: characters they used.
Settled = tuple[list["str | ParsedCall"], int]

LOGGER = logging.getLogger("tributary.app.tool_parsers")

#: Whitespace that JSON allows between tokens.
JSON_BLANKS = " \t\r\n"


@dataclass(frozen=True)
class ToolSpec:
    """One entry of the request's `tools` (type `function`)."""

    name: str
    parameters: dict[str, Any] | None = None


@dataclass(frozen=True)
class ParsedCall:
    """A call the model made: `arguments` is a JSON object's text as
    `json.dumps(obj, ensure_ascii=False)` writes it (SGLang's `parse_base_json`)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call `index` (counting accepted calls from 0). The first delta
    of a call carries its `name`; later ones have `name=None`. Joining every `arguments` of
    one index gives the call's complete arguments text, equal to `parse`'s.

    The parsers here send each call as a single delta (name and complete arguments) as soon
    as its text has closed: a call is never half-sent and then found malformed, cut off by
    `max_tokens`, or naming a tool the request did not offer. A consumer should still join
    fragments by `index`, as OpenAI's clients do."""

    index: int
    name: str | None
    arguments: str


class ToolCallParser(ABC):
    """Turns one output's text into content and tool calls, whole or streamed.

    One parser serves one output: `parse` may be called on any parser (it keeps no state),
    while `feed`... `finish` is the life of one stream.
    """

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The whole output: (content, or None when only whitespace remains; calls)."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The next piece of a stream: content safe to send now, and call deltas. Text that
        may still become part of a call is held back."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the stream: held text that never became a call is sent as content,
        and calls still pending are completed (or given up as content)."""


class Scanner(ABC):
    """A format's reader. One scanner reads one output; it may keep state between calls
    (whether calls have started, say), since it is only ever offered the unread rest."""

    @abstractmethod
    def scan(self, text: str, *, final: bool) -> Settled:
        """Settle what can be settled at the start of `text`: returns the pieces and the
        number of characters they used. With `final=True` every character must be used."""


class Rejected(enum.Enum):
    """Why a decoded call is not a call."""

    DROPPED = "dropped"  # it names a tool the request did not offer: it vanishes
    MALFORMED = "malformed"  # it is not a call at all: its text stays content


class MarkerScanner(Scanner):
    """Content, with a block of calls wherever `block_start` finds one (by default, at each
    `marker`); subclasses read the blocks. After a block that sets `content_only`, the rest
    of the output is content."""

    #: What opens a block; a stream holds back text that may be its start.
    marker: str

    def __init__(self, checker: CallChecker) -> None:
        self.checker = checker
        self.content_only = False

    def block_start(self, text: str, pos: int, *, final: bool) -> int:
        """Where the next block starts at or after `pos`, or -1 when none does."""
        return text.find(self.marker, pos)

    @abstractmethod
    def block(self, text: str, start: int, *, final: bool) -> Settled | None:
        """The pieces of the block at `start` and where it ends, or None to wait for more
        text."""

    def calls_in(self, text: str, start: int, value: object, end: int) -> Settled:
        """The block `text[start:end]` that decoded to `value`: its accepted calls, or the
        block itself as content when it holds something that is not a call."""
        calls = self.checker.check_calls(value)
        return ([text[start:end]] if calls is None else list(calls)), end

    def scan(self, text: str, *, final: bool) -> Settled:
        pieces: list[str | ParsedCall] = []
        pos = 0
        while not self.content_only:
            start = self.block_start(text, pos, final=final)
            if start == -1:
                stop = len(text) - (0 if final else held_suffix(text[pos:], self.marker))
                if stop > pos:
                    pieces.append(text[pos:stop])
                return pieces, max(pos, stop)
            if start > pos:
                pieces.append(text[pos:start])
            block = self.block(text, start, final=final)
            if block is None:
                return pieces, start
            found, pos = block
            pieces.extend(found)
        if pos < len(text):
            pieces.append(text[pos:])
        return pieces, len(text)


def pick(table: Mapping[str, T], name: str, what: str) -> T:
    """`table[name]`, or a `ValueError` that names the known choices."""
    try:
        return table[name]
    except KeyError:
        known = ", ".join(table)
        raise ValueError(f"unknown {what} {name!r}; known parsers: {known}") from None


class CallChecker:
    """Checks a decoded call against the request's tools.

    A call naming a tool that is not in `tools` is dropped with a warning, as SGLang's
    `parse_base_json` does ("Model attempted to call undefined function",
    python/sglang/srt/function_call/base_format_detector.py). A call that is not an object
    with a string `name` is malformed: its text stays content (vLLM's tool parsers return
    the model output as content when extraction fails).
    """

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        self.names = frozenset(tool.name for tool in tools)

    def check(self, name: object, arguments: object) -> ParsedCall | Rejected:
        """The call, or why it is not one."""
        if not isinstance(name, str) or not name:
            return Rejected.MALFORMED
        if isinstance(arguments, str):
            # Some models write the arguments as a JSON string; SGLang's serving layer
            # passes a string through, so decode it when it holds an object.
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return Rejected.MALFORMED
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return Rejected.MALFORMED
        if name not in self.names:
            LOGGER.warning("model called undefined function %r; dropping the call", name)
            return Rejected.DROPPED
        try:
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            return Rejected.MALFORMED
        return ParsedCall(name=name, arguments=text)

    def check_json(self, obj: object) -> ParsedCall | Rejected:
        """A decoded `{"name": ..., "arguments"|"parameters": {...}}` object."""
        if not isinstance(obj, dict):
            return Rejected.MALFORMED
        # SGLang: `act.get("parameters") or act.get("arguments", {})`.
        arguments = obj.get("parameters") or obj.get("arguments", {})
        return self.check(obj.get("name"), arguments)

    def check_calls(self, value: object) -> list[ParsedCall] | None:
        """The accepted calls in a decoded call object or list of them, or None when one
        of them is malformed (then the whole value stays content)."""
        calls: list[ParsedCall] = []
        for item in value if isinstance(value, list) else [value]:
            outcome = self.check_json(item)
            if outcome is Rejected.MALFORMED:
                return None
            if isinstance(outcome, ParsedCall):
                calls.append(outcome)
        return calls


_DECODER = json.JSONDecoder()


def decode_container(text: str, pos: int) -> tuple[object, int] | None:
    """The JSON object or array starting at `pos` and where it ends, or None when none
    decodes there (yet). Only containers: they close themselves, so one that decodes from
    a prefix of the output decodes the same from the whole (a bare number would not)."""
    if pos >= len(text) or text[pos] not in "[{":
        return None
    try:
        return _DECODER.raw_decode(text, pos)
    except (json.JSONDecodeError, RecursionError):
        return None


def skip_blanks(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in JSON_BLANKS:
        pos += 1
    return pos


def held_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class _ContentFlow:
    """Streams content stripped at both ends: nothing before the first non-blank
    character, and trailing whitespace held until text follows it."""

    def __init__(self) -> None:
        self._started = False
        self._pending = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._pending + text
        body = text.rstrip()
        self._pending = text[len(body) :]
        return body


class ScannedParser(ToolCallParser):
    """A `ToolCallParser` over a format's `Scanner`; subclasses say which scanner."""

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        self.checker = CallChecker(tools)
        self._scanner = self.new_scanner()
        self._unread = ""
        self._content = _ContentFlow()
        self._calls = 0

    @abstractmethod
    def new_scanner(self) -> Scanner:
        """A scanner positioned at the start of an output."""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        pieces, used = self.new_scanner().scan(text, final=True)
        assert used == len(text), "a final scan reads everything"
        content = "".join(p for p in pieces if isinstance(p, str)).strip()
        return content or None, [p for p in pieces if isinstance(p, ParsedCall)]

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        return self._advance(text, final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self._advance("", final=True)

    def _advance(self, text: str, *, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self._unread += text
        pieces, used = self._scanner.scan(self._unread, final=final)
        self._unread = self._unread[used:]
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        for piece in pieces:
            if isinstance(piece, str):
                content.append(self._content.push(piece))
            else:
                deltas.append(ToolCallDelta(self._calls, piece.name, piece.arguments))
                self._calls += 1
        return "".join(content), deltas
