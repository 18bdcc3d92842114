"""A request's token id lists, checked in one place, in SGLang's words.

Synopsis::

    check_prompt_ids(ids, vocab_size)                          # "input_ids cannot be empty."
    check_token_ids("token_ids_logprob", ids, vocab_size)      # out-of-vocabulary ids

Both raise `BadRequest` (a 400) naming the first problem; the app calls them while it
normalizes a body, the engine at submit for requests that did not come through the app.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .errors import BadRequest

__all__ = ["EMPTY_INPUT_IDS", "check_prompt_ids", "check_token_ids"]

#: SGLang's words (`_determine_batch_size`) for a prompt of no tokens.
EMPTY_INPUT_IDS = "input_ids cannot be empty."


def check_token_ids(field: str, ids: Iterable[int], vocab_size: int) -> None:
    """Every id in [0, vocab_size), or a 400 naming the first that is not."""
    for token in ids:
        if not 0 <= token < vocab_size:
            raise BadRequest(
                f"{field} contains out-of-vocabulary token id {token}; "
                f"valid range is [0, {vocab_size})."
            )


def check_prompt_ids(ids: Sequence[int], vocab_size: int | None) -> None:
    """A prompt's ids: at least one, each in the vocabulary (not checked without one: a
    front's workers check their own)."""
    if not ids:
        raise BadRequest(EMPTY_INPUT_IDS)
    if vocab_size is not None:
        check_token_ids("input_ids", ids, vocab_size)
