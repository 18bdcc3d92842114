"""SGLang's `POST /encode` (also PUT): embeddings of `text` or `input_ids`, in SGLang's shape.

Synopsis::

    POST /encode {"text": "Hello"}            -> {"embedding": [...], "meta_info": {...}}
    POST /encode {"input_ids": [[1, 2], [3]]} -> [{"embedding": [...], "meta_info": {...}}, ...]

The body is SGLang's `EmbeddingReqInput` (`EncodeBody`): one of `text` (a string or a list)
or `input_ids` (a token list or a list of them), `rid` (one, or one per input). Each output
is `{"embedding", "meta_info": {"id", "prompt_tokens", "e2e_latency"}}`, a list for a batch.
Vectors are the engine's (`EmbeddingService`): L2-normalised, pooled as the GGUF or
`--pooling` says. Errors are SGLang's `{"error": {"message", "code"}}` (the app's handlers).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import msgspec
from msgspec import Meta
from quart import Response

from tributary.engine import TokenizerService
from tributary.engine.capabilities import EmbeddingService
from tributary.engine.wire import convert

from ..generation import check_rid
from ..generation.embeddings import (
    IDS_SCHEMAS,
    TEXT_SCHEMAS,
    check_dimensions,
    embed_inputs,
    embedding_inputs,
)
from ..http.errors import InvalidRequest
from ..http.limits import Deadline
from ..http.responses import json_response
from ..observe.timing import RequestSink

__all__ = ["EncodeBody", "handle_encode"]


def _doc(description: str, **schema: Any) -> Meta:
    return Meta(description=description, extra_json_schema=schema or None)


class EncodeBody(msgspec.Struct, kw_only=True):
    """SGLang's EmbeddingReqInput, as far as this server reads it."""

    text: Annotated[
        Any,
        _doc(
            "A string, or a list of strings (a batch); or give input_ids.",
            anyOf=TEXT_SCHEMAS,
        ),
    ] = None
    input_ids: Annotated[
        Any,
        _doc(
            "Token ids, or a list of token-id lists (a batch); or give text.",
            anyOf=IDS_SCHEMAS,
        ),
    ] = None
    rid: Annotated[
        str | list[str] | None, _doc("The request id (meta_info.id); one per input for a batch.")
    ] = None
    dimensions: Annotated[
        int | None,
        _doc("Matryoshka truncation: a 400 for the models served here, as for /v1/embeddings."),
    ] = None
    image_data: Annotated[Any, _doc("Not supported by this server yet: a 400 when set.")] = None


def _fault(key: str, value: Any) -> Any:
    words = {"rid": "a string or a list of strings", "dimensions": "an integer"}[key]
    raise InvalidRequest(f"{key} must be {words}, got {value!r:.80}.", param=key)


def parse_encode(raw: Any, model_name: str) -> tuple[list[str | list[int]], bool, list[str]]:
    """The inputs, whether they were a batch, and each one's rid; a 400 for what is wrong."""
    if not isinstance(raw, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    body = convert(raw, EncodeBody, fault=_fault, order="declared")
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequest("Either text or input_ids should be provided.")
    if body.image_data is not None:
        raise InvalidRequest("image_data is not supported by this server yet.", param="image_data")
    if body.text is not None:
        inputs, batched = embedding_inputs(body.text, "text", ids=False)
    else:
        inputs, batched = embedding_inputs(body.input_ids, "input_ids", texts=False)
    check_dimensions(body.dimensions, model_name)
    return inputs, batched, _rids(body.rid, len(inputs), batched)


def _rids(rid: str | list[str] | None, count: int, batched: bool) -> list[str]:
    """Each input's rid: the body's, or fresh ones (SGLang's uuid4 hex)."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        if batched:
            raise InvalidRequest("The rid should be a list for batch processing.", param="rid")
        rids = [rid]
    elif not batched or len(rid) != count:
        raise InvalidRequest("The rid should have the same length as the inputs.", param="rid")
    else:
        rids = list(rid)
    for one in rids:
        check_rid(one)
    return rids


async def handle_encode(
    service: EmbeddingService | None,
    tokenizer: TokenizerService,
    raw: Any,
    exchange: RequestSink | None,
    *,
    model_name: str,
    deadline: Deadline,
    unavailable: str,
) -> Response:
    """The response to one `/encode` body (EngineErrors for what fails)."""
    inputs, batched, rids = parse_encode(raw, model_name)
    done = await embed_inputs(
        service,
        tokenizer,
        inputs,
        exchange,
        deadline=deadline,
        unavailable=unavailable,
        rids=rids,
    )
    outputs = [
        {
            "embedding": vector.tolist(),
            "meta_info": {"id": rid, "prompt_tokens": tokens, "e2e_latency": done.e2e_latency},
        }
        for vector, rid, tokens in zip(done.vectors, rids, done.prompt_tokens, strict=True)
    ]
    return json_response(outputs if batched else outputs[0])
