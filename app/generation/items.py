"""The rules both APIs apply to the engine requests one body fans out into: how many there may
be, how n samples get their seeds, how long a client rid may be.

A broken rule is an `engine.BadRequest` (a 400), raised before anything is submitted.
"""

from __future__ import annotations

import dataclasses

from tributary.engine import BadRequest, SamplingParams

__all__ = ["MAX_RID_LENGTH", "check_fan_out", "check_rid", "seeded_sample"]

#: The longest client rid, in characters. A rid is echoed in every stream frame, every
#: batch item (a str rid is every item's prefix) and every access log line, so an unbounded
#: one multiplies a request's size. SGLang and vLLM have no bound; 256 holds any uuid,
#: trace id or composite key.
MAX_RID_LENGTH = 256


def check_fan_out(count: int, max_items: int | None) -> None:
    """A request that expands to more items than the engine takes at once can never be
    admitted: a 400 that says so, not a "retry later" 503 it would retry for ever. Checked
    before expanding, so a huge `n` costs nothing."""
    if max_items is not None and count > max_items:
        raise BadRequest(
            f"The request expands to {count} generations (prompts x n), more than this server "
            f"takes at once ({max_items}: --max-running-requests + --max-queued-requests); "
            "split it into smaller ones."
        )


def seeded_sample(sampling: SamplingParams, index: int) -> SamplingParams:
    """The params of sample `index` of n: with a seed, each sample gets seed + index (as
    vLLM does), so n samples are n different draws and the whole response is reproducible."""
    if sampling.sampling_seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, sampling_seed=sampling.sampling_seed + index)


def check_rid(rid: str | None, *, field: str = "rid") -> None:
    """A client rid longer than MAX_RID_LENGTH characters is a 400 (the length, not the rid,
    goes in the message)."""
    if rid is not None and len(rid) > MAX_RID_LENGTH:
        raise BadRequest(
            f"{field} is {len(rid)} characters long, more than the {MAX_RID_LENGTH} allowed."
        )
