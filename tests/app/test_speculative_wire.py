"""Speculative decoding on the wire (sim runner, `--speculative-algorithm NGRAM`): the
request field, the drafted/accepted counts in `--enable-request-timing`'s keys and llama.cpp's
`timings`, and the `/metrics` counters."""

from __future__ import annotations

import pytest
import trio
from apphelpers import META_KEYS

from tributary import app, engine
from tributary.testing import DEFAULT_SIM_LATENCY, AppClient

pytestmark = pytest.mark.tributary_config(
    sim_latency=DEFAULT_SIM_LATENCY, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4
)

FORCE_A = {str(ord("a") + 3): 100}  # the sim samples "a" every time: every draft is kept
SPEC_KEYS = ["spec_verify_ct", "spec_draft_token_num", "spec_accept_token_num", "spec_accept_rate"]


def client(eng: engine.Engine) -> AppClient:
    return AppClient(app.create_app(eng, app.ServerSettings(enable_request_timing=True)))


async def test_counts_in_meta_info_timings_and_metrics(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    c = client(tributary_engine)
    sampling = {"temperature": 0, "max_new_tokens": 11, "logit_bias": FORCE_A}
    reply = await c.post("/generate", {"text": "aaaa", "sampling_params": sampling})
    assert reply.status == 200, reply.text
    body = reply.json()
    assert body["text"] == "a" * 11
    meta = body["meta_info"]
    # After SGLang's keys, e2e_latency and the phases, ending with decode_throughput.
    keys = list(meta)
    assert keys[: len(META_KEYS) + 1] == [*META_KEYS, "e2e_latency"]
    assert keys[-5:] == ["decode_throughput", *SPEC_KEYS]
    # 1 token from the prompt's step, then 4 drafts + 1 a step, twice: 11.
    assert [meta[k] for k in meta if k.startswith("spec_")] == [2, 8, 8, 1.0]

    off = await c.post(
        "/v1/completions",
        {
            "prompt": "aaaa",
            "max_tokens": 5,
            "temperature": 0,
            "logit_bias": FORCE_A,
            "speculative_num_draft_tokens": 0,
        },
    )
    assert off.status == 200, off.text
    assert "draft_n" not in off.json()["timings"]
    on = await c.post(
        "/v1/completions",
        {
            "prompt": "aaaa",
            "max_tokens": 5,
            "temperature": 0,
            "logit_bias": FORCE_A,
            "speculative_num_draft_tokens": 2,
        },
    )
    timings = on.json()["timings"]
    # 1 token, then 2 drafts + 1, then no room for a draft before the fifth.
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (2, 2)

    metrics = (await c.get("/metrics")).text
    for name, value in (("drafts", 3), ("draft_tokens", 10), ("accepted_tokens", 10)):
        line = f'tributary:spec_decode_num_{name}_total{{model_name="sim"}} {value:.1f}'
        assert line in metrics, name


async def test_a_negative_draft_count_is_a_400(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    reply = await client(tributary_engine).post(
        "/generate", {"text": "a", "sampling_params": {"speculative_num_draft_tokens": -1}}
    )
    assert reply.status == 400
    assert "speculative_num_draft_tokens must be at least 0, got -1." in reply.text
