"""Tool-call parsers on canned model outputs, whole and streamed.

Each format has outputs a model really writes (one call, several, text around them, none,
malformed, a tool the request did not offer, non-ASCII arguments). A stream of the same
output, split at every position, one character at a time, or in random pieces, must give
what `parse` gives, and the content sent so far must always be a start of the final content,
so no piece of a marker is ever shown to the user and then taken back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tributary.app.chat.tool_parsers import (
    TOOL_PARSER_NAMES,
    ParsedCall,
    ToolSpec,
    make_tool_parser,
)

TOOLS = [
    ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}),
    ToolSpec("search", {"type": "object", "properties": {"query": {"type": "string"}}}),
]


def call(name: str, **arguments: object) -> ParsedCall:
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


PARIS = call("get_weather", city="Paris")
QUERY = call("search", query="trio nurseries")
UNICODE = call("get_weather", city="Zürich", note='東京 😀 "quoted"\n')


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    content: str | None
    calls: tuple[ParsedCall, ...]


def _hermes_json(c: ParsedCall, key: str = "arguments") -> str:
    return f'{{"name": "{c.name}", "{key}": {c.arguments}}}'


HERMES = [
    Case(
        "single",
        f"<tool_call>\n{_hermes_json(PARIS)}\n</tool_call>",
        None,
        (PARIS,),
    ),
    Case(
        "text-before",
        f"Let me check.\n\n<tool_call>\n{_hermes_json(PARIS)}\n</tool_call>",
        "Let me check.",
        (PARIS,),
    ),
    Case(
        "several",
        f"<tool_call>\n{_hermes_json(PARIS)}\n</tool_call>\n"
        f"<tool_call>\n{_hermes_json(QUERY)}\n</tool_call>",
        None,
        (PARIS, QUERY),
    ),
    Case(
        "text-around",
        f"Checking.<tool_call>{_hermes_json(PARIS)}</tool_call>\nOne moment.",
        "Checking.\nOne moment.",
        (PARIS,),
    ),
    Case("no-call", "It is sunny in Paris today.", "It is sunny in Paris today.", ()),
    Case(
        "lookalike",
        "Wrap it in <tool_calls> or <tool_call me>.",
        "Wrap it in <tool_calls> or <tool_call me>.",
        (),
    ),
    Case(
        "compact-no-closing-tag",
        '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}',
        None,
        (PARIS,),
    ),
    Case(
        "parameters-key-and-list",
        f"<tool_call>[{_hermes_json(PARIS, 'parameters')}, {_hermes_json(QUERY)}]</tool_call>",
        None,
        (PARIS, QUERY),
    ),
    Case(
        "end-tag-inside-argument",
        '<tool_call>{"name": "search", "arguments": {"query": "a </tool_call> b"}}</tool_call>',
        None,
        (call("search", query="a </tool_call> b"),),
    ),
    Case(
        "malformed-json",
        'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
        'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
        (),
    ),
    Case(
        "malformed-then-good",
        f"<tool_call>not json</tool_call><tool_call>{_hermes_json(QUERY)}</tool_call>",
        "<tool_call>not json</tool_call>",
        (QUERY,),
    ),
    Case(
        "object-without-name",
        '<tool_call>{"answer": 42}</tool_call>',
        '<tool_call>{"answer": 42}</tool_call>',
        (),
    ),
    Case(
        "truncated",
        'On it. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
        'On it. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
        (),
    ),
    Case(
        "unknown-tool-dropped",
        '<tool_call>{"name": "launch_rockets", "arguments": {"count": 3}}</tool_call>'
        f"<tool_call>{_hermes_json(PARIS)}</tool_call>",
        None,
        (PARIS,),
    ),
    Case(
        "unicode",
        f"Voilà : <tool_call>{_hermes_json(UNICODE)}</tool_call>",
        "Voilà :",
        (UNICODE,),
    ),
    Case(
        "escaped-unicode-is-decoded",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich"}}</tool_call>',
        None,
        (call("get_weather", city="Zürich"),),
    ),
]

LLAMA3 = [
    Case(
        "python-tag",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        (PARIS,),
    ),
    Case(
        "bare-json-several",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "search", "parameters": {"query": "trio nurseries"}}',
        None,
        (PARIS, QUERY),
    ),
    Case(
        "text-before-tag",
        'Checking the weather.<|python_tag|>{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}',
        "Checking the weather.",
        (PARIS,),
    ),
    Case(
        "text-after",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}\nI will report back.',
        "I will report back.",
        (PARIS,),
    ),
    Case("no-call", "Paris is sunny {mostly}.", "Paris is sunny {mostly}.", ()),
    Case("object-without-name", '{"answer": 42}', '{"answer": 42}', ()),
    Case(
        "truncated",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa',
        (),
    ),
    Case(
        "code-after-tag",
        "Running it.<|python_tag|>print(1)",
        "Running it.<|python_tag|>print(1)",
        (),
    ),
    Case(
        "unknown-tool-dropped",
        '{"name": "launch_rockets", "parameters": {}}; '
        '{"name": "search", "parameters": {"query": "trio nurseries"}}',
        None,
        (QUERY,),
    ),
    Case(
        "unicode",
        f'<|python_tag|>{{"name": "get_weather", "parameters": {UNICODE.arguments}}}',
        None,
        (UNICODE,),
    ),
]

MISTRAL = [
    Case(
        "single",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        (PARIS,),
    ),
    Case(
        "several",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "search", "arguments": {"query": "trio nurseries"}}]',
        None,
        (PARIS, QUERY),
    ),
    Case(
        "text-around",
        'Let me look.[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris"}}] Done.',
        "Let me look. Done.",
        (PARIS,),
    ),
    Case("no-call", "The list [1, 2] is short.", "The list [1, 2] is short.", ()),
    Case("lookalike", "[TOOL] [TOOL_CALL] [TOOLS]", "[TOOL] [TOOL_CALL] [TOOLS]", ()),
    Case(
        "truncated",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}',
        (),
    ),
    Case("not-json", "[TOOL_CALLS] get_weather(Paris)", "[TOOL_CALLS] get_weather(Paris)", ()),
    Case("not-calls", "[TOOL_CALLS] [1, 2] ok", "[TOOL_CALLS] [1, 2] ok", ()),
    Case(
        "unknown-tool-dropped",
        '[TOOL_CALLS] [{"name": "launch_rockets", "arguments": {}}, '
        '{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        (PARIS,),
    ),
    Case(
        "unicode",
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {UNICODE.arguments}}}]',
        None,
        (UNICODE,),
    ),
]

PYTHONIC = [
    Case("single", '[get_weather(city="Paris")]', None, (PARIS,)),
    Case(
        "several",
        "[get_weather(city='Paris'), search(query=\"trio nurseries\")]",
        None,
        (PARIS, QUERY),
    ),
    Case(
        "literals-and-text-after",
        ' [search(query="a]b", filters={"tags": ["x", (1, 2)]}, exact=True, limit=None, '
        "score=-1.5)]\nSearching now.",
        "Searching now.",
        (
            call(
                "search",
                query="a]b",
                filters={"tags": ["x", [1, 2]]},
                exact=True,
                limit=None,
                score=-1.5,
            ),
        ),
    ),
    Case(
        "brackets-and-quotes-inside-strings",
        r"""[search(query='a) ] ( [', note="it's \"x\" ]", empty='', long='''tri"]'ple''')]""",
        None,
        (call("search", query="a) ] ( [", note='it\'s "x" ]', empty="", long="tri\"]'ple"),),
    ),
    Case("no-call", "Paris is sunny.", "Paris is sunny.", ()),
    Case("list-not-calls", "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", ()),
    Case("text-before", 'Try [get_weather(city="Paris")]', 'Try [get_weather(city="Paris")]', ()),
    Case("not-literal", "[get_weather(city=Paris)]", "[get_weather(city=Paris)]", ()),
    Case("positional", '[get_weather("Paris")]', '[get_weather("Paris")]', ()),
    Case("truncated", '[get_weather(city="Par', '[get_weather(city="Par', ()),
    Case(
        "unknown-tool-dropped",
        '[launch_rockets(count=3), get_weather(city="Paris")]',
        None,
        (PARIS,),
    ),
    Case(
        "unicode",
        "[get_weather(city='Zürich', note='東京 😀 \"quoted\"\\n')]",
        None,
        (UNICODE,),
    ),
]

CASES = {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL, "pythonic": PYTHONIC}
ALL = [
    pytest.param(name, case, id=f"{name}-{case.id}") for name, cs in CASES.items() for case in cs
]


def cut(text: str, cuts: set[int]) -> list[str]:
    """`text` in pieces, cut at `cuts`."""
    points = sorted(cuts)
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def stream(name: str, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    """Feeds `pieces` to a fresh parser and assembles what a client would: the content,
    and each call from its deltas. Checks on the way that content only ever grows into the
    final content (nothing sent is taken back), that each call's first delta names it and
    later ones do not."""
    parser = make_tool_parser(name, TOOLS)
    expected, _ = parser.parse("".join(pieces))
    content = ""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    steps = [parser.feed(piece) for piece in pieces]
    steps.append(parser.finish())
    for delta_content, deltas in steps:
        content += delta_content
        assert (expected or "").startswith(content), (content, expected)
        for delta in deltas:
            if delta.index not in names:
                assert delta.index == len(names), "indices count up from 0"
                assert delta.name is not None, "a call's first delta names it"
                names[delta.index] = delta.name
                arguments[delta.index] = ""
            else:
                assert delta.name is None
            arguments[delta.index] += delta.arguments
    return content, [ParsedCall(names[i], arguments[i]) for i in sorted(names)]


@pytest.mark.parametrize(("name", "case"), ALL)
def test_parse(name: str, case: Case) -> None:
    content, calls = make_tool_parser(name, TOOLS).parse(case.text)
    assert (content, calls) == (case.content, list(case.calls))
    for parsed in calls:
        assert isinstance(json.loads(parsed.arguments), dict)


@pytest.mark.parametrize(("name", "case"), ALL)
def test_stream_split_anywhere_matches_parse(name: str, case: Case) -> None:
    want = (case.content or "", list(case.calls))
    text = case.text
    assert stream(name, [text]) == want
    assert stream(name, list(text)) == want
    for cut in range(1, len(text)):
        assert stream(name, [text[:cut], text[cut:]]) == want, cut


@given(data=st.data())
@pytest.mark.parametrize(("name", "case"), ALL)
def test_stream_random_pieces_match_parse(name: str, case: Case, data: st.DataObject) -> None:
    text = case.text
    cuts = data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8))
    pieces = cut(text, cuts)
    assert stream(name, pieces) == (case.content or "", list(case.calls))


@pytest.mark.parametrize(
    ("name", "marker"),
    [("hermes", "<tool_call>"), ("llama3", "<|python_tag|>"), ("mistral", "[TOOL_CALLS]")],
)
def test_partial_marker_is_held_back_then_released(name: str, marker: str) -> None:
    for size in range(1, len(marker)):
        parser = make_tool_parser(name, TOOLS)
        content, deltas = parser.feed("Let me see. " + marker[:size])
        assert (content, deltas) == ("Let me see.", [])
        # It was not a marker after all: the held text comes out, as it was.
        assert parser.feed("!") == (" " + marker[:size] + "!", [])
        assert parser.finish() == ("", [])


def test_held_partial_marker_flushed_at_finish() -> None:
    parser = make_tool_parser("hermes", TOOLS)
    assert parser.feed("Done <tool_") == ("Done", [])
    assert parser.finish() == (" <tool_", [])


def test_call_delta_comes_as_soon_as_the_call_closes() -> None:
    parser = make_tool_parser("hermes", TOOLS)
    assert parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}') == (
        "",
        [],
    )
    content, deltas = parser.feed("}\n</tool_call>")
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [
        (0, "get_weather", '{"city": "Paris"}')
    ]


def test_whitespace_only_content_is_none() -> None:
    assert make_tool_parser("hermes", TOOLS).parse(" \n ") == (None, [])
    assert make_tool_parser("pythonic", TOOLS).parse("") == (None, [])


def test_calls_need_an_offered_tool() -> None:
    text = f"<tool_call>{_hermes_json(PARIS)}</tool_call>"
    assert make_tool_parser("hermes", []).parse(text) == (None, [])
    only_search = [ToolSpec("search")]
    assert make_tool_parser("hermes", only_search).parse(text) == (None, [])


def test_names_and_aliases() -> None:
    assert {"hermes", "qwen25", "qwen", "llama3", "mistral", "pythonic"} <= set(TOOL_PARSER_NAMES)
    text = f"<tool_call>{_hermes_json(PARIS)}</tool_call>"
    for alias in ("qwen25", "qwen"):
        assert make_tool_parser(alias, TOOLS).parse(text) == (None, [PARIS])


def test_unknown_parser_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown tool call parser 'hermes2'") as info:
        make_tool_parser("hermes2", TOOLS)
    for name in TOOL_PARSER_NAMES:
        assert name in str(info.value)


#: Fragments that random outputs are made of: markers, halves of markers, JSON and Python
#: bits, so that the random texts hit the formats' edges (unclosed calls, stray closers).
FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    _hermes_json(PARIS),
    _hermes_json(QUERY, "parameters"),
    '{"name": "nope", "arguments": {}}',
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[TOOL_",
    '[get_weather(city="Paris")',
    "search(query='x'), ",
    ";",
    " ",
    "\n",
    "Paris",
    "{",
    "}",
    "[",
    "]",
    '"',
    "'",
    "(",
    ")",
]


@given(
    name=st.sampled_from(sorted(CASES)),
    fragments=st.lists(st.sampled_from(FRAGMENTS), max_size=12),
    data=st.data(),
)
def test_stream_of_random_output_matches_parse(
    name: str, fragments: list[str], data: st.DataObject
) -> None:
    text = "".join(fragments)
    cuts = data.draw(st.sets(st.integers(0, len(text)), max_size=10))
    pieces = cut(text, cuts)
    content, calls = make_tool_parser(name, TOOLS).parse(text)
    assert stream(name, pieces) == (content or "", calls)
