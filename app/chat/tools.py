"""Tool calling and reasoning output, apart from any API's wire shape.

Synopsis::

    tools = [ToolDefinition("get_weather", "Weather in a city", {"type": "object", ...})]
    check_tools(tools, param="tools")                      # 400 for a duplicate name
    choice = check_tool_choice(NamedTool("get_weather"), tools, param="tool_choice")
    calling = ToolCalling(tools, choice, parallel=True, parser=served_parser)
    calling.template_tools()     # the template's `tools=` (None: render none)
    calling.constraint()         # forced calls: the json_schema (a string) the output follows

    setup = OutputSetup(calling, reasoning=ReasoningSetup("qwen3", thinking=True))
    out = setup.split(text)                    # unary: out.content, out.reasoning, out.calls
    stream = setup.stream()                    # one per choice, fed in delivery order
    delta = stream.feed(item_text)             # delta.content, delta.reasoning, delta.calls
    delta = stream.finish()                    # what was held back, at the choice's end
    stream.called                              # a call was produced (finish_reason rule)

`tool_choice` (OpenAI's names; Anthropic's `any` is `required`, its `tool` a `NamedTool`):

- `none`: no tools are rendered and the output is content.
- `auto`: the tools are rendered into the template; with a `--tool-call-parser` the output goes
  through it (unary and streams, holding back text that may still be a call's marker), without
  one it is content (SGLang's rule).
- `required` and a named tool: the output is constrained by llguidance to SGLang's forced-call
  schema (`forced_call_schema`: a JSON array of `{"name", "parameters"}`, each tool's own
  parameter schema, one item when calls may not be parallel), so it always parses into calls
  (`ForcedCalls`), with or without a parser. A named tool renders only that tool.

Every tool's parameters must be a valid JSON Schema, whatever the choice (`check_tools`;
app/chat/tool_schema.py does the schema work).

A call's `arguments` is the JSON text of its parameters exactly as the model wrote it, so the
fragments a stream sends join into the unary answer's string.

Reasoning (`--reasoning-parser`): the output's thinking is split off before tool calls are
looked for, as SGLang does. A forced call's grammar holds from the first token, so forced
calls are never read for reasoning.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any, Literal

from ..http.errors import InvalidRequest
from .reasoning import ReasoningParser, make_reasoning_parser
from .tool_parsers import (
    ParsedCall,
    ToolCallDelta,
    ToolCallParser,
    ToolSpec,
    make_tool_parser,
)
from .tool_schema import call_array_schema, check_parameters

__all__ = [
    "ChatOutput",
    "ForcedCalls",
    "NamedTool",
    "OutputDelta",
    "OutputSetup",
    "OutputStream",
    "ReasoningSetup",
    "ToolCalling",
    "ToolChoice",
    "ToolDefinition",
    "check_tool_choice",
    "check_tools",
    "forced_call_schema",
]


@dataclasses.dataclass(frozen=True, slots=True)
class ToolDefinition:
    """One function the model may call: its name, description and JSON Schema parameters."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def template_entry(self) -> dict[str, Any]:
        """The tool as chat templates read it (Hugging Face's `tools=`: OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True, slots=True)
class NamedTool:
    """A tool choice that forces one named tool."""

    name: str


ToolChoice = Literal["none", "auto", "required"] | NamedTool


def check_tools(tools: Sequence[ToolDefinition], *, param: str) -> None:
    """A 400 for two tools of one name (a call could not say which it meant), or for
    parameters that are no valid JSON Schema (`check_parameters`), whatever the tool choice."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if not tool.name:
            raise InvalidRequest(f"{param}[{i}]: a tool's name cannot be empty.", param=param)
        if tool.name in seen:
            raise InvalidRequest(
                f"{param}[{i}]: the tool name {tool.name!r} is already declared by "
                f"{param}[{seen[tool.name]}].",
                param=param,
            )
        seen[tool.name] = i
        check_parameters(i, tool, param=param)


def check_tool_choice(
    choice: ToolChoice, tools: Sequence[ToolDefinition], *, param: str
) -> ToolChoice:
    """`choice` if the tools allow it; SGLang's 400s (and words) if not."""
    if choice == "required" and not tools:
        raise InvalidRequest(
            "Tools cannot be empty if tool choice is set to required.", param=param
        )
    if isinstance(choice, NamedTool):
        if not tools:
            raise InvalidRequest(
                "Tools cannot be empty if tool choice is set to a specific tool.", param=param
            )
        if all(tool.name != choice.name for tool in tools):
            raise InvalidRequest(f"Tool '{choice.name}' not found in tools list.", param=param)
    return choice


