"""`open_remote_engine` and `RemoteEngine`: the engine interface served by remote workers.

Synopsis::

    config = RemoteConfig(workers=(("http://10.0.0.5:30000", "sglang"),))
    async with open_remote_engine(config) as eng:            # an EngineService
        async with eng.submit(GenerateRequest(text="Hi")) as stream:
            async for item in stream: ...                      # Frame ... then Done or Error

Each submitted item gets a forwarding task in the engine's nursery (`forward.Forwarder`).
It picks a worker (`Fleet.choose`, excluding the ones already tried: `attempt.Attempts`),
POSTs the item with a rid of the front's own choosing (the client's, or a fresh one) and
turns the worker's SSE frames into the same `Frame` / `Done` / `Error` items the local
engine gives, through the stream's `OutputSender` (so a redirected SSE body works
unchanged). A chat completion goes to one worker whole instead (`open_passthrough`).

Failure contract:

- before the item's first output, a failure to connect or to send the request, a 408/429 or
  a 5xx (status or error frame), or a 503 abort from a worker shutting down is retried on
  another worker after a backoff, at most `max_retries` times and never past the stream's
  deadline; then the item ends with an `Error` carrying the last failure's status (503 if
  no worker was available);
- once a worker has the request, a connection that drops (502), a worker silent for
  `worker_timeout` (504) or an answer past the front's limits (502) ends the item, never a
  retry: the worker may have died *of this request* (a grammar that crashes it), and
  another worker would die of it too. Counted in `upstream_failures` (`/metrics`);
- after the first output, a failure ends the item with an `Error` (502 for a broken
  connection): a retry would repeat tokens the client already has;
- a worker's 4xx (the client's input) ends the item with that status, no retry.

Client-facing messages name a worker by its number in the fleet (`Worker.id`), never by its
URL (an internal address); the log line of each failure has both.

Aborts: leaving the stream early, `abort`, `abort_all` or closing the engine cancels the
forwarding task (which closes the upstream response) and posts `/abort_request` with the
item's rid to the worker holding it, in a task of its own, shielded, for at most
`abort_timeout` seconds. The stream ends with the abort `Done` at once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio

from ..errors import (
    BadRequest,
    DuplicateRequestId,
    EngineClosed,
    NotSupported,
    QueueFull,
)
from ..interface import EngineLoad
from ..request import (
    Done,
    EngineStats,
    Error,
    FinishReason,
    Frame,
    GenerateRequest,
    ModelInfo,
    Output,
    WorkerStats,
    abort_reason,
    abort_targets,
)
from ..service_nursery import open_service_nursery
from ..stream import RequestStream, open_output_channel
from ..token_ids import check_prompt_ids
from . import openai
from .breaker import Breaker
from .config import CODE_FIELDS, KEEPALIVE_SECONDS, NO_CUSTOM_LOGIT_PROCESSOR, RemoteConfig
from .discovery import ServedModel
from .fleet import Fleet
from .forward import Forwarder
from .health import run_health_checks
from .item import Group, GroupedRequest, Item, group_of
from .passthrough import Answer, open_passthrough
from .upstream import Upstream

__all__ = ["RemoteEngine", "open_remote_engine"]


@asynccontextmanager
async def open_remote_engine(config: RemoteConfig) -> AsyncIterator[RemoteEngine]:
    """Open the HTTP client and the engine's nursery (forwarding tasks, health checks), ask the
    workers about the model, and yield the engine. On exit every item still in flight ends
    with a 503 abort and its worker is told to abort it; errors raised in the block reach the
    caller unwrapped."""
    timeout = httpx.Timeout(
        None,
        connect=config.connect_timeout,
        read=config.worker_timeout,
        write=config.worker_timeout,
    )
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_SECONDS
    )
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        breakers = partial(
            Breaker,
            failure_threshold=config.breaker_failure_threshold,
            open_seconds=config.breaker_open_seconds,
        )
        fleet = Fleet(config.workers, policy=config.policy, breaker_factory=breakers)
        model = ServedModel(
            client,
            fleet,
            name="remote",
            served_name=config.served_model_name,
            timeout=config.health_check_timeout,
        )
        engine = RemoteEngine(Upstream(config, fleet, client), model)
        discovered = await model.ask(log_level=logging.WARNING)
        async with open_service_nursery() as nursery:
            engine._nursery = engine.upstream.nursery = nursery
            if not discovered:
                pause = config.health_check_interval or _REDISCOVER_SECONDS
                nursery.start_soon(model.ask_until_answered, pause)
            if config.health_check_interval > 0:
                await nursery.start(
                    partial(
                        run_health_checks,
                        fleet,
                        client,
                        interval=config.health_check_interval,
                        timeout=config.health_check_timeout,
                    )
                )
            try:
                yield engine
            finally:
                engine.abort_all(message="The server is shutting down.", status_code=503)
                engine._closed = True
                # The aborts just posted are shielded; everything else stops now.
                nursery.cancel_scope.cancel()


class RemoteEngine:
    """`EngineService` over a `Fleet` of workers. Every method is synchronous and never
    blocks, like `Engine`'s; the network work runs in the engine's nursery. Beyond
    `EngineService`, it has the `FleetService` and `PassthroughService` capabilities; the
    tokenizer and the prefix cache stay on the workers."""

    def __init__(self, upstream: Upstream, model: ServedModel) -> None:
        self.upstream = upstream
        self.config = upstream.config
        self.fleet = upstream.fleet
        self._live: dict[str, Item] = {}
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._generated_tokens = 0
        self._aborted = 0
        self._model = model
        self._forwarder = Forwarder(upstream, self._deliver)
        #: Items ended by a worker's failure after it had the request, never retried
        #: (`wire.UPSTREAM_FAILURES` are the reasons): `tributary:front_upstream_failures_total`.
        self.upstream_failures = upstream.upstream_failures

    # -- what the app reads -------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self._model.info

    @property
    def capacity(self) -> int:
        return self.config.max_in_flight

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._live),
            waiting=0,
            kv_used_cells=0,
            kv_total_cells=0,
            steps=0,
            generated_tokens=self._generated_tokens,
            aborted_requests=self._aborted,
        )

    def load(self) -> EngineLoad:
        return EngineLoad(num_reqs=len(self._live), num_waiting_reqs=0, num_tokens=0)

    def slowest_recent_step(self) -> float:
        return 0.0  # the workers' steps are theirs; an abort here acts at once

    def worker_stats(self) -> list[WorkerStats]:
        return [w.stats() for w in self.fleet.workers]

    def add_worker(self, url: str, kind: str = "sglang") -> WorkerStats:
        if kind not in ("sglang", "openai"):
            raise ValueError(f"kind must be 'sglang' or 'openai', got {kind!r}")
        return self.fleet.add(url, kind).stats()  # type: ignore[arg-type]

    def remove_worker(self, url: str) -> WorkerStats:
        removed = self.fleet.remove(url)
        self.upstream.forget_model(removed)
        for item in self._live.values():
            if item.worker is removed and not item.started and item.attempt is not None:
                item.attempt.cancel()  # retried elsewhere; what has output finishes there
        return removed.stats()

    # -- requests -------------------------------------------------------------------------

    async def prepare(self, items: Sequence[GenerateRequest]) -> list[GenerateRequest]:
        """The workers tokenize and compile grammars; here the items of one client request
        only learn that they belong together (`Group`). An item submitted unprepared goes
        on its own."""
        group = Group()
        names = [f.name for f in dataclasses.fields(GenerateRequest)]
        return [
            GroupedRequest(**{name: getattr(item, name) for name in names}, group=group)
            for item in items
        ]

    def submit(self, request: GenerateRequest) -> RequestStream:
        """Check what the front can check and start forwarding; see the module docstring.
        Raises BadRequest, NotSupported, DuplicateRequestId, QueueFull or EngineClosed, and
        then nothing is sent anywhere."""
        if self._closed or self._nursery is None:
            raise EngineClosed("The engine is shutting down.")
        if request.logprobs is not None:
            raise NotSupported(
                "Logprobs are not forwarded to remote workers yet; ask a worker directly."
            )
        if request.custom_logit_processor and not self.config.enable_custom_logit_processor:
            raise NotSupported(NO_CUSTOM_LOGIT_PROCESSOR)
        if request.sampling.n != 1:
            raise BadRequest(f"n={request.sampling.n}: submit one request per sample.")
        if request.input_ids is None and request.text is None:
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        if request.input_ids is not None:
            check_prompt_ids(request.input_ids, None)
        self._check_kinds(request)
        rid = request.rid if request.rid is not None else uuid.uuid4().hex
        if rid in self._live:
            raise DuplicateRequestId(rid)
        if len(self._live) >= self.config.max_in_flight:
            self._aborted += 1
            raise QueueFull("The request queue is full.")
        sender, receiver = open_output_channel(rid)
        prompt = len(request.input_ids) if request.input_ids is not None else 0
        item = Item(rid, request, sender, prompt_tokens=prompt, group=group_of(request))
        stream = RequestStream(
            rid=rid,
            prompt_tokens=prompt,
            receiver=receiver,
            abort=lambda: self._abort_item(item, abort_reason()),
            abort_with=lambda reason: self._abort_item(item, reason),
            sender=sender,
        )
        item.stream = stream
        self._live[rid] = item
        self._nursery.start_soon(self._forwarder.forward, item)
        return stream

    def abort(
        self,
        rid: str,
        *,
        fanout: bool = False,
        message: str = "Aborted",
        status_code: int | None = None,
    ) -> int:
        items = abort_targets(self._live, rid, fanout=fanout)
        return self._abort_many(items, message, status_code)

    def abort_all(self, *, message: str = "Aborted", status_code: int | None = None) -> int:
        return self._abort_many(list(self._live.values()), message, status_code)

    def abort_waiting(self, *, message: str = "Aborted", status_code: int | None = None) -> int:
        # Items waiting for a worker (between attempts): nothing was generated for them yet.
        waiting = [i for i in self._live.values() if i.worker is None]
        return self._abort_many(waiting, message, status_code)

    def count_refused(self, requests: int) -> None:
        self._aborted += requests

    def _abort_many(self, items: list[Item], message: str, status_code: int | None) -> int:
        err_type = None if status_code is None else "aborted"
        for item in items:
            self._abort_item(
                item, abort_reason(message, status_code=status_code, err_type=err_type)
            )
        return len(items)

    def _abort_item(self, item: Item, reason: FinishReason) -> None:
        """End `item` now with an abort `Done`; stop its upstream and tell its worker."""
        if item.ended:
            return
        worker = item.worker
        self._end(
            item,
            Done(
                item.rid,
                "",
                [],
                item.prompt_tokens,
                item.completion_tokens,
                item.cached_tokens,
                finish_reason=reason,
                first_token_at=item.first_token_at,
            ),
        )
        self._aborted += 1
        if item.scope is not None:
            item.scope.cancel()
        if worker is not None:
            self.upstream.abort_soon(worker, item.rid)

    def _end(self, item: Item, out: Output) -> None:
        item.ended = True
        item.sender.send(out)
        item.sender.close()
        # The stream's abort callbacks hold the item: without this, a reference cycle per
        # request for the garbage collector.
        item.stream = None
        if self._live.get(item.rid) is item:
            del self._live[item.rid]

    def _deliver(self, item: Item, out: Output) -> None:
        if item.ended:
            return
        if isinstance(out, Frame | Done):
            item.started = True
            if item.first_token_at is None and out.completion_tokens > 0:
                item.first_token_at = trio.current_time()
            if isinstance(out, Done):
                # The front's view, as for e2e_latency (time_to_first_token, /metrics).
                out = dataclasses.replace(out, first_token_at=item.first_token_at)
            self._generated_tokens += max(0, out.completion_tokens - item.completion_tokens)
            item.prompt_tokens = out.prompt_tokens
            item.completion_tokens = out.completion_tokens
            item.cached_tokens = out.cached_tokens
        if isinstance(out, Done | Error):
            self._end(item, out)
        else:
            item.sender.send(out)

    def _check_kinds(self, request: GenerateRequest) -> None:
        refused = openai.unsupported_fields(request)
        kinds = {w.kind for w in self.fleet.workers}
        if refused and kinds == {"openai"}:
            raise BadRequest(
                "The workers behind this server speak OpenAI's /v1/completions, which has no "
                f"equivalent for: {', '.join(refused)}."
            )

    def open_passthrough(
        self, path: str, body: dict[str, Any], *, key: str | None, deadline: float = math.inf
    ) -> AbstractAsyncContextManager[Answer]:
        """Hand a request to one worker whole (`passthrough.open_passthrough`). A body with
        a custom logit processor (SGLang's `custom_logit_processor`, vLLM's
        `logits_processors`) is refused with `NotSupported` unless the front relays them."""
        if self._closed:
            raise EngineClosed("The engine is shutting down.")
        if not self.config.enable_custom_logit_processor:
            for field in CODE_FIELDS:
                if body.get(field) not in (None, "", []):
                    raise NotSupported(f"{field}: {NO_CUSTOM_LOGIT_PROCESSOR}")
        return open_passthrough(self.upstream, path, body, key=key, deadline=deadline)


#: Seconds between asks about the model while no worker has answered (with health checks
#: off; else their interval).
_REDISCOVER_SECONDS = 1.0
