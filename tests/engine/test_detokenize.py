"""Incremental detokenization: whole characters only, stop strings never leak."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
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
