"""Incremental detokenization: whole characters only, stop strings never leak."""

from __future__ import annotations

import re
from typing import Any

import pytest
import regex  # type: ignore[import-untyped]
from hypothesis import given, settings
from hypothesis import strategies as st

from tributary.engine import BadRequest, detokenize
from tributary.engine.detokenize import IncrementalDetokenizer


def piece(token: int) -> bytes:
    """A byte-level vocabulary: token id = byte value."""
    return bytes([token])


def feed(
    text: str, *, stops: tuple[str, ...] = (), no_stop_trim: bool = False
) -> tuple[list[str], str | None]:
    detok = IncrementalDetokenizer(piece, stops=stops, no_stop_trim=no_stop_trim)
    deltas = []
    matched = None
    for byte in text.encode():
        matched = detok.add(byte)
        deltas.append(detok.take_delta(final=matched is not None))
        if matched:
            break
    else:
        deltas.append(detok.take_delta(final=True))
    return deltas, matched


@given(st.text())
def test_deltas_are_whole_characters_and_add_up(text: str) -> None:
    deltas, _ = feed(text)
    assert "".join(deltas) == text
    # Feeding byte by byte never yields a replacement character for valid UTF-8.
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_is_held_until_complete() -> None:
    deltas, _ = feed("é🚀")
    assert deltas == ["", "é", "", "", "", "🚀", ""]


@given(st.text(alphabet="abc", max_size=30), st.text(alphabet="abc", min_size=1, max_size=4))
def test_stop_string_trimmed_and_never_leaked(text: str, stop: str) -> None:
    deltas, matched = feed(text, stops=(stop,))
    joined = "".join(deltas)
    if stop in text:
        assert matched == stop
        assert joined == text[: text.index(stop)]
    else:
        assert matched is None
        assert joined == text
    # No delta handed out before the decision contained any part of the stop string's match.
    assert stop not in joined


def test_no_stop_trim_keeps_the_stop_string() -> None:
    deltas, matched = feed("hello world. more", stops=("world",), no_stop_trim=True)
    assert matched == "world"
    assert "".join(deltas) == "hello world"


def test_prefix_of_stop_is_released_once_decided() -> None:
    detok = IncrementalDetokenizer(piece, stops=("END",))
    for byte in b"xEN":
        detok.add(byte)
    assert detok.take_delta(final=False) == "x"  # "EN" may still become "END"
    detok.add(ord("x"))  # "ENx": decided, not a stop
    assert detok.take_delta(final=False) == "ENx"


# --- stop regexes ------------------------------------------------------------------------


def feed_pieces(
    pieces: list[bytes | str],
    patterns: tuple[str, ...],
    *,
    stops: tuple[str, ...] = (),
    no_stop_trim: bool = False,
    min_new_tokens: int = 0,
) -> tuple[list[str], str | None, str]:
    """Feed one token per piece (token id = index), as the scheduler does: checks start after
    min_new_tokens tokens; the delta is final on a stop or after the last piece. Returns the
    deltas, what matched and the final text; asserts the deltas add up to that text."""
    raw = [p.encode() if isinstance(p, str) else p for p in pieces]
    detok = IncrementalDetokenizer(
        raw.__getitem__,
        stops=stops,
        stop_regexes=tuple(regex.compile(p) for p in patterns),
        no_stop_trim=no_stop_trim,
    )
    deltas: list[str] = []
    matched = None
    for token in range(len(raw)):
        matched = detok.add(token, check_stops=token + 1 > min_new_tokens)
        deltas.append(detok.take_delta(final=matched is not None))
        if matched:
            break
    else:
        deltas.append(detok.take_delta(final=True))
    assert "".join(deltas) == detok.text
    return deltas, matched, detok.text


def test_unbounded_regex_stops_at_the_first_digit_token() -> None:
    deltas, matched, text = feed_pieces(["ab", "c1", "23", "x"], (r"\d+",))
    assert matched == r"\d+"  # the pattern, as SGLang reports it, not the matched text
    assert text == "abc"
    assert deltas == ["ab", "c"]  # "c" is released with the stop; "1" never shows
    _, _, kept = feed_pieces(["ab", "c1", "23", "x"], (r"\d+",), no_stop_trim=True)
    assert kept == "abc1"  # through the end of the match as it stood: nothing after


