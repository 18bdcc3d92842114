"""SGLang's response objects: `{text, output_ids, meta_info[, index]}`, built from engine items.

Key order is part of the contract (clients and parity fixtures compare bytes), so objects are
built as ordered dicts and encoded with `encode_json`, never through a key-sorting encoder.

`meta_info` keys, in order::

    id, finish_reason, prompt_tokens, weight_version, num_retractions, reasoning_tokens,
    completion_tokens, cached_tokens[, e2e_latency]

`finish_reason` is null on non-terminal stream frames, and `e2e_latency` appears only on a
terminal output.
"""

from __future__ import annotations

import json
from typing import Any

from quart import Response
from tributary.engine import Done, FinishReason, Frame

__all__ = ["OutputAccumulator", "encode_json", "json_response", "output_object"]


def encode_json(obj: Any) -> str:
    """Compact JSON in insertion order, as SGLang's orjson encoding."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        encode_json(obj), status=status, headers=headers, content_type="application/json"
    )


def output_object(
    *,
    rid: str,
    text: str,
    output_ids: list[int],
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    finish_reason: FinishReason | None,
    weight_version: str,
    e2e_latency: float | None = None,
    index: int | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "weight_version": weight_version,
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
    }
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    obj: dict[str, Any] = {"text": text, "output_ids": output_ids, "meta_info": meta}
    if index is not None:
        obj["index"] = index
    return obj


class OutputAccumulator:
    """Folds one request's deltas into its cumulative output."""

    def __init__(self, rid: str, prompt_tokens: int, *, weight_version: str) -> None:
        self.rid = rid
        self.weight_version = weight_version
        self.text = ""
        self.output_ids: list[int] = []
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0

    def add(self, item: Frame | Done) -> None:
        self.text += item.text
        self.output_ids.extend(item.output_ids)
        self.prompt_tokens = item.prompt_tokens
        self.completion_tokens = item.completion_tokens
        self.cached_tokens = item.cached_tokens

    def cumulative(
        self,
        *,
        finish_reason: FinishReason | None = None,
        e2e_latency: float | None = None,
        index: int | None = None,
    ) -> dict[str, Any]:
        return self._object(self.text, list(self.output_ids), finish_reason, e2e_latency, index)

    def delta(
        self,
        item: Frame | Done,
        *,
        finish_reason: FinishReason | None = None,
        e2e_latency: float | None = None,
        index: int | None = None,
    ) -> dict[str, Any]:
        """The incremental shape: this item's text and ids, cumulative counts."""
        return self._object(item.text, list(item.output_ids), finish_reason, e2e_latency, index)

    def _object(
        self,
        text: str,
        output_ids: list[int],
        finish_reason: FinishReason | None,
        e2e_latency: float | None,
        index: int | None,
    ) -> dict[str, Any]:
        return output_object(
            rid=self.rid,
            text=text,
            output_ids=output_ids,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            finish_reason=finish_reason,
            weight_version=self.weight_version,
            e2e_latency=e2e_latency,
            index=index,
        )
