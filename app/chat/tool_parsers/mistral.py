"""Mistral calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.

Synopsis::

    parser = MistralParser([ToolSpec("get_weather")])
    parser.parse('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    # (None, [ParsedCall(name='get_weather', arguments='{"city": "Paris"}')])

What is accepted, as SGLang's `MistralDetector` does
(python/sglang/srt/function_call/mistral_detector.py): text before `[TOOL_CALLS]` is content;
after it, a JSON array of call objects (a single object is accepted too, as
`parse_base_json` does), whitespace allowed; `parameters` is accepted for `arguments`.

Where this differs from SGLang: text after the array is content here (SGLang drops it), and a
later `[TOOL_CALLS]` block is read too. Malformed input stays content, as vLLM's Mistral
parser does: an array that decodes but holds something other than call objects is content
itself, while a block that never decodes (or is not an array or object) makes the rest of
the output content. Mistral's newer `[TOOL_CALLS]name[ARGS]{...}` form (tokenizer v11) is
not read here.
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

__all__ = ["MistralParser"]

MARKER = "[TOOL_CALLS]"


class _MistralScanner(MarkerScanner):
    marker = MARKER

    def block(self, text: str, start: int, *, final: bool) -> Settled | None:
        body = skip_blanks(text, start + len(MARKER))
        decoded = decode_container(text, body)
        if decoded is None:
            if not final and (body == len(text) or text[body] in "[{"):
                return None
            self.content_only = True
            return [], start
        value, end = decoded
        return self.calls_in(text, start, value, end)


class MistralParser(ScannedParser):
    """`mistral`: a JSON array of calls after `[TOOL_CALLS]`."""

    def new_scanner(self) -> Scanner:
        return _MistralScanner(self.checker)