def test_match_spanning_tokens_is_held_until_decided() -> None:
    deltas, matched, text = feed_pieces(["xx", "E", "N", "D", "7", "yy"], (r"END\d",))
    assert (matched, text) == (r"END\d", "xx")
    assert deltas == ["xx", "", "", "", ""]
    # The same prefix that turns out not to match is released by the token that decides it.
    deltas, matched, text = feed_pieces(["xx", "E", "N", "Dx", "yy"], (r"END\d",))
    assert matched is None and text == "xxENDxyy"
    assert deltas == ["xx", "", "", "ENDx", "yy", ""]


def test_match_inside_one_token_cuts_the_text_after_it() -> None:
    pieces = ["hello", " wor", "ld. And more"]
    deltas, matched, text = feed_pieces(pieces, (r"[.!?]",))
    assert (matched, text, deltas) == (r"[.!?]", "hello world", ["hello", " wor", "ld"])
    _, _, kept = feed_pieces(pieces, (r"[.!?]",), no_stop_trim=True)
    assert kept == "hello world."


def test_end_anchored_regex_judges_the_text_as_it_stands() -> None:
    pattern = r"[.!?]\s*$"
    _, matched, text = feed_pieces(["Hi", ". ", "there"], (pattern,))
    assert (matched, text) == (pattern, "Hi")
    # "." followed by more text in the same token is not at the end: no stop, nothing held.
    deltas, matched, text = feed_pieces(["Hi", ". there", "!"], (pattern,))
    assert (matched, text) == (pattern, "Hi. there")
    assert deltas == ["Hi", ". there", ""]


def test_multibyte_characters_split_across_tokens() -> None:
    pieces = [b"go ", b"\xf0\x9f", b"\x9a", b"\x80", b"!"]  # "🚀" in three tokens
    deltas, matched, text = feed_pieces(pieces, ("🚀",))
    assert (matched, text, deltas) == ("🚀", "go ", ["go ", "", "", ""])
    # A character class sees whole characters only: "é" is not "è" split in two.
    deltas, matched, text = feed_pieces([b"a", b"\xc3", b"\xa8", b"b"], ("é",))
    assert (matched, text, deltas) == (None, "aèb", ["a", "", "è", "b", ""])


def test_stop_strings_and_regexes_together() -> None:
    # Each holds back what it may still match; the larger hold wins.
    deltas, matched, text = feed_pieces(["a ST", "O", "1", "P"], (r"\d",), stops=("STOP",))
    assert (matched, text) == (r"\d", "a STO")
    assert deltas == ["a ", "", "STO"]
    # The earliest match wins, whichever kind it is ...
    assert feed_pieces(["abcd"], (r"b.*d",), stops=("cd",))[1:] == (r"b.*d", "a")
    assert feed_pieces(["abcd"], (r"c",), stops=("bc",))[1:] == ("bc", "a")
    # ... and on a tie, the stop string.
    assert feed_pieces(["abc"], (r"b",), stops=("bc",))[1:] == ("bc", "a")


def test_min_new_tokens_only_a_match_ending_in_a_checked_token_counts() -> None:
    # "1" came before the checks began: held while a checked token could extend the match ...
    deltas, matched, text = feed_pieces(["a1", "2", "b3"], (r"\d+",), min_new_tokens=1)
    assert (matched, text, deltas) == (r"\d+", "a", ["a", ""])
    # ... released once no match from it can reach further, and ignored for good.
    deltas, matched, text = feed_pieces(["a1", "b", "c2"], (r"\d",), min_new_tokens=1)
    assert (matched, text, deltas) == (r"\d", "a1bc", ["a", "1b", "c"])
    deltas, matched, text = feed_pieces(["Hi.", " x"], (r"\.$",), min_new_tokens=1)
    assert (matched, text, deltas) == (None, "Hi. x", ["Hi", ". x", ""])