def forced_call_schema(
    tools: Sequence[ToolDefinition], choice: ToolChoice, *, parallel: bool
) -> dict[str, Any] | None:
    """SGLang's schema for forced calls (`get_json_schema_constraint`, built by
    app/chat/tool_schema.py): an array of `{"name", "parameters"}` items, of all the tools for
    `required`, of the named one for a named tool. None for `auto` and `none`. Beyond
    SGLang's: an item allows no other keys (`additionalProperties: false`; a small model
    otherwise writes on in a key of its own until its budget ends), a named tool's item says
    `"type": "object"`, and the tools' local `$ref`s are rewritten to where their parameters
    sit, so each resolves as it did in the tool's own schema."""
    if isinstance(choice, NamedTool):
        chosen = [tool for tool in tools if tool.name == choice.name][:1]
        return call_array_schema(chosen, named=True, parallel=parallel)
    if choice == "required":
        return call_array_schema(tools, named=False, parallel=parallel)
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCalling:
    """What one request asked of tools, with the server's `--tool-call-parser`."""

    tools: tuple[ToolDefinition, ...]
    choice: ToolChoice
    parallel: bool = True
    parser: str | None = None

    @property
    def forced(self) -> bool:
        return self.choice == "required" or isinstance(self.choice, NamedTool)

    @property
    def parses(self) -> bool:
        """Whether the output is read for calls (forced, or `auto` with a parser)."""
        return bool(self.tools) and (
            self.forced or (self.choice == "auto" and self.parser is not None)
        )

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The template's `tools=`: none for `none`, only the named tool for a named choice."""
        if not self.tools or self.choice == "none":
            return None
        choice = self.choice
        if isinstance(choice, NamedTool):
            return [t.template_entry() for t in self.tools if t.name == choice.name]
        return [t.template_entry() for t in self.tools]

    def constraint(self) -> str | None:
        """The forced-call schema as the engine's `json_schema` (a string), or None; a 400 for
        a `$ref` to another document. The tools have passed `check_tools` (so no parameters
        nest deeper than `json.dumps` recurses)."""
        schema = forced_call_schema(self.tools, self.choice, parallel=self.parallel)
        return None if schema is None else json.dumps(schema)

    def new_parser(self) -> ToolCallParser | None:
        if not self.parses:
            return None
        if self.forced:
            return ForcedCalls()
        assert self.parser is not None
        return make_tool_parser(self.parser, [ToolSpec(t.name, t.parameters) for t in self.tools])


_SPACE = " \t\r\n"


class ForcedCalls(ToolCallParser):
    """Reads the forced-call array (`forced_call_schema`) as it arrives: a call's first delta
    carries its name (arguments ""), later ones fragments of its `parameters` JSON text. The
    grammar makes the text well formed; a choice cut short (`length`) leaves its last call
    incomplete, and `parse` then gives the text back as content, as SGLang does."""

    def __init__(self) -> None:
        self._depth = 0  # 0: before the array, 1: in it, 2: in an item
        self._index = -1
        self._key: str | None = None
        self._text = ""  # the key or value being read at the item's level
        self._reading: Literal["", "key", "value"] = ""
        self._value_depth = 0
        self._in_string = False
        self._escaped = False
        self._name: str | None = None
        self._pending = ""  # parameters read before the name
        self._complete = False

    @property
    def complete(self) -> bool:
        """The array closed: its calls are whole. A stop string or stop token may cut it
        short, and the calls streamed so far are then not calls (`OutputStream.called`)."""
        return self._complete

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        reader = ForcedCalls()  # parse keeps no state (ToolCallParser's contract)
        deltas = reader.feed(text)[1] + reader.finish()[1]
        if not reader.complete or not deltas:
            return text, []
        calls: list[ParsedCall] = []
        for delta in deltas:
            if delta.name is not None:
                calls.append(ParsedCall(delta.name, ""))
            calls[delta.index] = ParsedCall(
                calls[delta.index].name, calls[delta.index].arguments + delta.arguments
            )
        return None, calls

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        out: list[ToolCallDelta] = []
        fragment: list[str] = []
        for ch in text:
            if self._reading == "value":
                taken = self._value_char(ch)
                if taken is None:
                    continue
                if taken:
                    if self._key == "parameters" and self._name is not None:
                        fragment.append(ch)
                    continue
                self._end_value(out, fragment)
                fragment = []
            if self._reading == "key":
                self._string_char(ch)
                if not self._in_string:
                    self._key = _string(self._text)
                    self._reading = ""
            elif ch in _SPACE:
                pass
            elif self._depth == 0 and ch == "[":
                self._depth = 1
            elif self._depth == 1 and ch == "{":
                self._depth, self._index, self._name, self._pending = 2, self._index + 1, None, ""
            elif self._depth == 1 and ch == "]":
                self._depth, self._complete = 3, True
            elif self._depth == 2 and ch == '"':
                self._reading, self._text, self._in_string = "key", ch, True
            elif self._depth == 2 and ch == ":":
                self._reading, self._text, self._value_depth = "value", "", 0
            elif self._depth == 2 and ch == "}":
                self._depth = 1
        if fragment:
            out.append(ToolCallDelta(self._index, None, "".join(fragment)))
        return "", out

    def _string_char(self, ch: str) -> None:
        self._text += ch
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False

    def _value_char(self, ch: str) -> bool | None:
        """Take `ch` into the value being read: True if taken, None if skipped (space before
        the value), False if the value had ended before it."""
        if not self._text:
            if ch in _SPACE:
                return None
            self._text = ch
            self._in_string = ch == '"'
            self._value_depth = 1 if ch in "{[" else 0
            return True
        if self._in_string:
            self._string_char(ch)
            return True
        if self._value_depth == 0:
            if self._text[0] in '{["' or ch in _SPACE or ch in ",}]":
                return False  # a complete container or string, or a number's end
            self._text += ch
            return True
        self._text += ch
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._value_depth += 1
        elif ch in "}]":
            self._value_depth -= 1
        return True

    def _end_value(self, out: list[ToolCallDelta], fragment: list[str]) -> None:
        self._reading = ""
        if fragment:
            out.append(ToolCallDelta(self._index, None, "".join(fragment)))
        if self._key == "name":
            self._name = _string(self._text)
            out.append(ToolCallDelta(self._index, self._name, ""))
            if self._pending:
                out.append(ToolCallDelta(self._index, None, self._pending))
        elif self._key == "parameters" and self._name is None:
            self._pending = self._text


