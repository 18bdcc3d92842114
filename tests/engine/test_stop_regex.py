"""stop_regex through the engine: SGLang's finish_reason, trimmed text, and streams that
never show what is trimmed. Sim runner under the autojump clock, plus one real-model test."""

from __future__ import annotations

import re

import pytest
import trio

from tributary import engine
from tributary.engine import (
    Done,
    EngineConfig,
    Frame,
    GenerateRequest,
    InvalidSamplingParams,
    SamplingParams,
)
from tributary.testing import assert_engine_idle

# The sim runner's tokens are bytes: id = byte + 3.
SIM_BYTE_OFFSET = 3


@pytest.fixture
def eng(tributary_engine: engine.Engine) -> engine.Engine:
    """The plugin's sim engine (`tributary.testing`): the sim runner, a 4096-token context."""
    return tributary_engine


def request(text: str = "seed", **sampling: object) -> GenerateRequest:
    params = {"temperature": 0, "max_new_tokens": 24, **sampling}
    return GenerateRequest(text=text, sampling=SamplingParams.from_dict(params))


async def outputs(eng: engine.Engine, req: GenerateRequest) -> tuple[list[Frame], Done]:
    """Every Frame of a request and its Done (stream_interval 1: one Frame per token)."""
    async with eng.submit(req) as stream:
        items = [item async for item in stream]
    *frames, done = items
    assert all(isinstance(f, Frame) for f in frames) and isinstance(done, Done), items
    return frames, done  # type: ignore[return-value]


def first_stop(text: str, pattern: str) -> tuple[int, int, int] | None:
    """SGLang's rule on a byte-per-token model: after token i (text[: i + 1]) search the
    generated text. Returns (stopping token index, match start, match end)."""
    for i in range(len(text)):
        if m := re.search(pattern, text[: i + 1]):
            return i, m.start(), m.end()
    return None


async def test_regex_stop_finish_reason_and_trimmed_text(
    eng: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    free_frames, free = await outputs(eng, request())
    text = "".join(f.text for f in free_frames) + free.text
    # A three-character match in the middle of the greedy text, found by a real regex.
    pattern = re.escape(text[8]) + "." + re.escape(text[10])
    stop = first_stop(text, pattern)
    assert stop is not None
    token, start, end = stop
    frames, done = await outputs(eng, request(stop_regex=pattern))
    kept_frames, kept = await outputs(eng, request(stop_regex=[pattern], no_stop_trim=True))
    assert done.finish_reason == {"type": "stop", "matched": pattern}
    assert done.completion_tokens == token + 1
    assert "".join(f.text for f in frames) + done.text == text[:start]
    # no_stop_trim keeps the match and nothing after it.
    assert kept.finish_reason == {"type": "stop", "matched": pattern}
    assert "".join(f.text for f in kept_frames) + kept.text == text[:end]


async def test_streamed_frames_never_show_trimmed_text(
    eng: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    frames, done = await outputs(eng, request(max_new_tokens=40))
    text = "".join(f.text for f in frames) + done.text
    checked = 0
    for i in range(6, 30, 3):
        # Literal three-character matches: the first two characters of each are held in
        # the frames of their tokens, then dropped by the Done.
        pattern = re.escape(text[i : i + 3])
        stop = first_stop(text, pattern)
        assert stop is not None
        _, start, _ = stop
        frames, done = await outputs(eng, request(max_new_tokens=40, stop_regex=pattern))
        shown = ""
        for frame in frames:
            shown += frame.text
            assert text[:start].startswith(shown)  # never a character of the match
        assert shown + done.text == text[:start]
        assert frames[-1].text == frames[-2].text == ""  # held while the match was partial
        checked += 1
    assert checked == 8


async def test_empty_list_is_no_regex_and_prompt_is_never_searched(
    eng: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    plain = await outputs(eng, request())
    empty = await outputs(eng, request(stop_regex=[]))  # as SGLang's frontend sends it
    # The sim model writes letters and spaces only: a digit in the prompt never stops it.
    digits = await outputs(eng, request("12345", stop_regex=r"\d"))
    assert [f.text for f in empty[0]] == [f.text for f in plain[0]]
    assert empty[1].finish_reason == plain[1].finish_reason == {"type": "length", "length": 24}
    assert digits[1].finish_reason == {"type": "length", "length": 24}


async def test_unbounded_regex_stops_at_the_first_matching_token(
    eng: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    seven = str(ord("7") + SIM_BYTE_OFFSET)
    # logit_bias forces "7" from token 4 on: min_new_tokens makes the first 3 plain text.
    frames, done = await outputs(
        eng, request(stop_regex=r"\d+", logit_bias={seven: 100}, min_new_tokens=3)
    )
    # Tokens 1-3 ("777") came while checks were off; token 4 extends the match into checked
    # text, so the whole run of digits is cut, and none of it was ever streamed.
    assert done.finish_reason == {"type": "stop", "matched": r"\d+"}
    assert done.completion_tokens == 4
    assert [f.text for f in frames] == ["", "", ""] and done.text == ""


async def test_invalid_pattern_is_refused_at_submit(
    eng: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        eng.submit(request(stop_regex=["ok", "(unclosed"]))
    assert eng.stats().waiting == eng.stats().running == 0
    assert_engine_idle(eng)
    assert info.value.http_status == 400
    assert info.value.message.startswith("invalid stop_regex '(unclosed': missing )")


CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.model
async def test_real_model_stops_at_a_regex() -> None:
    prompt = CHAT.format("What is the capital of France? Answer in one sentence.")
    async with engine.open_engine(EngineConfig(context_length=2048)) as eng:
        free = await outputs(eng, request(prompt, max_new_tokens=64))
        frames, done = await outputs(eng, request(prompt, max_new_tokens=64, stop_regex=r"[.!?]"))
        kept = await outputs(
            eng, request(prompt, max_new_tokens=64, stop_regex=r"[.!?]", no_stop_trim=True)
        )
    text = "".join(f.text for f in free[0]) + free[1].text
    m = re.search(r"[.!?]", text)
    assert m is not None, text
    assert done.finish_reason == {"type": "stop", "matched": r"[.!?]"}
    assert "".join(f.text for f in frames) + done.text == text[: m.start()]
    assert "".join(f.text for f in kept[0]) + kept[1].text == text[: m.end()]
    assert done.completion_tokens < free[1].completion_tokens
