"""N-gram speculative decoding on the real model: a request asked to repeat code gets drafts
accepted, and what it generates is what the same request without speculation generates
(greedy, and seeded sampling); requests whose logits hooks see each position (logprobs, a
grammar) are served as before by a server that speculates."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tributary import engine
from tributary.engine import Done, EngineConfig, GenerateRequest, LogprobRequest, SamplingParams

pytestmark = pytest.mark.model

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
CODE = """def merge_sorted(a, b):
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result
"""
REPEAT = CHAT.format("Repeat this code exactly, renaming merge_sorted to merge_lists:\n\n" + CODE)
CONFIG = EngineConfig(
    context_length=1024,
    max_running_requests=2,
    threads=2,
    speculative_algorithm="NGRAM",
    speculative_num_draft_tokens=8,
)


class Result:
    def __init__(self, ids: list[int], text: str, scored: int, done: Done) -> None:
        self.output_ids = ids  # the whole output, every frame's
        self.scored = scored  # output positions with a logprob, every frame's
        self.text = text
        self.completion_tokens = done.completion_tokens
        self.speculative = done.speculative


async def generate(
    eng: engine.Engine, text: str, logprobs: LogprobRequest | None = None, **sampling: object
) -> Result:
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 64, **sampling})
    ids: list[int] = []
    scored = 0
    out = ""
    req = GenerateRequest(text=text, sampling=params, logprobs=logprobs, stream=False)
    async with eng.submit(req) as s:
        async for item in s:
            assert not isinstance(item, engine.Error), item.error
            ids += item.output_ids
            out += item.text
            scored += len(item.logprobs.output_token) if item.logprobs else 0
    assert isinstance(item, Done)
    return Result(ids, out, scored, item)


async def test_speculation_keeps_the_output_and_accepts_drafts() -> None:
    async with engine.open_engine(CONFIG) as eng:
        plain = await generate(eng, REPEAT, speculative_num_draft_tokens=0)
        spec = await generate(eng, REPEAT)
        assert plain.speculative is None
        assert spec.speculative is not None
        # The model copies the code: most of its tokens come from accepted drafts.
        assert spec.speculative.accepted_tokens > len(spec.output_ids) // 3
        assert spec.output_ids == plain.output_ids
        assert "result.append(a[i])" in spec.text or spec.completion_tokens == 64

        # Seeded sampling draws the same tokens, with and without drafts, twice over.
        seeded = {"temperature": 0.7, "sampling_seed": 11}
        a = await generate(eng, REPEAT, **seeded)
        b = await generate(eng, REPEAT, **seeded)
        c = await generate(eng, REPEAT, speculative_num_draft_tokens=0, **seeded)
        assert a.speculative is not None and a.speculative.draft_tokens > 0
        assert a.output_ids == b.output_ids == c.output_ids

        stats = eng.stats()
        assert stats.spec_draft_tokens == sum(
            d.speculative.draft_tokens for d in (spec, a, b) if d.speculative
        )
        assert stats.spec_accepted_tokens >= spec.speculative.accepted_tokens


async def test_logprobs_and_grammars_are_served_without_drafts() -> None:
    async with engine.open_engine(CONFIG) as eng:
        scored = await generate(eng, REPEAT, logprobs=LogprobRequest(top_n=2), max_new_tokens=24)
        assert scored.speculative is None  # hooks see each position: it never drafts
        assert scored.scored == 24
        plain = await generate(eng, REPEAT, max_new_tokens=24, speculative_num_draft_tokens=0)
        assert scored.output_ids == plain.output_ids
        shaped = await generate(
            eng, CHAT.format("A phone number?"), regex=r"[0-9]{3}-[0-9]{4}", max_new_tokens=16
        )
        assert shaped.speculative is None
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", shaped.text)
        assert eng.stats().spec_draft_tokens == 0


async def test_without_decoding_ahead_the_whole_draft_is_verified_in_one_decode() -> None:
    """Without overlap no logits wait for position 0: [last, d1 .. dk] is decoded at once."""
    config = dataclasses.replace(CONFIG, overlap_decode=False)
    async with engine.open_engine(config) as eng:
        plain = await generate(eng, REPEAT, max_new_tokens=40, speculative_num_draft_tokens=0)
        spec = await generate(eng, REPEAT, max_new_tokens=40)
        assert spec.speculative is not None and spec.speculative.accepted_tokens > 10
        assert spec.output_ids == plain.output_ids
