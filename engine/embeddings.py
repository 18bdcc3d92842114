"""Embeddings: what a runner that computes them offers (`Embeds`), and the engine's checked
front to it (`Embeddings`, the `EmbeddingService` capability the app finds through
`Capabilities.of`).

Synopsis::

    service = Capabilities.of(engine).embeddings      # None: this engine computes none
    service.model.pooling, service.model.dimensions   # "last", 576
    vectors = await service.embed([[1, 2, 3], [4, 5]])  # unit-length float32 arrays

`Embeddings.embed` checks every input before anything is computed (each a 400 that says
which input and why): the model has a pooling type, no input is empty or longer than the
model embeds, every id is in the vocabulary, and there are at most `MAX_INPUTS` inputs of
`MAX_REQUEST_TOKENS` tokens in all. One request is computed at a time, the others wait their
turn; `abort` ends the waiting ones at once and, with `running`, the one computing after its
decode in flight, each with an `EmbeddingAborted` (a 503 at shutdown, as a generation's).
Vectors are L2-normalised, as llama-server (`--embd-normalize 2`, its default) and vLLM
(`normalize` true for embedding models) return them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import trio

from .config import EngineConfig
from .errors import BadRequest, EngineError

__all__ = [
    "GGUF_POOLINGS",
    "MAX_INPUTS",
    "MAX_REQUEST_TOKENS",
    "POOLINGS",
    "EmbeddingAborted",
    "EmbeddingModel",
    "Embeddings",
    "Embeds",
    "TimesEmbedDecodes",
    "Vector",
    "embedding_cells",
    "no_pooling_message",
]

#: The pooling types `--pooling` takes (llama.cpp's names; `rank` is a reranker's, not served).
POOLINGS = ("mean", "cls", "last")

#: llama.cpp's pooling types, by their GGUF number (`<arch>.pooling_type`).
GGUF_POOLINGS = {0: None, 1: "mean", 2: "cls", 3: "last", 4: "rank"}

#: The most inputs one request may embed (OpenAI's bound on `input`).
MAX_INPUTS = 2048

#: The most tokens one request may embed, all inputs together (OpenAI's bound per request;
#: its bound per input, 8,192, is `--embedding-context-length`'s default). One request is
#: computed at a time, so this bounds how long one client holds up the others.
MAX_REQUEST_TOKENS = 300_000

#: One embedding: float32, unit length.
Vector = npt.NDArray[np.float32]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingModel:
    """What the served model's embeddings are."""

    #: Floats in a vector (the model's hidden size).
    dimensions: int
    #: How token states become one vector: "mean", "cls" or "last"; None where the GGUF
    #: declares none and `--pooling` named none (every request is then a 400).
    pooling: str | None
    #: Where the pooling came from: "gguf" or "--pooling".
    pooling_source: str
    #: The most tokens one input may have (the context length).
    max_input_tokens: int


def embedding_cells(config: EngineConfig, context: int, pooling: str | None) -> int:
    """KV cells of the llama runner's embedding context: the longest input it embeds
    (`--embedding-context-length`, at most `context`); 0 (no context) without a pooling type.
    What the memory checks count (an encoder's inputs are bounded by one decode, fewer)."""
    return 0 if pooling in (None, "rank") else min(context, config.embedding_context_length)


def no_pooling_message(model: str) -> str:
    """What a request answers when the model has no pooling type (llama-server's 400,
    "Pooling type 'none' is not OAI compatible", with the flag that fixes it)."""
    return (
        f"The model {model!r} declares no pooling type for embeddings (its GGUF has none), "
        "so this server computes none; start it with --pooling mean, last or cls."
    )


class EmbeddingAborted(EngineError):
    """An embedding request ended by `Embeddings.abort` (shutdown: a 503, as a generation's
    abort with a status code; an embedding has no partial answer to end with normally)."""

    err_type = "aborted"

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.http_status = status


@runtime_checkable
class TimesEmbedDecodes(Protocol):
    """A runner whose embedding decodes are one compute-thread job each, timed: a generation
    step may wait behind one, so the engine's `slowest_recent_step` counts them."""

    #: Seconds the recent embedding decodes took (the last few).
    embed_decode_seconds: Sequence[float]


