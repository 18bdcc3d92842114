"""Tokenizer and template work off the event loop: `off_loop` and `runs_inline`.

Synopsis::

    if runs_inline(*texts):                               # all of a request's texts together
        ids = [eng.tokenize(t) for t in texts]            # under a millisecond: stay on the loop
    else:
        ids = await off_loop(lambda: [eng.tokenize(t) for t in texts])   # one worker thread job

Tokenizing a client's text, compiling its grammar and rendering its chat template cost time
in proportion to what the client sent; on the Trio thread that time is everyone's (a 420 KB
prompt of special tokens held the loop for 15 s before the tokenizer was made linear). Work
too large to run inline goes to a worker thread through one small `CapacityLimiter` per Trio
run, so a flood of large requests queues there instead of taking every core. llama.cpp's
tokenizer releases the GIL and only reads the vocabulary, so it runs beside a decode on the
compute thread (llama-server tokenizes in its HTTP threads).

A caller that is cancelled (its client left, a deadline, shutdown) returns at once: the
thread is abandoned and finishes its bounded work on its own; the engine keeps its model
alive until every such thread has left it (`Engine._using_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import trio

from .capabilities import TokenizerService

__all__ = [
    "INLINE_IDS",
    "INLINE_WORK",
    "MARKS",
    "SPECIAL_WEIGHT",
    "WORKERS",
    "detokenize_all",
    "off_loop",
    "runs_inline",
    "tokenize_all",
    "work",
]

T = TypeVar("T")

#: What tokenizing costs, in plain-text characters: a text's length, plus this much for every
#: character that may begin a special token. Measured on SmolLM2 (llama.cpp's tokenizer, one
#: core, best of 50): 0.21 µs a character of plain text (2,052 characters: 0.44 ms), 0.36 µs
#: a "<", and about 17 µs a special token (2,048 characters of `<|im_end|>a`, 186 special
#: tokens: 3.3 ms; 256 characters, 23 of them: 0.43 ms), about 80 characters' worth.
SPECIAL_WEIGHT = 80

#: The characters special tokens begin with when the vocabulary is not known here (the HTTP
#: layer's own checks): `<|im_start|>`, `<s>`, `<start_of_turn>`, `[INST]`. The engine uses
#: its vocabulary's own (`LlamaRunner.special_marks`).
MARKS = "<["

#: A request's texts are tokenized on the event loop when their `work` adds up to at most
#: this: about 0.9 ms at worst (45 special tokens of `<|im_end|>a`, or 4,096 characters of
#: plain text), under what a worker thread's round trip and a context switch would cost the
#: request; more goes to a worker thread, all of the request's texts in one job.
INLINE_WORK = 4096

#: Token ids detokenized on the event loop at most: 1.5 µs an id measured (2,048 ids: 3.2 ms),
#: so about 0.8 ms.
INLINE_IDS = 512

#: Worker threads tokenizing or rendering at once, in each Trio run.
WORKERS = 2

_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar(
    "tributary_offload_limiter"
)


def work(text: str, marks: str | None = MARKS) -> int:
    """What tokenizing `text` costs, in plain-text characters (SPECIAL_WEIGHT): linear and
    cheap to compute (one C-level `str.count` pass for each character in `marks`; None:
    any character may begin a special token)."""
    if marks is None:
        return len(text) * (1 + SPECIAL_WEIGHT)
    return len(text) + SPECIAL_WEIGHT * sum(text.count(mark) for mark in marks)


def runs_inline(*texts: str | None, marks: str | None = MARKS) -> bool:
    """Whether tokenizing all of `texts` together is cheap enough for the event loop."""
    total = 0
    for text in texts:
        if text is None:
            continue
        total += len(text)  # first: a long text is not counted through
        if total > INLINE_WORK:
            return False
        total += work(text, marks) - len(text)
        if total > INLINE_WORK:
            return False
    return True


def _limiter() -> trio.CapacityLimiter:
    try:
        return _LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(WORKERS)
        _LIMITER.set(limiter)
        return limiter


async def off_loop(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a worker thread (at most `WORKERS` at once); a cancelled caller
    returns at once and leaves the thread to finish."""
    return await trio.to_thread.run_sync(fn, *args, limiter=_limiter(), abandon_on_cancel=True)


async def tokenize_all(
    engine: TokenizerService, texts: Sequence[str], *, add_special: bool
) -> list[list[int]]:
    """The ids of each of `texts` (each distinct text tokenized once): on the event loop
    when they add up to `INLINE_WORK` at most, otherwise all in one worker-thread job."""

    def run() -> list[list[int]]:
        done: dict[str, list[int]] = {}
        for text in texts:
            if text not in done:
                done[text] = engine.tokenize(text, add_special=add_special)
        return [list(done[text]) for text in texts]

    if runs_inline(*dict.fromkeys(texts)):
        return run()
    return await off_loop(run)


async def detokenize_all(
    engine: TokenizerService, lists: Sequence[list[int]], *, skip_special_tokens: bool
) -> list[str]:
    """The text of each of `lists`: on the event loop for `INLINE_IDS` ids in all at most,
    otherwise all in one worker-thread job."""

    def run() -> list[str]:
        return [engine.detokenize(ids, skip_special_tokens=skip_special_tokens) for ids in lists]

    if sum(len(ids) for ids in lists) <= INLINE_IDS:
        return run()
    return await off_loop(run)
