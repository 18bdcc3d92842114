"""Embedding a request's inputs: what OpenAI's `/v1/embeddings` and SGLang's `/encode` share.

Synopsis::

    inputs, batched = embedding_inputs(body.input, "input")   # 400s for a wrong shape
    done = await embed_inputs(caps.embeddings, caps.tokenizer, inputs, exchange,
                              deadline=deadline, unavailable="...")
    done.vectors[0], done.prompt_tokens[0]

Texts are tokenized as llama-server tokenizes them (special tokens added and parsed); token
ids are taken as they are. Everything is checked before anything is computed (the engine's
`EmbeddingService.check`: a 400 naming the input). Each input is one request for /metrics
and the access log (`RequestTiming`, one item per input, started before tokenization as a
generation's is), and the whole response one answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tributary.engine import EngineError, NotSupported, TokenizerService
from tributary.engine.capabilities import EmbeddingService
from tributary.engine.embeddings import MAX_INPUTS, Vector
from tributary.engine.offload import tokenize_all

from ..http.errors import InvalidRequest
from ..http.limits import Deadline
from ..observe.timing import RequestSink, RequestTiming

__all__ = [
    "IDS_SCHEMAS",
    "TEXT_SCHEMAS",
    "EmbedInput",
    "Embedded",
    "check_dimensions",
    "embed_inputs",
    "embedding_inputs",
]

#: One input: a text, or its token ids.
EmbedInput = str | list[int]

_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"

_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
#: The JSON Schemas of a text input and of a batch of them (for the bodies' declarations).
TEXT_SCHEMAS = [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
]
#: The JSON Schemas of a token-id input and of a batch of them.
IDS_SCHEMAS = [_IDS, {"type": "array", "items": _IDS, "minItems": 1}]


@dataclasses.dataclass(frozen=True)
class Embedded:
    #: One unit-length float32 vector per input, in order.
    vectors: list[Vector]
    #: Each input's tokens.
    prompt_tokens: list[int]
    #: Seconds from the request's start (before tokenization) to its vectors.
    e2e_latency: float


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def embedding_inputs(
    value: Any, field: str, *, texts: bool = True, ids: bool = True
) -> tuple[list[EmbedInput], bool]:
    """The inputs `value` holds, and whether it was a list of them (a batch) rather than one:
    a string, a list of strings, a list of token ids, or a list of token-id lists (`texts`
    and `ids` say which of these `field` may hold). A 400 naming `field` otherwise."""
    shapes = (
        _SHAPES
        if texts and ids
        else "a string or a list of strings"
        if texts
        else ("a list of token ids or a list of token-id lists")
    )
    wrong = InvalidRequest(f"{field} must be {shapes}.", param=field)
    if isinstance(value, str):
        if not texts:
            raise wrong
        if not value:
            raise InvalidRequest(
                f"{field} is an empty string: there is nothing to embed.", param=field
            )
        return [value], False
    if not isinstance(value, list):
        raise wrong
    if not value:
        raise InvalidRequest(f"{field} is an empty list: there is nothing to embed.", param=field)
    if texts and all(isinstance(item, str) for item in value):
        _check_count(value, field)
        for i, item in enumerate(value):
            if not item:
                raise InvalidRequest(
                    f"{field}[{i}] is an empty string: there is nothing to embed.", param=field
                )
        return list(value), True
    if ids and all(_is_id(item) for item in value):
        return [list(value)], False
    if ids and all(isinstance(item, list) and all(map(_is_id, item)) for item in value):
        _check_count(value, field)
        return [list(item) for item in value], True
    raise wrong


def _check_count(batch: list[Any], field: str) -> None:
    """The engine's bound on inputs, checked before any text is tokenized (4 MiB of short
    texts is some 400,000 of them)."""
    if len(batch) > MAX_INPUTS:
        raise InvalidRequest(
            f"At most {MAX_INPUTS} inputs can be embedded in one request, got {len(batch)}.",
            param=field,
        )


def check_dimensions(dimensions: int | None, model_name: str) -> None:
    """`dimensions` (Matryoshka truncation) is refused for every model, in vLLM's words for a
    model that declares no Matryoshka dimensions (no GGUF key declares them)."""
    if dimensions is not None:
        raise InvalidRequest(
            f'Model "{model_name}" does not support matryoshka representation, changing '
            "output dimensions will lead to poor results.",
            param="dimensions",
        )


async def embed_inputs(
    service: EmbeddingService | None,
    tokenizer: TokenizerService,
    inputs: list[EmbedInput],
    exchange: RequestSink | None,
    *,
    deadline: Deadline,
    unavailable: str,
    rids: list[str] | None = None,
) -> Embedded:
    """Tokenize the texts, check, embed. `unavailable`: the 501's message where the engine
    computes no embeddings. `rids`: each input's request id for the access log."""
    if service is None:
        raise NotSupported(unavailable)
    timing = RequestTiming.start(exchange, whole=True)
    texts = [item for item in inputs if isinstance(item, str)]
    tokenized = iter(await tokenize_all(tokenizer, texts, add_special=True))
    ids = [next(tokenized) if isinstance(item, str) else item for item in inputs]
    service.check(ids)  # a 400 before anything is computed or counted
    items = []
    for i, tokens in enumerate(ids):
        item = timing.for_item()
        item.rid = rids[i] if rids is not None else None
        item.prompt_tokens = len(tokens)
        items.append(item)
    try:
        with deadline.applied():
            vectors = await service.embed(ids)
    except EngineError:
        for item in items:
            item.failed = True
            item.finish()
        raise
    for item in items:
        item.finish()
        item.answered = True
    latency = items[0].e2e_latency
    assert latency is not None, "finished above"
    return Embedded(vectors, [len(tokens) for tokens in ids], latency)
