"""Hermes and Qwen 2.5 calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Synopsis::

    parser = HermesParser([ToolSpec("get_weather")])
    parser.parse('Sure.\\n<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                 '\\n</tool_call>')
    # ('Sure.', [ParsedCall(name='get_weather', arguments='{"city": "Paris"}')])

What is accepted, as SGLang's `HermesDetector` does
(python/sglang/srt/function_call/hermes_detector.py): after each `<tool_call>` one JSON value
is decoded (string-aware, so a `</tool_call>` inside an argument string does not cut the call),
whitespace around it is allowed, and the closing `</tool_call>` is optional. The value may be
one call object or a list of them; `parameters` is accepted for `arguments`. `qwen25`
(`Qwen25Detector`) is the same format.

Where this differs from SGLang: SGLang drops text after the first call and, on malformed JSON,
the call and everything after it; here text around calls is content, and a malformed call
(bad JSON, or an object that is not `{"name": ...}`) stays content up to its `</tool_call>`
(or to the end of the output when it has none), as vLLM's Hermes parser keeps the output as
content when it cannot extract calls. A stray `</tool_call>` outside any call stays content
(SGLang's stream path removes it).
"""

from __future__ import annotations

from .base import (
    MarkerScanner,
    ScannedParser,
    Scanner,
    Settled,
    decode_container,
    skip_blanks,
)

__all__ = ["HermesParser", "marker_outside_strings"]

START = "<tool_call>"
END = "</tool_call>"


def marker_outside_strings(text: str, pos: int, marker: str) -> int:
    """Where `marker` first occurs in `text` from `pos` outside JSON string literals, or -1.

    A marker outside strings can never be inside a JSON value, so it proves that a value
    that has not decoded by then never will."""
    if marker not in text[pos:]:
        return -1
    in_string = escaped = False
    for i in range(pos, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif text.startswith(marker, i):
            return i
    return -1


class _HermesScanner(MarkerScanner):
    marker = START

    def block(self, text: str, start: int, *, final: bool) -> Settled | None:
        """The pieces of the block opening at `start` and where it ends, or None to wait."""
        body = skip_blanks(text, start + len(START))
        if body == len(text) and not final:
            return None
        decoded = decode_container(text, body)
        if decoded is None:
            close = marker_outside_strings(text, body, END)
            if close != -1:
                stop = close + len(END)
                return [text[start:stop]], stop
            return ([text[start:]], len(text)) if final else None
        value, end = decoded
        after = skip_blanks(text, end)
        if text.startswith(END, after):
            end = after + len(END)
        elif not final and END.startswith(text[after:]):
            return None
        return self.calls_in(text, start, value, end)


class HermesParser(ScannedParser):
    """`hermes`, `qwen25` and `qwen`: calls inside `<tool_call>` ... `</tool_call>`."""

    def new_scanner(self) -> Scanner:
        return _HermesScanner(self.checker)
