"""The llama runner tokenizes text with many special tokens in linear time and gets exactly
llama.cpp's whole-text ids (engine/runners/special_split.py)."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from typing import Any

import llama_cpp
import pytest

from tributary.engine.runners.llama import LlamaRunner, default_model_path
from tributary.engine.runners.llama.vocabulary import special_tokens
from tributary.engine.runners.special_split import (
    SpecialToken,
    SpecialTokens,
    cut_points,
)


class VocabOnly(LlamaRunner):
    """The runner's tokenizer on a vocabulary-only load of the default model (no weights,
    no context): `tokenize` is LlamaRunner's own."""

    def __init__(self, vocab: Any) -> None:  # no super(): no weights, no context
        self._vocab = vocab
        self._specials = special_tokens(vocab)
        self._vocab_type = llama_cpp.llama_vocab_type(vocab)
        self._adds_eos = bool(llama_cpp.llama_vocab_get_add_eos(vocab))

    def whole(self, text: str, add_special: bool) -> list[int]:
        """llama.cpp's answer for the whole text in one call."""
        return self._tokenize_bytes(text.encode(), add_special)


@pytest.fixture(scope="module")
def runner() -> Iterator[VocabOnly]:
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(default_model_path()).encode(), params)
    assert model
    try:
        yield VocabOnly(llama_cpp.llama_model_get_vocab(model))
    finally:
        llama_cpp.llama_model_free(model)


def test_the_default_models_special_tokens_are_found(runner: VocabOnly) -> None:
    texts = {t.text for t in runner._specials.tokens}
    assert {b"<|im_start|>", b"<|im_end|>", b"<|endoftext|>"} <= texts


PARTS = ["a", "b c", " ", "  ", "\n", "\t", "<", ">", "|", "im", "<|im", "_start|>", "héllo", "é"]


@pytest.mark.parametrize("seed", range(40))
def test_randomized_mixtures_tokenize_as_the_whole_text_does(runner: VocabOnly, seed: int) -> None:
    rng = random.Random(seed)
    specials = [t.text.decode() for t in runner._specials.tokens]
    pieces = []
    for _ in range(rng.randrange(50, 400)):
        pieces.append(rng.choice(specials) if rng.random() < 0.5 else rng.choice(PARTS))
    text = "".join(pieces)
    for add_special in (True, False):
        assert runner.tokenize(text, add_special=add_special) == runner.whole(text, add_special)
    # The text really was tokenized in pieces.
    assert cut_points(text.encode(), runner._specials, every=8)


@pytest.mark.parametrize("seed", range(20))
def test_small_pieces_give_the_whole_texts_ids(
    runner: VocabOnly, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cut every few occurrences (the most cuts) still gives llama.cpp's answer."""
    from tributary.engine.runners.llama import vocabulary

    monkeypatch.setattr(
        vocabulary, "cut_points", lambda data, specials: cut_points(data, specials, 1)
    )
    rng = random.Random(1000 + seed)
    specials = [t.text.decode() for t in runner._specials.tokens]
    text = "".join(
        rng.choice(specials) if rng.random() < 0.6 else rng.choice(PARTS) for _ in range(200)
    )
    assert runner.tokenize(text, add_special=True) == runner.whole(text, True)


def test_a_cut_respects_strip_attributes_and_overlaps() -> None:
    specials = SpecialTokens(
        [
            SpecialToken(b"<r>", rstrip=True),
            SpecialToken(b"<l>", lstrip=True),
            SpecialToken(b"<a><b>"),
            SpecialToken(b"<a>"),
            SpecialToken(b"<b>"),
        ]
    )
    # After <r> the piece resumes past the whitespace its rstrip eats.
    assert cut_points(b"x<r>  \ny", specials, 1) == [(4, 7)]
    # <a> inside <a><b> is overlapped by another occurrence: no cut there, nor after <b>.
    assert cut_points(b"x<a><b>y", specials, 1) == []
    # An occurrence of <l> right after a cut's whitespace is fine: it does not overlap it.
    assert cut_points(b"x<r> <l>y", specials, 1) == [(4, 5), (8, 8)]


def test_many_special_tokens_take_linear_time(runner: VocabOnly) -> None:
    """llama.cpp's own split took 0.76 s for 8,000 `<|im_start|>` and 12.3 s for 30,000 on
    this model; the pieces take about as long per token as plain text does."""
    small = "<|im_start|>a\n" * 3_000
    large = "<|im_start|>a\n" * 30_000
    start = time.perf_counter()
    assert len(runner.tokenize(small, add_special=True)) == 9_000
    small_s = time.perf_counter() - start
    start = time.perf_counter()
    assert len(runner.tokenize(large, add_special=True)) == 90_000
    large_s = time.perf_counter() - start
    # Ten times the text: linear is about 10x; quadratic was about 100x. Generous for a
    # loaded machine, and an absolute bound that the old split (12 s) never met.
    assert large_s < 2.0
    assert large_s < 30 * small_s + 0.2


def gemma_sized() -> SpecialTokens:
    """6,000 special tokens (a Gemma-sized vocabulary's), a few that overlap each other and
    one with rstrip."""
    tokens = [SpecialToken(f"<unused{i}>".encode()) for i in range(6_000)]
    tokens += [
        SpecialToken(b"<start_of_turn>"),
        SpecialToken(b"<end_of_turn>", rstrip=True),
        SpecialToken(b"<a>"),
        SpecialToken(b"<b>"),
        SpecialToken(b"<a><b>"),
    ]
    return SpecialTokens(tokens)


def test_cut_points_stay_linear_with_thousands_of_special_tokens() -> None:
    """Checking a cut looks only at the tokens that can overlap the one before it: with
    every special token checked at every candidate cut, 4 MB took 7 s here, and a text of
    overlapping tokens (never a clean cut) 46 s; a plain alternation of 6,000 tokens also
    cost the regex engine seconds a megabyte."""
    start = time.process_time()
    specials = gemma_sized()
    assert time.process_time() - start < 3.0  # at load, once (0.15 s measured)
    turns = (b"<start_of_turn>user hello<end_of_turn>\n" * 110_000)[:4_000_000]
    overlapping = (b"x<a><b>" * 600_000)[:4_000_000]
    for data in (turns, overlapping):
        start = time.process_time()
        cuts = cut_points(data, specials)
        took = time.process_time() - start
        assert took < 3.0, took  # 0.02 s and 0.45 s measured
        if data is turns:
            assert cuts
    # Tokens that overlap nothing are counted, however many the vocabulary has.
    assert specials.count(turns[:4_000]) == turns[:4_000].count(b"<start_of_turn>") + turns[
        :4_000
    ].count(b"<end_of_turn>")


def test_the_trie_pattern_finds_the_longest_token_as_an_alternation_does() -> None:
    rng = random.Random(7)
    texts = [b"<a>", b"<a><b>", b"<b>", b"<ab>", b"<", b"<a", b"ab", b"<unused1>", b"<unused10>"]
    specials = SpecialTokens([SpecialToken(t) for t in texts])
    assert specials.pattern is not None
    plain = re.compile(b"|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))
    alphabet = [b"<", b">", b"a", b"b", b"<a>", b"<unused1", b"0>", b" "]
    for _ in range(300):
        data = b"".join(rng.choice(alphabet) for _ in range(40))
        found = [(m.start(), m.group()) for m in specials.pattern.finditer(data)]
        assert found == [(m.start(), m.group()) for m in plain.finditer(data)], data
