"""`EngineService`: what the HTTP app needs from whatever serves the tokens.

Two implementations: the local `Engine` (a model in this process) and `RemoteEngine`
(`engine/remote/`, a fleet of SGLang, vLLM or Tributary workers). `app` is written against
this protocol only, so `/generate`, `/v1`, timing, SSE, metrics and disconnect handling are
the same code whichever one is behind them.

Synopsis::

    def create_app(engine: EngineService, settings: ServerSettings) -> QuartTrio: ...

Contract shared by both (docs/architecture.md):

- `submit` is synchronous: it validates what it can and returns a `RequestStream` at once, or
  raises an `EngineError` (nothing is started then). The stream yields `Frame`s, then one
  `Done` or `Error`; leaving it early aborts the request, synchronously.
- `prepare` (async) does the part of `submit` whose cost grows with what a client sent
  (tokenizing long texts, compiling grammars) for all of one request's items at once, off
  the event loop, and returns the items for `submit` to take; it raises QueueFull when the
  items cannot all fit the queue, and nothing else that `submit` would not raise later. The
  HTTP layer awaits it for a request's items before submitting them
  (`app.generate.submit_all`).
- `abort*` only mark: the request's stream ends with a `Done` whose finish_reason is an abort.
- What an implementation cannot do raises `NotSupported` (501) naming why (a remote fleet has
  no tokenizer at the front; a local engine has no workers), never a wrong answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol

from .core import EngineLoad
from .request import EngineStats, GenerateRequest, ModelInfo, WorkerStats
from .stream import RequestStream

if TYPE_CHECKING:
    from .remote.passthrough import Answer

__all__ = ["EngineService", "ServiceConfig"]


class ServiceConfig(Protocol):
    """The part of an engine's configuration the app reads (the whole dataclass is echoed by
    `/get_server_info`)."""

    @property
    def served_model_name(self) -> str | None: ...


class EngineService(Protocol):
    #: True when the tokens come from remote workers (no tokenizer or template here).
    serves_remotely: bool

    @property
    def config(self) -> ServiceConfig: ...

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def capacity(self) -> int:
        """The most requests taken at once; a larger batch can never be accepted whole."""
        ...

    def stats(self) -> EngineStats: ...

    def load(self) -> EngineLoad: ...

    def slowest_recent_step(self) -> float:
        """How long an abort may wait for the step boundary that acts on it (0: unknown)."""
        ...

    async def prepare(self, items: Sequence[GenerateRequest]) -> list[GenerateRequest]:
        """One request's `items` (a batch, n copies), with their slow validation work
        (tokenizing, grammar compiling) done together off the event loop for `submit` to take
        (an item itself when it has none). QueueFull, before any work, when they cannot all
        fit the queue."""
        ...

    def submit(self, request: GenerateRequest) -> RequestStream: ...

    def abort(
        self,
        rid: str,
        *,
        fanout: bool = False,
        message: str = "Aborted",
        status_code: int | None = None,
    ) -> int: ...

    def abort_all(self, *, message: str = "Aborted", status_code: int | None = None) -> int: ...

    def abort_waiting(self, *, message: str = "Aborted", status_code: int | None = None) -> int: ...

    def count_refused(self, requests: int) -> None: ...

    def open_passthrough(
        self, path: str, body: dict[str, Any], *, key: str | None, deadline: float = math.inf
    ) -> AbstractAsyncContextManager[Answer]:
        """Hand a request to one worker whole and relay its answer (a remote fleet's chat
        completions: the template and tokenizer are the workers'); `NotSupported` here."""
        ...

    def flush_cache(self) -> bool: ...

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]: ...

    def detokenize(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def worker_stats(self) -> list[WorkerStats]:
        """The remote workers behind this engine ([] for a local model)."""
        ...

    def add_worker(self, url: str, kind: str = "sglang") -> WorkerStats:
        """Serve from one more worker (ValueError: a bad or known URL)."""
        ...

    def remove_worker(self, url: str) -> WorkerStats:
        """Stop choosing `url` (KeyError: not a worker); its in-flight requests carry on."""
        ...
