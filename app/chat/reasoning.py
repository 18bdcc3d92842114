"""Thinking in model output, separated from the answer: `reasoning_content` and `content`.

Synopsis::

    parser = make_reasoning_parser("qwen3")
    parser.parse("<think>\\nThe user greets.\\n</think>\\n\\nHello!")
    # ('\\nThe user greets.\\n', 'Hello!')
    for piece in pieces:                                  # streaming
        reasoning_delta, content_delta = parser.feed(piece)
    reasoning_delta, content_delta = parser.finish()

The names and their markers are SGLang's `--reasoning-parser` ones, and the behaviour is
that of its `BaseReasoningFormatDetector`
(python/sglang/srt/parser/reasoning_parser.py):

- `deepseek-r1` (and `step3`, `qwen3-thinking`, `minimax`) is *forced*: the chat template has
  already opened `<think>`, so the output starts inside reasoning; a `<think>` the model writes
  anyway at the start is dropped (`while processed_text.startswith(think_start_text)`).
- `qwen3` (and `interns1`, `kimi` with `◁think▷`) reasons only from the start marker on;
  without it the whole output is content.
- Reasoning ends at the end marker. When it never comes, everything after the start is
  reasoning ("Assume reasoning was truncated before end token").
- `qwen3`'s family also ends reasoning at `<tool_call>` (SGLang's `tool_start_token`: "Qwen3.5
  sometimes opens `<tool_call>` without closing `</think>`"); the marker stays in the content,
  for the tool-call parser.
- Whitespace right after the end marker is dropped (SGLang: `normal_text = splits[1].strip()`).

Where this differs from SGLang, so that a stream always agrees with `parse`: text before a
non-forced `<think>` is content (SGLang's stream path does this; its one-shot path counts it
as reasoning); trailing whitespace of the content is kept (SGLang's one-shot path strips it,
its stream path does not). `thinking=False` (the request set `enable_thinking` false) makes
every parser unforced: SGLang then skips reasoning parsing, which gives the same result for
output without markers, while a model that writes `<think>` anyway still has it separated.

A stream holds back text that may be the start of a marker, so no partial `<think>` or
`</think>` ever reaches either delta. Empty reasoning is reported as None by `parse`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .tool_parsers.base import held_suffix, pick

__all__ = ["REASONING_PARSER_NAMES", "ReasoningParser", "make_reasoning_parser"]


@dataclass(frozen=True)
class _Format:
    start: str
    end: str
    #: The template opened the reasoning: the output starts inside it.
    forced: bool
    #: A marker that also ends reasoning and opens the content (kept in the content).
    tool_start: str | None = None


_THINK = _Format("<think>", "</think>", forced=True)
_QWEN3 = _Format("<think>", "</think>", forced=False, tool_start="<tool_call>")

_FORMATS: dict[str, _Format] = {
    "deepseek-r1": _THINK,
    "step3": _THINK,
    "qwen3": _QWEN3,
    "qwen3-thinking": _Format("<think>", "</think>", forced=True, tool_start="<tool_call>"),
    "minimax": _Format("<think>", "</think>", forced=True, tool_start="<tool_call>"),
    "interns1": _QWEN3,
    "kimi": _Format("◁think▷", "◁/think▷", forced=False),
}

#: The accepted `--reasoning-parser` names.
REASONING_PARSER_NAMES: tuple[str, ...] = tuple(_FORMATS)


class _State(enum.Enum):
    BEFORE = "before"  # not reasoning yet; the start marker would open it
    OPENING = "opening"  # at the start of reasoning, where start markers are dropped
    REASONING = "reasoning"  # inside reasoning, until the end marker
    AFTER = "after"  # just past the end marker, dropping whitespace
    CONTENT = "content"  # the rest is content


class ReasoningParser:
    """Separates reasoning from content in one output, whole (`parse`) or streamed
    (`feed`... `finish`). One parser per output; `parse` keeps no state."""

    def __init__(self, fmt: _Format, *, forced: bool) -> None:
        self._format = fmt
        self._forced = forced
        self._state = _State.OPENING if forced else _State.BEFORE
        self._unread = ""

    def parse(self, text: str) -> tuple[str | None, str]:
        """The whole output: (reasoning, or None when there is none; content)."""
        whole = ReasoningParser(self._format, forced=self._forced)
        reasoning, content, _ = whole._scan(text, final=True)
        return reasoning or None, content

    def feed(self, text: str) -> tuple[str, str]:
        """The next piece of a stream: (reasoning delta, content delta)."""
        self._unread += text
        reasoning, content, used = self._scan(self._unread, final=False)
        self._unread = self._unread[used:]
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the stream: held text, as reasoning or content."""
        reasoning, content, _ = self._scan(self._unread, final=True)
        self._unread = ""
        return reasoning, content

    def _scan(self, text: str, *, final: bool) -> tuple[str, str, int]:
        """Settle what can be settled in `text`: (reasoning, content, characters used)."""
        fmt = self._format
        reasoning: list[str] = []
        content: list[str] = []
        pos = 0
        while True:
            state = self._state
            if state is _State.BEFORE:
                start = text.find(fmt.start, pos)
                if start == -1:
                    stop = len(text) - (0 if final else held_suffix(text[pos:], fmt.start))
                    content.append(text[pos:stop])
                    return "".join(reasoning), "".join(content), max(pos, stop)
                content.append(text[pos:start])
                pos = start + len(fmt.start)
                self._state = _State.OPENING
            elif state is _State.OPENING:
                if text.startswith(fmt.start, pos):
                    pos += len(fmt.start)
                    continue
                if not final and fmt.start.startswith(text[pos:]):
                    return "".join(reasoning), "".join(content), pos
                self._state = _State.REASONING
            elif state is _State.REASONING:
                end = text.find(fmt.end, pos)
                tool = text.find(fmt.tool_start, pos) if fmt.tool_start else -1
                if tool != -1 and (end == -1 or tool < end):
                    reasoning.append(text[pos:tool])
                    pos = tool
                    self._state = _State.CONTENT
                elif end != -1:
                    reasoning.append(text[pos:end])
                    pos = end + len(fmt.end)
                    self._state = _State.AFTER
                else:
                    rest = text[pos:]
                    hold = 0
                    if not final:
                        hold = max(
                            held_suffix(rest, fmt.end), held_suffix(rest, fmt.tool_start or "")
                        )
                    reasoning.append(rest[: len(rest) - hold])
                    return "".join(reasoning), "".join(content), len(text) - hold
            elif state is _State.AFTER:
                while pos < len(text) and text[pos].isspace():
                    pos += 1
                if pos == len(text):
                    return "".join(reasoning), "".join(content), pos
                self._state = _State.CONTENT
            else:
                content.append(text[pos:])
                return "".join(reasoning), "".join(content), len(text)


def make_reasoning_parser(name: str, *, thinking: bool = True) -> ReasoningParser:
    """A fresh parser for one output of a model whose reasoning format is `name`.

    `thinking=False` when the request turned thinking off (`chat_template_kwargs`
    `enable_thinking: false`): then no parser assumes the output starts inside reasoning.
    Raises `ValueError` naming the known parsers when `name` is not one of them."""
    fmt = pick(_FORMATS, name, "reasoning parser")
    return ReasoningParser(fmt, forced=fmt.forced and thinking)
