"""Reasoning parsers on canned model outputs, whole and streamed.

A stream of the same output, split at every position, one character at a time, or in random
pieces, must give what `parse` gives, and what has been sent of the reasoning and of the
content must always be a start of the final text, so no piece of `<think>` or `</think>` is
ever shown and then taken back.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tributary.app.chat.reasoning import REASONING_PARSER_NAMES, make_reasoning_parser


@dataclass(frozen=True)
class Case:
    id: str
    parser: str
    text: str
    reasoning: str | None
    content: str
    thinking: bool = True


CASES = [
    # DeepSeek-R1: the template opened <think>, so the output starts inside reasoning.
    Case(
        "r1-no-start-marker",
        "deepseek-r1",
        "2+2 is 4.</think>\n\nThe answer is 4.",
        "2+2 is 4.",
        "The answer is 4.",
    ),
    Case(
        "r1-repeats-start-marker",
        "deepseek-r1",
        "<think>\nAdd them.\n</think>\n\n**4**",
        "\nAdd them.\n",
        "**4**",
    ),
    Case("r1-never-ends", "deepseek-r1", "<think>Still thinking about", "Still thinking about", ""),
    Case("r1-empty-reasoning", "deepseek-r1", "</think>Hi!", None, "Hi!"),
    Case(
        "r1-later-markers-are-content",
        "deepseek-r1",
        "a</think>b <think>c</think>",
        "a",
        "b <think>c</think>",
    ),
    Case(
        "r1-thinking-off",
        "deepseek-r1",
        "Just the answer.",
        None,
        "Just the answer.",
        thinking=False,
    ),
    Case(
        "r1-thinking-off-but-thinks",
        "deepseek-r1",
        "<think>hm</think>ok",
        "hm",
        "ok",
        thinking=False,
    ),
    # Qwen3: reasoning only from <think> on.
    Case(
        "qwen3-thinks",
        "qwen3",
        "<think>\nThe user greets.\n</think>\n\nHello! 👋",
        "\nThe user greets.\n",
        "Hello! 👋",
    ),
    Case("qwen3-plain", "qwen3", "Hello, how can I help?", None, "Hello, how can I help?"),
    Case("qwen3-text-before-think", "qwen3", "Well. <think>hmm</think> Yes.", "hmm", "Well. Yes."),
    Case("qwen3-never-ends", "qwen3", "<think>I wonder whether", "I wonder whether", ""),
    Case(
        "qwen3-tool-call-ends-reasoning",
        "qwen3",
        '<think>Need the weather.<tool_call>{"name": "w"}</tool_call>',
        "Need the weather.",
        '<tool_call>{"name": "w"}</tool_call>',
    ),
    Case(
        "qwen3-lookalike-markers",
        "qwen3",
        "<thinking> and </th> are text",
        None,
        "<thinking> and </th> are text",
    ),
    Case(
        "qwen3-thinking-forced",
        "qwen3-thinking",
        "Reasoning here.</think>Done.",
        "Reasoning here.",
        "Done.",
    ),
    Case(
        "qwen3-unicode",
        "qwen3",
        "<think>Überlegung: 東京 😀</think>\n答え",
        "Überlegung: 東京 😀",
        "答え",
    ),
    Case("kimi", "kimi", "◁think▷Let me see.◁/think▷Sure.", "Let me see.", "Sure."),
    Case("trailing-whitespace-kept", "qwen3", "<think>x</think>  Yes.\n", "x", "Yes.\n"),
]

IDS = [case.id for case in CASES]


def cut(text: str, cuts: set[int]) -> list[str]:
    """`text` in pieces, cut at `cuts`."""
    points = sorted(cuts)
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def stream(case: Case, pieces: list[str]) -> tuple[str, str]:
    """Feeds `pieces` to a fresh parser and joins the deltas, checking that neither the
    reasoning nor the content ever sends something the final text does not start with."""
    parser = make_reasoning_parser(case.parser, thinking=case.thinking)
    want_reasoning, want_content = parser.parse("".join(pieces))
    reasoning = content = ""
    steps = [parser.feed(piece) for piece in pieces]
    steps.append(parser.finish())
    for reasoning_delta, content_delta in steps:
        reasoning += reasoning_delta
        content += content_delta
        assert (want_reasoning or "").startswith(reasoning), (reasoning, want_reasoning)
        assert want_content.startswith(content), (content, want_content)
    return reasoning, content


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_parse(case: Case) -> None:
    parser = make_reasoning_parser(case.parser, thinking=case.thinking)
    assert parser.parse(case.text) == (case.reasoning, case.content)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_stream_split_anywhere_matches_parse(case: Case) -> None:
    want = (case.reasoning or "", case.content)
    text = case.text
    assert stream(case, [text]) == want
    assert stream(case, list(text)) == want
    for cut in range(1, len(text)):
        assert stream(case, [text[:cut], text[cut:]]) == want, cut


@given(data=st.data())
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_stream_random_pieces_match_parse(case: Case, data: st.DataObject) -> None:
    text = case.text
    cuts = data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8))
    pieces = cut(text, cuts)
    assert stream(case, pieces) == (case.reasoning or "", case.content)


def test_partial_end_marker_is_held_back() -> None:
    parser = make_reasoning_parser("deepseek-r1")
    assert parser.feed("Thinking</thi") == ("Thinking", "")
    assert parser.feed("nk>\n") == ("", "")
    assert parser.feed("Answer") == ("", "Answer")
    assert parser.finish() == ("", "")


def test_partial_start_marker_is_held_then_released_as_content() -> None:
    parser = make_reasoning_parser("qwen3")
    assert parser.feed("Hi <thi") == ("", "Hi ")
    assert parser.feed("s") == ("", "<this")
    assert parser.feed(" <th") == ("", " ")
    assert parser.finish() == ("", "<th")


def test_reasoning_streams_before_the_end_marker() -> None:
    parser = make_reasoning_parser("qwen3")
    assert parser.feed("<think>") == ("", "")
    assert parser.feed("step one, ") == ("step one, ", "")
    assert parser.feed("step two") == ("step two", "")


def test_every_name_separates_its_markers() -> None:
    assert {"deepseek-r1", "qwen3"} <= set(REASONING_PARSER_NAMES)
    for name in REASONING_PARSER_NAMES:
        start, end = ("◁think▷", "◁/think▷") if name == "kimi" else ("<think>", "</think>")
        parser = make_reasoning_parser(name)
        assert parser.parse(f"{start}why{end} Answer.") == ("why", "Answer."), name


def test_unknown_parser_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'") as info:
        make_reasoning_parser("r1")
    for name in REASONING_PARSER_NAMES:
        assert name in str(info.value)


@given(
    name=st.sampled_from(REASONING_PARSER_NAMES),
    thinking=st.booleans(),
    fragments=st.lists(
        st.sampled_from(
            [
                "<think>",
                "</think>",
                "<thi",
                "</th",
                "<tool_call>",
                "◁think▷",
                "◁/think▷",
                " ",
                "\n",
                "x",
                "<",
                ">",
                "/",
            ]
        ),
        max_size=12,
    ),
    data=st.data(),
)
def test_stream_of_random_output_matches_parse(
    name: str, thinking: bool, fragments: list[str], data: st.DataObject
) -> None:
    text = "".join(fragments)
    cuts = data.draw(st.sets(st.integers(0, len(text)), max_size=10))
    pieces = cut(text, cuts)
    case = Case("random", name, text, None, "", thinking=thinking)
    reasoning, content = make_reasoning_parser(name, thinking=thinking).parse(text)
    assert stream(case, pieces) == (reasoning or "", content)
