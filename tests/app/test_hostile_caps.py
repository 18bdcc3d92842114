"""Every per-request cost a client controls is bounded.

- Logprobs: `top_logprobs_num` at most `--max-logprobs` (20), `token_ids_logprob` at most
  128 distinct ids; streams never resend a logprob position (a stream costs O(N x k) entries,
  not SGLang's O(N^2 x k)).
- Stop lists: at most 64 stop strings of 256 characters, 1,024 stop_token_ids, 32 stop
  regexes of 256 bytes.
- `rid`: at most 256 characters (it is echoed in every frame and access log line).

Each attack is reproduced at a bounded size and must be a fast 400 that names the cap; the
same requests at the cap still work. On the sim model (its logprob hooks are the real ones).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from apphelpers import greedy, parse_sse, running_server, server_settings, sim_config

from tributary.app.cli import build_parser, configs

#: A fast 400 is decided before anything runs: well under this on a busy 2-core machine.
FAST = 2.0


async def refused(client: httpx.AsyncClient, body: Any, path: str = "/generate") -> str:
    """POST `body`; assert a fast 400 and return its message."""
    started = time.perf_counter()
    response = await client.post(path, json=body)
    elapsed = time.perf_counter() - started
    assert response.status_code == 400, response.text[:500]
    assert elapsed < FAST, elapsed
    assert len(response.content) < 2000  # the message names the cap, never echoes the input
    return response.json()["error"]["message"]


def logprob_body(**extra: Any) -> dict[str, Any]:
    return {
        "text": "hi",
        "sampling_params": greedy(4),
        "return_logprob": True,
        **extra,
    }


# -- logprobs ---------------------------------------------------------------------------------


async def test_the_129_byte_top_logprobs_attack_is_a_fast_400(client: httpx.AsyncClient) -> None:
    # 478 MB of answer and 2.7 GB of server memory before the cap.
    attack = {
        "text": "hi",
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 49152,
    }
    assert len(json.dumps(attack)) < 130
    message = await refused(client, attack)
    assert "top_logprobs_num is 49152" in message and "20" in message
    assert "--max-logprobs" in message
    # Per prompt in a batch too.
    body = {**logprob_body(), "text": ["a", "b"], "top_logprobs_num": [1, 21]}
    assert "top_logprobs_num is 21" in await refused(client, body)


async def test_token_ids_logprob_is_capped_and_refuses_duplicates(
    client: httpx.AsyncClient,
) -> None:
    message = await refused(client, logprob_body(token_ids_logprob=list(range(129))))
    assert "129 ids" in message and "128" in message
    message = await refused(client, logprob_body(token_ids_logprob=[5] * 100_000))
    assert "100000 ids" in message
    message = await refused(client, logprob_body(token_ids_logprob=[3, 7, 3]))
    assert "token id 3 more than once" in message
    body = {**logprob_body(), "text": ["a", "b"], "token_ids_logprob": [[1], list(range(200))]}
    assert "200 ids" in await refused(client, body)


async def test_logprob_requests_at_the_caps_work(client: httpx.AsyncClient) -> None:
    body = logprob_body(top_logprobs_num=20, token_ids_logprob=list(range(128)))
    response = await client.post("/generate", json=body)
    assert response.status_code == 200, response.text[:300]
    meta = response.json()["meta_info"]
    assert [len(top) for top in meta["output_top_logprobs"]] == [20] * 4
    assert [len(ids) for ids in meta["output_token_ids_logprobs"]] == [128] * 4


async def test_openai_logprobs_stay_within_openai_bounds(client: httpx.AsyncClient) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "logprobs": 21}
    message = await refused(client, body, "/v1/completions")
    assert "between 0 and 20" in message
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 49152,
    }
    assert "between 0 and 20" in await refused(client, chat, "/v1/chat/completions")
    ok = await client.post("/v1/completions", json={**body, "logprobs": 20})
    assert ok.status_code == 200, ok.text[:300]


async def test_max_logprobs_flag_lowers_the_cap_everywhere() -> None:
    _, settings = configs(build_parser().parse_args(["serve", "--max-logprobs", "5"]))
    assert settings.max_logprobs == 5
    with pytest.raises(ValueError, match="max_logprobs"):
        server_settings(max_logprobs=-1)
    async with (
        running_server(sim_config(), server_settings(max_logprobs=5)) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        message = await refused(client, logprob_body(top_logprobs_num=6))
        assert "more than the 5 this server allows" in message
        body = {"prompt": "hi", "max_tokens": 2, "logprobs": 6}
        assert "between 0 and 5" in await refused(client, body, "/v1/completions")
        ok = await client.post("/generate", json=logprob_body(top_logprobs_num=5))
        assert ok.status_code == 200


def entries(meta: dict[str, Any]) -> int:
    """Logprob entries in one frame's meta_info (every family, input and output)."""
    count = 0
    for key, value in meta.items():
        if key.endswith("_logprobs") and isinstance(value, list):
            for position in value:
                if position is None:
                    continue
                count += len(position) if isinstance(position[0], list) else 1
    return count


