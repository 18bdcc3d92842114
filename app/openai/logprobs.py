"""Logprobs as `/v1` shows them: the legacy completions object and chat's `content` list.

Synopsis::

    speller = TokenSpeller(eng)                              # one per served model (cached)
    shaper = CompletionLogprobs(speller, echo=prompt_text, special=False)   # one per choice
    shaper.render(item.logprobs)     # {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    chat_logprob_content(speller, item.logprobs)   # [{"token", "logprob", "bytes", "top_logprobs"}]

Each engine item carries the scores of its own new tokens (and, on a request's first item, of
the prompt), so a stream renders every item on its own and a unary response concatenates
them (`merge_completion_logprobs`).

What the numbers and strings are:

- A token is spelled as its bytes (`Engine.token_bytes`: control tokens spelled out, as
  `<|im_end|>`) decoded as UTF-8 with "replace", so a token holding part of a character shows
  U+FFFD; chat's `bytes` carries the exact bytes, as OpenAI does.
- JSON has no -Infinity, and OpenAI's schema wants numbers: a logprob of -inf (a token a
  grammar, logit_bias or min_tokens forbids) is reported as `LOGPROB_FLOOR`, vLLM's -9999.0.
- The matched EOS or stop token is an output token (it counts in `completion_tokens`), so it
  has an entry although the text does not show it, as in SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tributary.engine import Logprobs, TokenizerService, TokenLogprob, TopLogprobs

__all__ = [
    "LOGPROB_FLOOR",
    "CompletionLogprobs",
    "TokenSpeller",
    "chat_logprob_content",
    "merge_completion_logprobs",
]

#: What a -inf logprob is reported as (vLLM's value; OpenAI's own floor is similar).
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    # NaN cannot reach here (the engine sanitizes rows), but JSON must never get one.
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenSpeller:
    """Token ids as logprob entries spell them, cached per id (a vocabulary is at most a few
    hundred thousand entries, and top-20 lists ask for the same few ids over and over)."""

    def __init__(self, tokenizer: TokenizerService) -> None:
        self._tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}
        self._hidden: dict[int, bool] = {}

    def raw(self, token: int) -> bytes:
        raw = self._bytes.get(token)
        if raw is None:
            raw = self._bytes[token] = self._tokenizer.token_bytes(token)
        return raw

    def text(self, token: int) -> str:
        return self.raw(token).decode("utf-8", errors="replace")

    def shown(self, token: int, *, special: bool) -> bytes:
        """The bytes the token adds to a choice's text: none for a control token when special
        tokens are skipped (`skip_special_tokens`, the default)."""
        if special:
            return self.raw(token)
        hidden = self._hidden.get(token)
        if hidden is None:
            hidden = self._hidden[token] = bool(self.raw(token)) and not self._tokenizer.detokenize(
                [token], skip_special_tokens=True
            )
        return b"" if hidden else self.raw(token)


class _TextOffsets:
    """Character offsets of tokens into a text, from the bytes each adds to it. A token that
    starts inside a character (a multi-byte character split over tokens) gets the offset of
    that character."""

    def __init__(self, start: int = 0) -> None:
        self._chars = start

    def advance(self, shown: bytes) -> int:
        offset = self._chars
        if shown and _continuation(shown[0]) and offset > 0:
            offset -= 1
        self._chars += sum(1 for b in shown if not _continuation(b))
        return offset


def _continuation(byte: int) -> bool:
    return 0x80 <= byte < 0xC0


class CompletionLogprobs:
    """One choice's logprobs in the legacy completions shape.

    `text_offset` values are real character offsets into the choice's `text` (OpenAI's and
    vLLM's meaning; SGLang always sends -1), counted across a stream's chunks. Prompt tokens
    (with `echo`) are placed by matching their bytes against the echoed prompt, so a token the
    prompt text does not show (a BOS the tokenizer added) has no width; output tokens start
    after the whole echoed prompt. Tokens cut off with a stop string point past the text's end.

    `top_logprobs` maps token strings to logprobs, most likely first, and also holds the chosen
    token when it is not among them, as OpenAI and vLLM do (so up to `logprobs + 1` entries;
    with `logprobs: 0`, just the chosen token). The first prompt position has no logprob: its
    `token_logprobs` and `top_logprobs` entries are null.
    """

    def __init__(self, speller: TokenSpeller, *, echo: str | None, special: bool) -> None:
        self._speller = speller
        self._echo = echo or ""
        self._special = special
        self._offsets = _TextOffsets(len(self._echo))

    def render(self, logprobs: Logprobs) -> dict[str, Any]:
        """The entries of one engine item: the prompt's (on a request's first item, when asked
        for), then its output tokens'."""
        speller = self._speller
        prompt = logprobs.input_token or []
        output = logprobs.output_token
        offsets = self._prompt_offsets(prompt) + [
            self._offsets.advance(speller.shown(token, special=self._special))
            for _, token in output
        ]
        tops = _tops(prompt, logprobs.input_top) + _tops(output, logprobs.output_top)
        entries = [*prompt, *output]
        return {
            "text_offset": offsets,
            "token_logprobs": [None if lp is None else _finite(lp) for lp, _ in entries],
            "tokens": [speller.text(token) for _, token in entries],
            "top_logprobs": [
                self._top_dict(entry, top) for entry, top in zip(entries, tops, strict=True)
            ],
        }

    def _prompt_offsets(self, prompt: Sequence[TokenLogprob]) -> list[int]:
        text = self._echo.encode()
        offsets = _TextOffsets()
        at = 0
        result = []
        for _, token in prompt:
            raw = self._speller.raw(token)
            shown = raw if raw and text.startswith(raw, at) else b""
            at += len(shown)
            result.append(offsets.advance(shown))
        return result

    def _top_dict(self, entry: TokenLogprob, top: TopLogprobs) -> dict[str, float] | None:
        logprob, token = entry
        if logprob is None:
            return None
        spell = self._speller.text
        alternatives: dict[str, float] = {}
        for alt_logprob, alt in top or []:
            alternatives.setdefault(spell(alt), _finite(alt_logprob))
        alternatives.setdefault(spell(token), _finite(logprob))
        return alternatives


def _tops(entries: Sequence[TokenLogprob], tops: Sequence[TopLogprobs] | None) -> list[TopLogprobs]:
    return list(tops) if tops is not None else [None] * len(entries)


def merge_completion_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One choice's rendered items, concatenated (a unary response)."""
    keys = ("text_offset", "token_logprobs", "tokens", "top_logprobs")
    return {key: [value for part in parts for value in part[key]] for key in keys}


def chat_logprob_content(speller: TokenSpeller, logprobs: Logprobs) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` entries for one engine item's output tokens. Each entry's
    `top_logprobs` lists exactly the `top_logprobs` alternatives asked for, most likely
    first."""
    tops = _tops(logprobs.output_token, logprobs.output_top)
    return [
        {
            **_chat_token(speller, token, logprob),
            "top_logprobs": [
                _chat_token(speller, alt, alt_logprob) for alt_logprob, alt in top or []
            ],
        }
        for (logprob, token), top in zip(logprobs.output_token, tops, strict=True)
    ]


def _chat_token(speller: TokenSpeller, token: int, logprob: float | None) -> dict[str, Any]:
    # Output positions always have a logprob; None only marks a prompt's first position.
    assert logprob is not None
    return {
        "token": speller.text(token),
        "logprob": _finite(logprob),
        "bytes": list(speller.raw(token)),
    }