def test_a_complete_match_before_the_checks_does_not_hide_an_earlier_partial_one() -> None:
    # In "xfo", "o" is a complete match (not counted: checks are off) and "fo" a partial one
    # the regex package does not report beside it; "fo" must still be held.
    deltas, matched, text = feed_pieces(["xfo", "o!"], (r"foo|o",), min_new_tokens=1)
    assert (matched, text, deltas) == (r"foo|o", "x", ["x", ""])


STOP_PATTERNS = [
    r"\d",
    r"\d+",
    r"ab+a",
    r"[.!?]\s*$",
    r"a.?b",
    r"b\b",
    r"(?<=a)b",
    r"a(?=b)",
    r"1|ab1",
    r"\.\s*a",
    r"^b",
]


@settings(max_examples=500)  # a leak needs a match split over tokens: look hard
@given(
    st.lists(st.text(alphabet="ab1. ", min_size=1, max_size=3), max_size=12),
    st.sampled_from(STOP_PATTERNS),
    st.sampled_from(["", "ba", "1."]),
    st.booleans(),
)
def test_regex_stop_is_sglangs_search_after_each_token(
    pieces: list[str], pattern: str, stop: str, no_stop_trim: bool
) -> None:
    """Against a plain reference: after each token, search the whole text with `re`; the first
    token whose text has a match stops, cut at the earliest match (the stop string on a tie)."""
    stops = (stop,) if stop else ()
    deltas, matched, text = feed_pieces(pieces, (pattern,), stops=stops, no_stop_trim=no_stop_trim)
    expected, want_matched = "".join(pieces), None
    for i in range(len(pieces)):
        so_far = "".join(pieces[: i + 1])
        hits = []
        if stop and stop in so_far:
            hits.append((so_far.index(stop), 0, so_far.index(stop) + len(stop), stop))
        if m := re.search(pattern, so_far):
            hits.append((m.start(), 1, m.end(), pattern))
        if hits:
            start, _, end, want_matched = min(hits)
            expected = so_far[: end if no_stop_trim else start]
            break
    assert (matched, text) == (want_matched, expected)
    # Streaming safety: what was handed out is always a prefix of the final text.
    for n in range(len(deltas)):
        assert text.startswith("".join(deltas[:n]))


@settings(max_examples=500)  # a leak needs a match split over tokens: look hard
@given(
    st.lists(st.text(alphabet="ab1. ", min_size=1, max_size=3), max_size=12),
    st.sampled_from(STOP_PATTERNS),
    st.integers(min_value=0, max_value=6),
)
def test_regex_deltas_add_up_with_min_new_tokens(
    pieces: list[str], pattern: str, min_new_tokens: int
) -> None:
    deltas, matched, text = feed_pieces(pieces, (pattern,), min_new_tokens=min_new_tokens)
    if matched is None:
        assert text == "".join(pieces)
    else:
        # The cut sits where a match begins, and that match ends in a checked token.
        untrimmed = "".join(pieces[: len(deltas)])
        m = regex.compile(pattern).match(untrimmed, len(text))
        assert m is not None and m.end() > len("".join(pieces[:min_new_tokens]))
    for n in range(len(deltas)):
        assert text.startswith("".join(deltas[:n]))


def test_a_regex_search_that_was_only_descheduled_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The regex engine's timeout is wall-clock: on a busy machine a trivial search can run
    out of time without using any CPU. That must not end the request (it did, with a 400,
    when the test suite ran beside other work); only a search that burns the CPU budget
    does (test_logit_hooks: catastrophic backtracking)."""
    real_scan = detokenize._scan
    timeouts = iter([True, True])  # the first two searches "time out", idle

    def descheduled_scan(*args: Any) -> Any:
        if next(timeouts, False):
            raise TimeoutError
        return real_scan(*args)

    monkeypatch.setattr(detokenize, "_scan", descheduled_scan)
    _, matched, text = feed_pieces(["The year ", "was 19", "84."], (r"\d{4}",))
    assert matched == r"\d{4}"
    assert text == "The year was "


def test_a_search_descheduled_every_time_still_ends_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def always_late(*args: Any) -> Any:
        raise TimeoutError

    monkeypatch.setattr(detokenize, "_scan", always_late)
    with pytest.raises(BadRequest, match="stop_regex took more than"):
        feed_pieces(["a", "b"], (r"\d",))
