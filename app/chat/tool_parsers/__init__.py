"""Tool calls in model output, per format, with no HTTP and no engine: `parse` a whole
output, or `feed` a stream and `finish` it.

Synopsis::

    parser = make_tool_parser("hermes", [ToolSpec("get_weather", {"type": "object"})])
    content, calls = parser.parse(text)                  # non-streaming
    for piece in pieces:                                 # streaming
        content_delta, call_deltas = parser.feed(piece)
    content_delta, call_deltas = parser.finish()

The names are SGLang's `--tool-call-parser` names
(python/sglang/srt/function_call/function_call_parser.py). A streamed call arrives as one
`ToolCallDelta` per call once its text has closed, carrying the name and the complete
arguments; content that might still turn out to be a call marker is held back meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .base import ParsedCall as ParsedCall
from .base import ToolCallDelta as ToolCallDelta
from .base import ToolCallParser as ToolCallParser
from .base import ToolSpec as ToolSpec
from .base import pick
from .hermes import HermesParser
from .llama3 import Llama3Parser
from .mistral import MistralParser
from .pythonic import PythonicParser

__all__ = [
    "TOOL_PARSER_NAMES",
    "ParsedCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolSpec",
    "make_tool_parser",
]

_PARSERS: dict[str, Callable[[Sequence[ToolSpec]], ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "qwen": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}

#: The accepted `--tool-call-parser` names.
TOOL_PARSER_NAMES: tuple[str, ...] = tuple(_PARSERS)


def make_tool_parser(name: str, tools: Sequence[ToolSpec]) -> ToolCallParser:
    """A fresh parser for one output in format `name`, accepting calls to `tools`.

    Raises `ValueError` naming the known formats when `name` is not one of them."""
    return pick(_PARSERS, name, "tool call parser")(tools)
