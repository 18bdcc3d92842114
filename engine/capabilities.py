"""What an engine can do beyond `EngineService`, and how the app finds out, once.

A local `Engine` has the model's vocabulary (`TokenizerService`) and a prefix cache
(`CacheService`), and embeds text when its runner can (`EmbeddingService`); a front
(`RemoteEngine`) has a fleet of workers (`FleetService`) and hands chat completions to them
whole (`PassthroughService`). An engine implements only what it has;
the app asks once, when it is created, and answers for what is missing itself.

Synopsis::

    caps = Capabilities.of(engine)          # at app creation, never per request
    if caps.fleet is None: ...              # a local model: no workers to list
    ids = caps.tokenizer.tokenize("Hi")     # NotSupported (501) where there is no tokenizer

The tokenizer is always there to call: where the engine has none (a front), `caps.tokenizer`
raises `NotSupported` on each call, at the point a local engine would have tokenized, so
every route answers what a front has always answered (a 501 naming where to ask instead).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, runtime_checkable

from .embeddings import EmbeddingModel, Vector
from .errors import NotSupported
from .interface import EngineService
from .request import WorkerStats

__all__ = [
    "NO_TOKENIZER",
    "CacheService",
    "Capabilities",
    "EmbeddingService",
    "FleetService",
    "PassthroughService",
    "RelayedAnswer",
    "TokenizerService",
]

#: What every tokenizer call answers where the engine has no vocabulary (a front).
NO_TOKENIZER = (
    "This server fronts a fleet of workers and has no tokenizer of its own (tokenization "
    "stays on the workers); call /tokenize or /detokenize on a worker."
)


@runtime_checkable
class TokenizerService(Protocol):
    """The model's vocabulary, in this process. Each call is safe from a worker thread
    (`offload.off_loop`); EngineClosed once the engine is closing."""

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]: ...

    def detokenize(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes, control tokens spelled out: what logprob entries show."""
        ...


@runtime_checkable
class CacheService(Protocol):
    """A prefix cache this server owns."""

    def flush_cache(self) -> bool:
        """Empty it; False (nothing dropped) while requests run or wait, as in SGLang."""
        ...


class EmbeddingService(Protocol):
    """Embeddings of the served model (`engine.embeddings.Embeddings`)."""

    @property
    def model(self) -> EmbeddingModel: ...

    def check(self, inputs: Sequence[Sequence[int]]) -> None:
        """BadRequest (400) for inputs it cannot embed, or a model with no pooling type."""
        ...

    async def embed(self, inputs: Sequence[Sequence[int]]) -> list[Vector]:
        """One unit-length float32 vector per input; BadRequest (400) before computing
        anything for inputs it cannot embed (or a model with no pooling type)."""
        ...


@runtime_checkable
class _ProvidesEmbeddings(Protocol):
    @property
    def embeddings(self) -> EmbeddingService | None: ...


@runtime_checkable
class FleetService(Protocol):
    """The remote workers behind a front, changed at run time by the admin routes."""

    #: Requests ended by a worker's failure after it had them, per reason (`/metrics`).
    upstream_failures: dict[str, int]

    def worker_stats(self) -> list[WorkerStats]: ...

    def add_worker(self, url: str, kind: str = "sglang") -> WorkerStats:
        """Serve from one more worker (ValueError: a bad or known URL)."""
        ...

    def remove_worker(self, url: str) -> WorkerStats:
        """Stop choosing `url` (KeyError: not a worker); its in-flight requests carry on."""
        ...


class RelayedAnswer(Protocol):
    """A worker's answer to a request handed to it whole: its status and content type, and
    its body as it arrives (`remote.passthrough.Answer`)."""

    @property
    def status(self) -> int: ...

    @property
    def content_type(self) -> str: ...

    @property
    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read_whole(self) -> bytes:
        """The whole body; a 502 `WorkerFailure` past the front's answer limit."""
        ...

    async def read_error(self) -> tuple[bytes, str | None]:
        """An error answer's body, cut at the front's limit, and the message a cut body
        begins with (None if it came whole)."""
        ...


@runtime_checkable
class PassthroughService(Protocol):
    """Requests handed to one worker whole, their answers relayed (a front's chat
    completions: the template and tokenizer are the workers')."""

    def open_passthrough(
        self, path: str, body: dict[str, Any], *, key: str | None, deadline: float = math.inf
    ) -> AbstractAsyncContextManager[RelayedAnswer]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What one engine can do beyond `EngineService`; None where it cannot."""

    #: The engine itself, or, where it has no vocabulary, one whose every call raises
    #: NotSupported(NO_TOKENIZER).
    tokenizer: TokenizerService
    cache: CacheService | None
    fleet: FleetService | None
    passthrough: PassthroughService | None
    #: None where the engine computes no embeddings (a front; a runner without them).
    embeddings: EmbeddingService | None = None

    @classmethod
    def of(cls, engine: EngineService) -> Capabilities:
        """Ask `engine` once (a protocol check per capability: call it when the app is
        created, not per request)."""
        return cls(
            tokenizer=engine if isinstance(engine, TokenizerService) else _NoTokenizer(),
            cache=engine if isinstance(engine, CacheService) else None,
            fleet=engine if isinstance(engine, FleetService) else None,
            passthrough=engine if isinstance(engine, PassthroughService) else None,
            embeddings=engine.embeddings if isinstance(engine, _ProvidesEmbeddings) else None,
        )


class _NoTokenizer:
    """An engine's missing vocabulary: every call is a 501 naming where to ask instead."""

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        raise NotSupported(NO_TOKENIZER)

    def detokenize(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        raise NotSupported(NO_TOKENIZER)

    def token_bytes(self, token_id: int) -> bytes:
        raise NotSupported(NO_TOKENIZER)
