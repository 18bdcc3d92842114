"""Llama 3.x JSON calls: an optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}`
objects separated by `;`.

Synopsis::

    parser = Llama3Parser([ToolSpec("get_weather")])
    parser.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    # (None, [ParsedCall(name='get_weather', arguments='{"city": "Paris"}')])

What is accepted, as SGLang's `Llama32Detector` does
(python/sglang/srt/function_call/llama32_detector.py): calls start at `<|python_tag|>` (text
before it is content) or when the output itself starts with `{` (leading whitespace allowed
here); each call is one JSON object, `parameters` or `arguments`; calls are separated by `;`
(SGLang's `tool_call_separator`), and text after the last call is content.

Where this differs from SGLang: SGLang skips a malformed object and looks for the next
`{"name":`; here a malformed call (bad JSON, or an object without a string `name`) and all
text after it stay content, with the `<|python_tag|>` that opened it, as vLLM's Llama 3 JSON
parser returns the output as content when it cannot extract calls. SGLang's JSON-array form
(used for its constrained output) is not read here.
"""

from __future__ import annotations

from .base import (
    CallChecker,
    MarkerScanner,
    ParsedCall,
    Rejected,
    ScannedParser,
    Scanner,
    Settled,
    decode_container,
    skip_blanks,
)

__all__ = ["Llama3Parser"]

TAG = "<|python_tag|>"
SEPARATOR = ";"


class _Llama3Scanner(MarkerScanner):
    marker = TAG

    def __init__(self, checker: CallChecker) -> None:
        super().__init__(checker)
        # Nothing but whitespace read yet: a `{` here opens calls without a tag.
        self._at_start = True
        # Inside a run of calls: the next block is a call (after a tag, or after `;`).
        self._in_calls = False

    def block_start(self, text: str, pos: int, *, final: bool) -> int:
        if self._at_start:
            first = skip_blanks(text, pos)
            if first < len(text) or final:
                self._at_start = False
                self._in_calls = text.startswith("{", first)
            if self._in_calls:
                return first
        return pos if self._in_calls else text.find(TAG, pos)

    def block(self, text: str, start: int, *, final: bool) -> Settled | None:
        """The call at `start` (at a tag, or where a call is due). Leaves `_in_calls` saying
        whether another call follows."""
        body = skip_blanks(text, start + len(TAG) if text.startswith(TAG, start) else start)
        decoded = decode_container(text, body) if text.startswith("{", body) else None
        if decoded is None:
            if not final and (body == len(text) or text[body] == "{"):
                return None
            self.content_only = True
            return [], start
        value, end = decoded
        outcome = self.checker.check_json(value)
        if outcome is Rejected.MALFORMED:
            self.content_only = True
            return [], start
        after = skip_blanks(text, end)
        if after == len(text) and not final:
            return None
        self._in_calls = text.startswith(SEPARATOR, after)
        if self._in_calls:
            end = after + len(SEPARATOR)
        return ([outcome] if isinstance(outcome, ParsedCall) else []), end


class Llama3Parser(ScannedParser):
    """`llama3`: JSON calls after `<|python_tag|>` or at the start of the output."""

    def new_scanner(self) -> Scanner:
        return _Llama3Scanner(self.checker)
