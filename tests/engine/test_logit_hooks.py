"""What the per-request logits work does when clients push it: a custom processor that fails
(however it fails) ends only its own request, it sees the logits after logit_bias as in
SGLang, NaN or +inf it writes is never sampled or reported (+inf forces its token, at any
temperature), a bias that would overflow float32 under temperature scaling is a 400, and
a stop regex that backtracks catastrophically is cut off instead of stalling the scheduler.
Sim runner, whose hooks see a logits row (engine/runners/sim.py)."""

from __future__ import annotations

import math
import time

import pytest
import trio

from tributary import engine
from tributary.engine import (
    Done,
    EngineConfig,
    Error,
    GenerateRequest,
    InvalidSamplingParams,
    LogprobRequest,
    SamplingParams,
)
from tributary.engine.custom_logit_processor import CustomLogitProcessor
from tributary.testing import assert_engine_idle

SIM_BYTE_OFFSET = 3  # sim token ids are bytes + 3
X = ord("x") + SIM_BYTE_OFFSET
Y = ord("y") + SIM_BYTE_OFFSET


def processor(source: str) -> str:
    """SGLang's wire form of a processor class defined in `source` (as `P`), pickled by value
    the way a client script's class is."""
    namespace = {"__name__": "__main__", "CustomLogitProcessor": CustomLogitProcessor}
    exec(source, namespace)
    return namespace["P"].to_str()  # type: ignore[attr-defined, no-any-return]


RAISES_SYSTEM_EXIT = processor(
    "class P(CustomLogitProcessor):\n"
    "    def __call__(self, logits, params):\n"
    "        raise SystemExit(3)\n"
)
KEEPS_ONLY_ITS_ARGMAX = processor(
    "class P(CustomLogitProcessor):\n"
    "    def __call__(self, logits, params):\n"
    "        top = int(logits[0].argmax())\n"
    "        logits[0, :] = -float('inf')\n"
    "        logits[0, top] = 0.0\n"
    "        return logits\n"
)
NAN_BUT_ONE = processor(
    "class P(CustomLogitProcessor):\n"
    "    def __call__(self, logits, params):\n"
    "        logits[0, :] = float('nan')\n"
    "        logits[0, params[0]['token_id']] = float('inf')\n"
    "        return logits\n"
)


# The sim tests run on the plugin's engine (`tributary.testing`), with these fields.
pytestmark = pytest.mark.tributary_config(context_length=1024, enable_custom_logit_processor=True)


@pytest.fixture
def eng(tributary_engine: engine.Engine) -> engine.Engine:
    return tributary_engine


def request(
    *, custom: str | None = None, logprobs: LogprobRequest | None = None, **sampling: object
) -> GenerateRequest:
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 4, **sampling})
    return GenerateRequest(
        text="seed", sampling=params, custom_logit_processor=custom, logprobs=logprobs
    )


async def last(eng: engine.Engine, req: GenerateRequest) -> tuple[list[int], Done | Error]:
    ids: list[int] = []
    async with eng.submit(req) as stream:
        async for item in stream:
            if not isinstance(item, Error):
                ids += item.output_ids
    return ids, item


async def test_a_processor_that_exits_fails_only_its_request(
    eng: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    results: list[tuple[list[int], Done | Error]] = []

    async def run(req: GenerateRequest) -> None:
        results.append(await last(eng, req))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, request(custom=RAISES_SYSTEM_EXIT))
        nursery.start_soon(run, request(max_new_tokens=6))
    failed = [r for _, r in results if isinstance(r, Error)]
    done = [(ids, r) for ids, r in results if isinstance(r, Done)]
    assert len(failed) == 1 and failed[0].error.http_status == 400
    assert "SystemExit" in failed[0].error.message
    assert len(done) == 1 and len(done[0][0]) == 6
    ids, after = await last(eng, request())
    assert isinstance(after, Done) and len(ids) == 4  # the engine still serves
    assert_engine_idle(eng)  # and the failed request left nothing behind


async def test_the_processor_sees_logits_after_logit_bias(
    eng: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    plain, _ = await last(eng, request(custom=KEEPS_ONLY_ITS_ARGMAX))
    assert X not in plain
    biased, _ = await last(eng, request(custom=KEEPS_ONLY_ITS_ARGMAX, logit_bias={str(X): 100.0}))
    assert biased == [X] * 4


async def test_nan_and_inf_from_a_processor_are_never_sampled_nor_reported(
    eng: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    req = request(
        custom=NAN_BUT_ONE, custom_params={"token_id": Y}, logprobs=LogprobRequest(top_n=2)
    )
    async with eng.submit(req) as stream:
        items = [item async for item in stream]
    assert all(isinstance(i, engine.Frame | Done) for i in items)
    ids = [t for i in items for t in i.output_ids]  # type: ignore[union-attr]
    assert ids == [Y] * 4
    scores = [lp for i in items for lp in i.logprobs.output_token]  # type: ignore[union-attr]
    assert [t for _, t in scores] == ids
    assert all(lp is not None and math.isfinite(lp) and lp <= 0 for lp, _ in scores)


def test_a_bias_that_could_overflow_float32_is_a_400() -> None:
    for huge in (1e39, 3e38, 1e31):  # 3e38 fits float32, but not once divided by 0.5
        with pytest.raises(InvalidSamplingParams, match="within"):
            SamplingParams.from_dict({"logit_bias": {"5": huge}})
    SamplingParams.from_dict({"logit_bias": {"5": 1e30}})


FORCES_WITH_INF = processor(
    "class P(CustomLogitProcessor):\n"
    "    def __call__(self, logits, params):\n"
    "        logits[0, params[0]['token_id']] = float('inf')\n"
    "        return logits\n"
)


@pytest.mark.model
async def test_inf_from_a_processor_forces_its_token_at_any_temperature() -> None:
    """On the real sampler chain: +inf divided by a temperature below 1 stayed inf, the
    softmax gave NaN, and llama.cpp sampled the last vocabulary id instead."""
    cfg = EngineConfig(context_length=512, threads=1, enable_custom_logit_processor=True)
    async with engine.open_engine(cfg) as eng:
        forced = eng.tokenize(" Paris")[0]
        for temperature in (1.0, 0.5):
            params = SamplingParams.from_dict(
                {
                    "temperature": temperature,
                    "max_new_tokens": 4,
                    "sampling_seed": 1,
                    "custom_params": {"token_id": forced},
                }
            )
            req = GenerateRequest(
                text="The capital of France is",
                sampling=params,
                custom_logit_processor=FORCES_WITH_INF,
            )
            ids, done = await last(eng, req)
            assert isinstance(done, Done)
            assert ids == [forced] * 4, temperature


async def test_catastrophic_stop_regexes_are_cut_off(
    eng: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    # 32 patterns that backtrack exponentially on a run of "x" not followed by a digit: with
    # a limit per search instead of per token, one token took seconds here.
    patterns = [r"(?:x|xx)+[0-9]" + "(?:)" * i for i in range(32)]
    req = request(max_new_tokens=60, logit_bias={str(X): 100.0}, stop_regex=patterns)
    started = time.monotonic()
    ids, done = await last(eng, req)
    # Bounded: 20 ms of searching a token (a limit per search let one token take 3 s).
    assert time.monotonic() - started < 1.5
    assert isinstance(done, Done)
    reason = done.finish_reason
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "catastrophic backtracking" in reason["message"]
    assert 0 < len(ids) < 60
    _, after = await last(eng, request())
    assert isinstance(after, Done)
    assert_engine_idle(eng)
