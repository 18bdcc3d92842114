"""`POST /v1/embeddings`: OpenAI's embeddings, computed by the engine (`EmbeddingService`).

Synopsis::

    POST /v1/embeddings {"input": ["a", "b"], "encoding_format": "base64"}
    -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": "..."}, ...],
        "model": "...", "usage": {"prompt_tokens": N, "total_tokens": N}}

`input` is a string, a list of strings, a list of token ids or a list of token-id lists.
Vectors are L2-normalised float32; `base64` is their little-endian float32 bytes (what the
official client asks for by default, and decodes). `dimensions` is refused for every model,
in vLLM's words: no GGUF declares Matryoshka dimensions, and truncating other vectors
degrades them. At a front the body goes to a worker whole (`relay_to_worker`), as chat does.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta
from quart import Response

from tributary.engine.capabilities import EmbeddingService
from tributary.engine.wire import convert

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
from .relay import relay_to_worker
from .served import ServedModel

__all__ = ["EmbeddingBody", "create_embedding", "parse_embedding"]

#: Where an engine computes no embeddings (a runner without them).
NO_EMBEDDINGS = "This engine does not compute embeddings: its runner has none."


def _doc(description: str, **schema: Any) -> Meta:
    return Meta(description=description, extra_json_schema=schema or None)


class EmbeddingBody(msgspec.Struct, kw_only=True):
    """What `/v1/embeddings` reads; unknown keys are ignored, as by vLLM and SGLang."""

    input: Annotated[
        Any,
        _doc(
            "A string, a list of strings, a list of token ids, or a list of token-id lists "
            "(at most 2,048 inputs, none empty, each within the context length).",
            anyOf=[*TEXT_SCHEMAS, *IDS_SCHEMAS],
        ),
    ] = None
    model: Annotated[str | None, _doc("The served model's name; may be left out.")] = None
    encoding_format: Annotated[
        Literal["float", "base64"] | None,
        _doc("float (default): lists of numbers; base64: little-endian float32 bytes."),
    ] = None
    dimensions: Annotated[
        int | None,
        _doc(
            "Matryoshka truncation: a 400 for the models served here (no GGUF declares "
            "Matryoshka dimensions), as vLLM answers for a model without them."
        ),
    ] = None
    user: Annotated[str | None, _doc("Accepted and ignored.")] = None


_WORDS = {
    "model": "a string",
    "encoding_format": 'either "float" or "base64"',
    "dimensions": "an integer",
    "user": "a string",
}


def _fault(key: str, value: Any) -> Any:
    raise InvalidRequest(f"{key} must be {_WORDS[key]}, got {value!r:.80}.", param=key)


def parse_embedding(raw: Any, served: ServedModel) -> tuple[EmbeddingBody, list[str | list[int]]]:
    """The body and its inputs; a 400 (`InvalidRequest`) for what is wrong with either, a
    404 for another model's name."""
    if not isinstance(raw, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    body = convert(raw, EmbeddingBody, fault=_fault, order="declared")
    served.check_model(body.model)
    if body.input is None:
        raise InvalidRequest("input is required: the text or token ids to embed.", param="input")
    inputs, _ = embedding_inputs(body.input, "input")
    check_dimensions(body.dimensions, served.name)
    return body, inputs


async def create_embedding(
    served: ServedModel,
    raw: Any,
    owned: list[Any],
    exchange: RequestSink | None = None,
    *,
    deadline: Deadline,
    embeddings: EmbeddingService | None,
) -> Response:
    """The response to one `/v1/embeddings` body. Raises `EngineError`s (400 for the body,
    404 for another model, 501 where the engine computes no embeddings, 408 past
    `deadline`)."""
    if embeddings is None and served.passthrough is not None:  # a front: a worker embeds
        return await relay_to_worker(
            served, served.passthrough, "/v1/embeddings", raw, owned, exchange, deadline=deadline
        )
    body, inputs = parse_embedding(raw, served)
    done = await embed_inputs(
        embeddings,
        served.tokenizer,
        inputs,
        exchange,
        deadline=deadline,
        unavailable=NO_EMBEDDINGS,
    )
    as_base64 = body.encoding_format == "base64"
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": _base64(vector) if as_base64 else vector.tolist(),
        }
        for i, vector in enumerate(done.vectors)
    ]
    tokens = sum(done.prompt_tokens)
    return json_response(
        {
            "object": "list",
            "data": data,
            "model": served.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


def _base64(vector: np.ndarray) -> str:
    """Little-endian float32 bytes, base64: what OpenAI's client decodes
    (`np.frombuffer(base64.b64decode(s), dtype="float32")`)."""
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
