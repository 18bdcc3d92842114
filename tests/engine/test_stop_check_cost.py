"""The per-token stop-string check stays cheap at the caps (64 stops of 256 characters), and
its bounded hold-back computes what the plain search does."""

from __future__ import annotations

import random
import time

import regex

from tributary.engine import sampling
from tributary.engine.detokenize import IncrementalDetokenizer

#: The caps (engine/sampling.py), spelled out so that this test measures them.
STOP_COUNT, STOP_CHARS = 64, 256


def plain_held_back(text: str, emitted: int, stops: tuple[str, ...]) -> int:
    """The longest unemitted suffix that begins some stop, by trying every length."""
    longest = max(len(s) for s in stops)
    for n in range(min(longest - 1, len(text) - emitted), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


def test_the_bounded_hold_back_matches_the_plain_search() -> None:
    rng = random.Random(1)
    for trial in range(2000):
        alphabet = "ab" if trial % 2 else "abc"
        stops = tuple(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
            for _ in range(rng.randint(1, 4))
        )
        pieces = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))).encode()
            for _ in range(5)
        ]
        detok = IncrementalDetokenizer(lambda t, p=pieces: p[t], stops=stops)
        for _ in range(30):
            if detok.add(rng.randrange(5)) is not None:
                break
            if rng.random() < 0.6:  # frames are not cut after every token
                text, emitted = detok.text, detok._emitted
                expected = len(text) - plain_held_back(text, emitted, stops)
                detok.take_delta(final=False)
                assert detok._emitted == max(emitted, expected), (stops, text)


def test_a_token_costs_little_at_the_caps_even_while_a_stop_regex_holds_text_back() -> None:
    """A stop regex that can match ever longer text (`<t>.*</t>`) keeps everything after
    `<t>` unemitted. The plain hold-back search then tried every suffix up to 255 characters
    against all 64 stops after every token: about 1 ms of CPU a token (1,000 tokens: 1.07 s);
    bounded by what each token added, about 60 us."""
    stops = tuple("Z" * (STOP_CHARS - 1) + chr(0x41 + i) for i in range(STOP_COUNT))
    pieces = {0: b"<t>", 1: b"abcd"}
    detok = IncrementalDetokenizer(
        lambda t: pieces[t], stops=stops, stop_regexes=(regex.compile(r"<t>.*</t>"),)
    )
    detok.add(0)
    started = time.thread_time()
    for _ in range(1000):
        assert detok.add(1) is None
        assert detok.take_delta(final=False) == ""
    cpu = time.thread_time() - started
    assert cpu < 0.4, f"{cpu * 1000:.0f} us a token"
    assert sampling.MAX_STOP_COUNT <= STOP_COUNT and sampling.MAX_STOP_CHARS <= STOP_CHARS
