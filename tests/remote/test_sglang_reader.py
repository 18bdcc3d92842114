"""The SGLang upstream parser on frames shaped as SGLang sends them (the contract doc, 5):
cumulative and incremental text, abort frames with the whole text and the last id, error
frames, and the sampling params passed through."""

from __future__ import annotations

from typing import Any

from tributary.engine import Done, Error, Frame, GenerateRequest, SamplingParams
from tributary.engine.remote.openai import unsupported_fields
from tributary.engine.remote.sglang import GenerateStreamReader, generate_body
from tributary.engine.remote.wire import SSEPayloads


def frame(text: str, ids: list[int], completion: int, finish: Any = None, **meta: Any) -> Any:
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": "r",
            "finish_reason": finish,
            "prompt_tokens": 3,
            "completion_tokens": completion,
            "cached_tokens": 0,
            **meta,
        },
    }


def read_all(frames: list[Any]) -> list[Any]:
    reader = GenerateStreamReader("r")
    return [reader.read(f) for f in frames]


STOP = {"type": "stop", "matched": 2}


def test_cumulative_and_incremental_streams_give_the_same_deltas() -> None:
    cumulative = [
        frame(" Pa", [11], 1),
        frame(" Paris", [11, 12], 2),
        frame(" Paris.", [11, 12, 13], 3, STOP, e2e_latency=0.05),
    ]
    incremental = [
        frame(" Pa", [11], 1),
        frame("ris", [12], 2),
        frame(".", [13], 3, STOP, e2e_latency=0.05),
    ]
    for frames in (cumulative, incremental):
        items = read_all(frames)
        assert [type(i) for i in items] == [Frame, Frame, Done]
        assert [i.text for i in items] == [" Pa", "ris", "."]
        assert [i.output_ids for i in items] == [[11], [12], [13]]
        assert items[-1].finish_reason == STOP
        assert items[-1].worker_e2e_latency == 0.05


def test_an_abort_frame_carries_the_whole_text_and_the_last_id() -> None:
    abort = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    items = read_all(
        [frame(" a", [5], 1), frame(" a b", [5, 6], 2), frame(" a b c", [7], 3, abort)]
    )
    assert [i.text for i in items] == [" a", " b", " c"]
    assert items[-1].output_ids == [7] and items[-1].finish_reason == abort


def test_error_frames_keep_their_status() -> None:
    reader = GenerateStreamReader("r")
    item = reader.read({"error": {"message": "bad", "code": 503}})
    assert isinstance(item, Error) and item.error.http_status == 503
    old = reader.read({"error": {"message": "too long"}})  # older SGLang: a ValueError, 400
    assert isinstance(old, Error) and old.error.http_status == 400
    assert old.error.message == "too long"


def test_the_body_passes_the_prompt_and_sampling_through() -> None:
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 7, "stop": ["x"]})
    body = generate_body(GenerateRequest(input_ids=[1, 2], sampling=params), "rid-1")
    assert body == {
        "rid": "rid-1",
        "stream": True,
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 7, "stop": ["x"], "top_k": 1},  # greedy
    }
    assert unsupported_fields(GenerateRequest(text="t", sampling=params)) == []
    regex = SamplingParams.from_dict({"regex": "a+"})
    assert unsupported_fields(GenerateRequest(text="t", sampling=regex)) == ["regex"]


def test_sse_events_cut_anywhere_come_out_whole() -> None:
    body = (
        b'data: {"a": 1}\n\n: a comment\n\n'
        b"event: x\r\ndata: two\r\ndata: lines\r\n\r\ndata: [DONE]\n\n"
    )
    for size in (1, 2, 7, len(body)):
        payloads = SSEPayloads()
        out = [p for i in range(0, len(body), size) for p in payloads.feed(body[i : i + size])]
        assert out == [b'{"a": 1}', b"two\nlines", b"[DONE]"], size