@runtime_checkable
class Embeds(Protocol):
    """A runner that computes embeddings (llama: `LlamaEmbeddings`, in a context of its own,
    so generation's KV cache and batches are never touched; sim: `SimEmbeddings`, fake)."""

    @property
    def embedding_model(self) -> EmbeddingModel: ...

    async def embed(self, inputs: Sequence[Sequence[int]]) -> list[Vector]:
        """One unit-length vector per input, in order; the inputs are already checked."""
        ...


class Embeddings:
    """The engine's `EmbeddingService`: checks, then the runner's `embed`."""

    def __init__(
        self, runner: Embeds, *, model_name: str, vocab_size: int, check_open: Callable[[], None]
    ) -> None:
        self._runner = runner
        self._model_name = model_name
        self._vocab_size = vocab_size
        self._check_open = check_open
        # One request computes at a time; the calls waiting for it or computing, for `abort`.
        self._turn = trio.Lock()
        self._calls: dict[trio.CancelScope, bool] = {}  # scope -> computing now
        self._aborted: dict[trio.CancelScope, EmbeddingAborted] = {}

    @property
    def model(self) -> EmbeddingModel:
        return self._runner.embedding_model

    def check(self, inputs: Sequence[Sequence[int]]) -> None:
        """Raise BadRequest (400) for what cannot be embedded; nothing is computed."""
        model = self.model
        if model.pooling is None:
            raise BadRequest(no_pooling_message(self._model_name))
        if not inputs:
            raise BadRequest("There is nothing to embed: the input list is empty.")
        if len(inputs) > MAX_INPUTS:
            raise BadRequest(
                f"At most {MAX_INPUTS} inputs can be embedded in one request, got {len(inputs)}."
            )
        total = sum(map(len, inputs))
        if total > MAX_REQUEST_TOKENS:
            raise BadRequest(
                f"The inputs have {total} tokens in all, more than one request may embed "
                f"({MAX_REQUEST_TOKENS} tokens); send them in several requests."
            )
        limit, vocab = model.max_input_tokens, self._vocab_size
        for i, ids in enumerate(inputs):
            if not ids:
                raise BadRequest(f"Input {i} is empty: there is nothing to embed.")
            if len(ids) > limit:
                raise BadRequest(
                    f"Input {i} has {len(ids)} tokens, more than this model embeds in one "
                    f"input ({limit} tokens, --embedding-context-length or the context length)."
                )
            array = np.asarray(ids)  # one pass in C: a request may hold a million ids
            outside = (array < 0) | (array >= vocab)
            if outside.any():
                token = int(array[outside.argmax()])
                raise BadRequest(
                    f"Input {i} has token id {token}, outside the vocabulary [0, {vocab})."
                )

    async def embed(self, inputs: Sequence[Sequence[int]]) -> list[Vector]:
        """Check `inputs` (BadRequest), then compute them once no other request is;
        EngineClosed once closing, EmbeddingAborted once aborted."""
        self._check_open()
        self.check(inputs)
        scope = trio.CancelScope()
        self._calls[scope] = False
        try:
            with scope:
                async with self._turn:
                    self._calls[scope] = True
                    return await self._runner.embed(inputs)
            # Only `abort` cancels this scope: the runner ends after its decode in flight.
            raise self._aborted[scope]
        finally:
            del self._calls[scope]
            self._aborted.pop(scope, None)  # aborted during its last decode: answered

    def abort(self, message: str, *, status: int = 503, running: bool = True) -> int:
        """End the embedding requests waiting for their turn (and with `running`, the one
        computing, after its decode in flight) with `EmbeddingAborted(message, status)`.
        Returns how many were aborted."""
        aborted = 0
        for scope, computing in list(self._calls.items()):
            if (running or not computing) and scope not in self._aborted:
                self._aborted[scope] = EmbeddingAborted(message, status=status)
                scope.cancel()
                aborted += 1
        return aborted

    def slowest_recent_decode(self) -> float:
        """Seconds the slowest recent embedding decode took (0: none, or not timed)."""
        if isinstance(self._runner, TimesEmbedDecodes):
            return max(self._runner.embed_decode_seconds, default=0.0)
        return 0.0
