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
  (`app.generation.submit_all`).
- `abort*` only mark: the request's stream ends with a `Done` whose finish_reason is an abort.
- What only one kind of engine can do (tokenize, flush a cache, manage workers, hand a request
  to a worker whole) is not here but an optional capability (`capabilities.Capabilities`),
  which the app looks up once and answers for where it is missing (a 501 or 400 naming why,
  never a wrong answer).
- What an implementation cannot do for one request raises `NotSupported` (501) naming why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from .request import EngineStats, GenerateRequest, ModelInfo
from .stream import RequestStream

__all__ = ["EngineLoad", "EngineService", "ServiceConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineLoad:
    """The load a router balances on (SGLang's `GetLoadReqOutput`)."""

    num_reqs: int  # running (not aborted) plus waiting
    num_waiting_reqs: int  # submitted, not yet admitted
    num_tokens: int  # KV cells in use plus the prompt tokens of waiting requests


class ServiceConfig(Protocol):
    """The part of an engine's configuration the app reads (the whole dataclass is echoed by
    `/get_server_info`)."""

    @property
    def served_model_name(self) -> str | None: ...


class EngineService(Protocol):
    """What every engine does; what only some do is a capability (`capabilities.py`)."""

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
