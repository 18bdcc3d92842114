"""Constrained decoding with llguidance: SGLang's `regex`, `json_schema` and `ebnf`.

Synopsis::

    grammars = Grammars(lltokenizer, n_vocab)          # once per model (runner)
    matcher = grammars.matcher("json_schema", schema)  # per request; BadRequest if invalid
    matcher.fill_mask(row)                             # per token, before sampling
    matcher.consume(token)                             # after sampling
    matcher.finished                                   # the grammar is complete

llguidance (one of SGLang's own grammar backends) compiles the grammar against the model's
vocabulary and computes, for each position, the set of tokens that keep the output inside the
grammar. Measured on SmolLM2 (49,152 tokens), computing and applying the mask costs 0.1-0.3
ms a token against a 6-11 ms decode (docs/benchmarks/README.md). Mask computation releases
the GIL.

How generation ends: once the text is a complete match, the mask lets the model's
end-of-generation tokens through (an open-ended grammar such as `[0-9]+` lets the model
decide); once nothing more can follow, `finished` is true and the engine stops with SGLang's
`{"type": "stop", "matched": <last token id>}`.

JSON schemas are compiled without flexible whitespace (`{"a":1}`, not `{ "a" : 1 }`): the
output is the same JSON, and small models otherwise drift into odd layouts (measured:
SmolLM2 put every comma on a line of its own).
"""

from __future__ import annotations

import json

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from .errors import BadRequest

__all__ = ["GRAMMAR_KINDS", "Grammars", "LlgMatcher"]

#: SGLang's sampling keys that carry a grammar, in the order it names them.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


class LlgMatcher:
    """One request's position in its grammar. Used by one thread at a time (llguidance raises
    if a matcher is used from two at once)."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._bitmask = allocate_token_bitmask(1, n_vocab)

    def fill_mask(self, row: np.ndarray) -> None:
        fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        # One bit per token, little-endian within each 32-bit word. Unpacking and one masked
        # copy is several times faster than llguidance's own numpy helper (8-50 us vs
        # 170-260 us a row, measured).
        allowed = np.unpackbits(
            self._bitmask[0].view(np.uint8), count=self._n_vocab, bitorder="little"
        ).view(bool)
        np.copyto(row[: self._n_vocab], -np.inf, where=~allowed)

    def consume(self, token: int) -> None:
        # The mask only lets allowed tokens through, so this cannot fail for a sampled token;
        # if it did, the matcher's error state keeps the mask at end-of-generation only.
        self._matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_stopped())


class Grammars:
    """Compiles requests' grammars against one model's vocabulary."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, n_vocab: int) -> None:
        self._tokenizer = tokenizer
        self._n_vocab = n_vocab

    def matcher(self, kind: str, source: str) -> LlgMatcher:
        """A matcher at the start of `source`; BadRequest naming the problem if the grammar
        is invalid (checked here, before anything is queued)."""
        grammar = _grammar(kind, source)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise BadRequest(f"Invalid {kind}: {_first_line(matcher.get_error())}")
        return LlgMatcher(matcher, self._n_vocab)


def _grammar(kind: str, source: str) -> str:
    if kind == "json_schema":
        try:
            json.loads(source)
        except ValueError as exc:
            raise BadRequest(f"Invalid json_schema: it is not valid JSON ({exc}).") from None
        try:
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(
                    source, defaults={"whitespace_flexible": False}
                )
            )
        except ValueError as exc:
            raise BadRequest(f"Invalid json_schema: {_first_line(str(exc))}") from None
    if kind == "regex":
        return str(llguidance.grammar_from("regex", source))
    if kind == "ebnf":
        try:
            return str(llguidance.grammar_from("ebnf", source))
        except ValueError as exc:
            raise BadRequest(f"Invalid ebnf: {_first_line(str(exc))}") from None
    raise AssertionError(f"unknown grammar kind {kind!r}")


def _first_line(message: str) -> str:
    """llguidance's message without its trailing detail dump, short enough for a 400."""
    text = message.strip() or "unknown error"
    return text if len(text) <= 500 else text[:497] + "..."