@pytest.mark.parametrize("incremental", [False, True])
async def test_a_stream_sends_each_logprob_position_once(incremental: bool) -> None:
    """A stream of N tokens with k alternatives (and a scored prompt of P tokens) sends
    O((N + P) x k) entries in all: SGLang's cumulative stream resends every position in every
    frame (O(N^2 x k): a 1,500-token stream at k = 20 sent 736 MB against 0.97 MB unary),
    and both of its modes repeat the prompt's in every frame (O(N x P x k))."""
    tokens, top, prompt = 120, 20, "x" * 60
    body = {
        "text": prompt,
        "sampling_params": greedy(tokens, ignore_eos=True),
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": top,
        "token_ids_logprob": [1, 2],
    }
    settings = server_settings(incremental_streaming_output=incremental)
    async with (
        running_server(sim_config(), settings) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as client,
    ):
        unary = (await client.post("/generate", json=body)).json()
        stream = await client.post("/generate", json={**body, "stream": True})
    frames = parse_sse(stream.text)[:-1]
    assert len(frames) > tokens / 4  # it did stream
    once = entries(unary["meta_info"])  # every position, as the unary answer has them
    sent = sum(entries(f["meta_info"]) for f in frames)
    # The first frame and the last one may carry the prompt's; nothing else twice.
    assert sent <= 2 * once, (sent, once)
    assert len(stream.content) < 4 * len(json.dumps(unary)) + 1000 * len(frames)
    last = frames[-1]["meta_info"]
    if not incremental:  # the terminal frame is the whole answer, as the unary one
        logprob_keys = [k for k in unary["meta_info"] if "logprobs" in k]
        assert {k: last[k] for k in logprob_keys} == {
            k: unary["meta_info"][k] for k in logprob_keys
        }
    else:  # the deltas join up to the unary answer
        for family in ("output_token_logprobs", "output_top_logprobs"):
            joined = [x for f in frames for x in f["meta_info"][family]]
            assert joined == unary["meta_info"][family]


# -- stop lists -------------------------------------------------------------------------------


async def test_stop_lists_over_their_caps_are_fast_400s(client: httpx.AsyncClient) -> None:
    def body(**sampling: Any) -> dict[str, Any]:
        return {"text": "hi", "sampling_params": {"max_new_tokens": 4, **sampling}}

    # 230,000 stop strings cost 87 ms a token before the cap.
    message = await refused(client, body(stop=[f"s{i}" for i in range(230_000)]))
    assert message == "at most 64 stop strings are allowed, got 230000"
    message = await refused(client, body(stop=["s"] * 65))
    assert "at most 64 stop strings" in message
    message = await refused(client, body(stop=["x" * 257]))
    assert "257 characters long, over the 256-character limit" in message
    message = await refused(client, body(stop_token_ids=list(range(200)) * 6))
    assert message == "at most 1024 stop_token_ids are allowed, got 1200"
    message = await refused(client, body(stop_regex=["a"] * 33))
    assert "at most 32 stop_regex patterns" in message
    message = await refused(client, body(stop_regex="a" * 257))
    assert "257 bytes, over the 256-byte limit" in message
    # /v1 applies the same caps.
    v1 = {"prompt": "hi", "max_tokens": 2, "stop": ["s"] * 65}
    assert "at most 64 stop strings" in await refused(client, v1, "/v1/completions")


async def test_stop_lists_at_their_caps_work(client: httpx.AsyncClient) -> None:
    sampling = {
        "max_new_tokens": 8,
        "stop": [chr(0x100 + i) * 256 for i in range(64)],  # 256 characters, 512 bytes
        "stop_token_ids": [i % 250 for i in range(1024)],  # the sim model has 259 tokens
        "stop_regex": [f"q{'z' * 250}{i}" for i in range(32)],
        "ignore_eos": True,
    }
    response = await client.post("/generate", json={"text": "hi", "sampling_params": sampling})
    assert response.status_code == 200, response.text[:300]


# -- rid --------------------------------------------------------------------------------------


async def test_rid_is_capped(client: httpx.AsyncClient) -> None:
    message = await refused(client, {"text": "hi", "rid": "r" * 257})
    assert message == "rid is 257 characters long, more than the 256 allowed."
    # The 2 MB batch body that came back as 400 MB (the rid is every item's prefix), bounded.
    attack = {"text": ["hi"] * 50, "rid": "r" * 2_000_000, "sampling_params": {"max_new_tokens": 1}}
    assert "2000000 characters" in await refused(client, attack)
    batch = {"text": ["a", "b"], "rid": ["ok", "r" * 300]}
    assert "300 characters" in await refused(client, batch)
    v1 = {"prompt": "hi", "max_tokens": 1, "rid": "r" * 257}
    assert "257 characters" in await refused(client, v1, "/v1/completions")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "rid": "r" * 257}
    assert "257 characters" in await refused(client, chat, "/v1/chat/completions")
    # At the cap, a rid is echoed whole.
    rid = "r" * 256
    response = await client.post(
        "/generate", json={"text": "hi", "rid": rid, "sampling_params": {"max_new_tokens": 1}}
    )
    assert response.json()["meta_info"]["id"] == rid
    response = await client.post(
        "/generate",
        json={"text": ["a", "b"], "rid": rid, "sampling_params": {"max_new_tokens": 1}},
    )
    assert [item["meta_info"]["id"] for item in response.json()] == [rid + "_0", rid + "_1"]