def _string(text: str) -> str:
    """A JSON string's value; the text itself if it is none (the grammar rules that out, and
    a stream's reader runs at delivery, where it must not raise)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, str) else text


@dataclasses.dataclass(frozen=True, slots=True)
class ReasoningSetup:
    """The server's `--reasoning-parser`, and whether this request thinks (the template was
    asked to open a thinking block: `enable_thinking` / `thinking` not false)."""

    parser: str
    thinking: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class ChatOutput:
    content: str | None
    reasoning: str | None
    calls: list[ParsedCall]


@dataclasses.dataclass(slots=True)
class OutputDelta:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class OutputSetup:
    """How one request's output is read: for calls (`tools`), for reasoning, or both. A request
    with neither never builds one (the plain path stays as it was)."""

    tools: ToolCalling | None = None
    reasoning: ReasoningSetup | None = None

    @property
    def active(self) -> bool:
        return (self.tools is not None and self.tools.parses) or self._reads_reasoning

    @property
    def _reads_reasoning(self) -> bool:
        return self.reasoning is not None and not (self.tools is not None and self.tools.forced)

    def split(self, text: str) -> ChatOutput:
        """A whole output: reasoning split off first, then calls from what is left."""
        reasoning: str | None = None
        content: str | None = text
        if self._reads_reasoning:
            assert self.reasoning is not None
            reader = make_reasoning_parser(self.reasoning.parser, thinking=self.reasoning.thinking)
            reasoning, content = reader.parse(text)
        calls: list[ParsedCall] = []
        parser = self.tools.new_parser() if self.tools is not None else None
        if parser is not None and content:
            content, calls = parser.parse(content)
        if self.tools is not None and not self.tools.parallel:
            calls = calls[:1]  # `auto` output may hold more; OpenAI's rule is one at most
        return ChatOutput(content=content or None, reasoning=reasoning, calls=calls)

    def stream(self) -> OutputStream:
        reader = None
        if self._reads_reasoning:
            assert self.reasoning is not None
            reader = make_reasoning_parser(self.reasoning.parser, thinking=self.reasoning.thinking)
        parser = self.tools.new_parser() if self.tools is not None else None
        return OutputStream(
            reader, parser, single=self.tools is not None and not self.tools.parallel
        )


class OutputStream:
    """One choice's output as it arrives: `feed` each item's text, `finish` at its end."""

    def __init__(
        self, reasoning: ReasoningParser | None, calls: ToolCallParser | None, *, single: bool
    ) -> None:
        self._reasoning = reasoning
        self._calls = calls
        self._single = single  # `parallel_tool_calls` false: the first call only
        self._named = False  # a call's first delta was sent

    @property
    def called(self) -> bool:
        """The output made calls (`finish_reason` `tool_calls`): a call was sent and, for
        forced calls, their array closed, as `split` reads the same text (a forced array cut
        by a stop string is content there, and its streamed call no call)."""
        if isinstance(self._calls, ForcedCalls):
            return self._named and self._calls.complete
        return self._named

    def feed(self, text: str) -> OutputDelta:
        delta = OutputDelta()
        if self._reasoning is not None:
            delta.reasoning, text = self._reasoning.feed(text)
        return self._read_calls(delta, text, finish=False)

    def finish(self) -> OutputDelta:
        delta = OutputDelta()
        text = ""
        if self._reasoning is not None:
            delta.reasoning, text = self._reasoning.finish()
        return self._read_calls(delta, text, finish=True)

    def _read_calls(self, delta: OutputDelta, text: str, *, finish: bool) -> OutputDelta:
        if self._calls is None:
            delta.content = text
            return delta
        content, calls = self._calls.feed(text) if text else ("", [])
        if finish:
            rest, more = self._calls.finish()
            content, calls = content + rest, calls + more
        delta.content = content
        delta.calls = [c for c in calls if c.index == 0] if self._single else calls
        self._named = self._named or any(c.name is not None for c in delta.calls)
        return delta
