"""The model's vocabulary: llama.cpp's tokenizer made linear in special tokens, token pieces,
and llguidance's view of the vocabulary for grammars.

Synopsis::

    ids = runner.tokenize("<|im_start|>user", add_special=False)
    text = b"".join(runner.token_piece(t, special=False) for t in ids)

Tokenizing only reads the vocabulary, so these methods are safe on any thread, beside a
decode on the compute thread. `LlamaVocabulary` is a layer of `LlamaRunner`: the runner sets
`_vocab`, `_specials`, `_vocab_type`, `_adds_eos` and `_pieces` when it loads.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp

from ...errors import RunnerFailure
from ..special_split import SpecialToken, SpecialTokens, cut_points

__all__ = ["LlamaVocabulary", "lltokenizer", "special_tokens"]


#: Vocabularies tokenized in pieces cut after special tokens (special_split.py): those whose
#: tokenizer runs on each fragment between special tokens on its own AND whose exactness is
#: tested against llama.cpp's whole-text answer (tests/engine/test_special_split.py, on the
#: default model's BPE vocabulary). SentencePiece (SPM) and Unigram (UGM) vocabularies
#: should split the same way, but no GGUF of theirs is at hand to test against, so they are
#: tokenized whole: llama.cpp's quadratic split, whose cost the engine's "at least N tokens"
#: refusal bounds at about context² for a prompt (docs/reliability.md).
_PIECEWISE_VOCABS = frozenset({llama_cpp.LLAMA_VOCAB_TYPE_BPE})

_SPECIAL_ATTRS = (
    llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
)


def special_tokens(vocab: Any) -> SpecialTokens:
    """The tokens llama.cpp's tokenizer splits a text at (its `cache_special_tokens`)."""
    found = []
    for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
        attr = llama_cpp.llama_vocab_get_attr(vocab, token)
        if attr & _SPECIAL_ATTRS:
            found.append(
                SpecialToken(
                    text=llama_cpp.llama_vocab_get_text(vocab, token) or b"",
                    lstrip=bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP),
                    rstrip=bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP),
                )
            )
    return SpecialTokens(found)


class LlamaVocabulary:
    """Tokens in and out (`Runner.tokenize`, `token_piece`, ...)."""

    _vocab: Any
    _specials: SpecialTokens
    _vocab_type: int
    _adds_eos: bool
    #: Token pieces already rendered, by (token id, special).
    _pieces: dict[tuple[int, bool], bytes]

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        """llama.cpp's ids for `text`, in time linear in the number of special tokens in it
        (special_split.py: llama.cpp's own split is quadratic in them). Safe to call from
        any thread, beside a decode on the compute thread: tokenizing only reads the
        vocabulary, as llama-server tokenizes in its HTTP threads."""
        data = text.encode()
        cuts = cut_points(data, self._specials) if self._splits_at_specials(add_special) else []
        if not cuts:
            return self._tokenize_bytes(data, add_special)
        ids: list[int] = []
        begin = 0
        for end, resume in cuts:
            ids += self._tokenize_bytes(data[begin:end], add_special and begin == 0)
            begin = resume
        ids += self._tokenize_bytes(data[begin:], False)
        return ids

    @property
    def special_marks(self) -> str | None:
        """The characters this vocabulary's special tokens begin with (None: too many to
        count), for weighing what tokenizing a text costs (`offload.work`)."""
        return self._specials.marks

    def tokens_at_least(self, text: str) -> int:
        """A lower bound on `len(tokenize(text))` in linear time, without tokenizing: the
        special tokens in it, one id each (the engine refuses a text that can never fit
        before tokenizing it)."""
        return self._specials.count(text.encode())

    def _splits_at_specials(self, add_special: bool) -> bool:
        """Whether the text may be tokenized in pieces cut after special tokens (exactness:
        special_split.py): tokenizers that tokenize each fragment on its own, and no EOS
        to add after the last piece only."""
        return self._vocab_type in _PIECEWISE_VOCABS and not (add_special and self._adds_eos)

    def _tokenize_bytes(self, data: bytes, add_special: bool) -> list[int]:
        size = len(data) + 2
        buf = (llama_cpp.llama_token * size)()
        # parse_special: control-token text such as "<|im_start|>" becomes the token, as
        # Hugging Face tokenizers (and so SGLang) do.
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, size, add_special, True)
        if n < 0:
            size = -n
            buf = (llama_cpp.llama_token * size)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, size, add_special, True)
        return list(buf[:n])

    def token_piece(self, token_id: int, *, special: bool) -> bytes:
        key = (token_id, special)
        piece = self._pieces.get(key)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self._vocab, token_id, buf, 64, 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self._vocab, token_id, buf, -n, 0, special)
            piece = self._pieces[key] = buf.raw[:n]
        return piece


def lltokenizer(vocab: Any, n_vocab: int) -> Any:
    """llguidance's view of the vocabulary, for grammars: every token's bytes (control tokens
    marked with a leading 0xFF, as llguidance expects) and llama.cpp's own tokenizer. The
    same as `llguidance.llamacpp.lltokenizer_from_vocab`, but through the non-deprecated
    `llama_vocab_get_attr` (the helper warns once per token). Built once per model (0.2 s);
    it keeps the vocab pointer, so the model outlives it.

    End-of-generation tokens: llama.cpp's EOS first (a complete grammar allows only the first
    one), then the other EOG tokens."""
    import llguidance

    eos = llama_cpp.llama_vocab_eos(vocab)
    eog = [t for t in range(n_vocab) if t != eos and llama_cpp.llama_vocab_is_eog(vocab, t)]
    buf = ctypes.create_string_buffer(16 * 1024)
    control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    user = llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    tokens: list[bytes] = []
    for t in range(n_vocab):
        n = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf) - 1, 0, True)
        if n < 0:
            raise RunnerFailure(f"token {t}: llama_token_to_piece returned {n}")
        piece = buf.raw[:n]
        attr = llama_cpp.llama_vocab_get_attr(vocab, t)
        if attr & control or (attr & user and piece.startswith(b"<") and piece.endswith(b">")):
            piece = b"\xff" + piece
        tokens.append(piece)
    tokenize = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return llguidance.LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
        tokens=tokens,
        vocab_ptr=vocab,
        tokenize_fptr=tokenize,
        eos_token=[eos, *eog] if eos >= 0 else eog,
        slices=None,
    )
