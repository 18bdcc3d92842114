"""`open_remote_engine` and `RemoteEngine`: the engine interface served by remote workers.

Synopsis::

    config = RemoteConfig(workers=(("http://10.0.0.5:30000", "sglang"),))
    async with open_remote_engine(config) as eng:            # an EngineService
        async with eng.submit(GenerateRequest(text="Hi")) as stream:
            async for item in stream: ...                      # Frame ... then Done or Error

Each submitted item gets a forwarding task in the engine's nursery. It picks a worker
(`Fleet.choose`, excluding the ones already tried), POSTs the item with a rid of the
front's own choosing (the client's, or a fresh one) and turns the worker's SSE frames into
the same `Frame` / `Done` / `Error` items the local engine gives, through the stream's
`OutputSender` (so a redirected SSE body works unchanged).

Failure contract:

- before the item's first output, a connection failure, a 408/429 or a 5xx (status or error
  frame), or a 503 abort from a worker shutting down is retried on another worker after a
  backoff, at most `max_retries` times and never past the stream's deadline; then the item
  ends with an `Error` carrying the last failure's status (503 if no worker was available);
- after the first output, a failure ends the item with an `Error` (502 for a broken
  connection): a retry would repeat tokens the client already has;
- a worker's 4xx (the client's input) ends the item with that status, no retry.

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
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any

import httpx
import orjson
import trio

from ..core import EngineLoad
from ..errors import (
    BadRequest,
    DuplicateRequestId,
    EngineClosed,
    EngineError,
    NotSupported,
    QueueFull,
    WorkerFailure,
)
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
from ..stream import OutputSender, RequestStream, open_output_channel
from . import openai, sglang
from .discovery import discover_model, openai_model_name, unknown_model
from .fleet import Attempts, Breaker, Fleet, Worker, WorkerKind
from .health import run_health_checks
from .passthrough import Answer, open_passthrough
from .wire import SSEPayloads, counts_against_worker, error_message, is_retryable_status

__all__ = ["RemoteConfig", "RemoteEngine", "open_remote_engine"]

LOGGER = logging.getLogger("tributary.engine.remote")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """A front serving from workers (`tributary serve --worker-url ...`)."""

    workers: tuple[tuple[str, WorkerKind], ...] = ()
    policy: str = "cache_aware"
    served_model_name: str | None = None
    #: Attempts after the first, for failures before the first output.
    max_retries: int = 3
    #: Backoff before retry k (1-based): retry_backoff * 2**(k-1), at most retry_backoff_max.
    retry_backoff: float = 0.05
    retry_backoff_max: float = 1.0
    #: Seconds between health probes of every worker (0: none).
    health_check_interval: float = 5.0
    health_check_timeout: float = 2.0
    connect_timeout: float = 5.0
    #: How long the `/abort_request` a cancelled item sends its worker may take.
    abort_timeout: float = 2.0
    #: A worker's breaker opens after this many failures in a row, for this many seconds
    #: (then one request tries it: half-open).
    breaker_failure_threshold: int = 3
    breaker_open_seconds: float = 5.0
    #: The most items in flight at the front (its `capacity`).
    max_in_flight: int = 4096
    runner: str = "remote"  # what /get_server_info shows


@asynccontextmanager
async def open_remote_engine(config: RemoteConfig) -> AsyncIterator[RemoteEngine]:
    """Open the HTTP client and the engine's nursery (forwarding tasks, health checks), ask the
    workers about the model, and yield the engine. On exit every item still in flight ends
    with a 503 abort and its worker is told to abort it; errors raised in the block reach the
    caller unwrapped."""
    timeout = httpx.Timeout(None, connect=config.connect_timeout)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        breakers = partial(
            Breaker,
            failure_threshold=config.breaker_failure_threshold,
            open_seconds=config.breaker_open_seconds,
        )
        fleet = Fleet(config.workers, policy=config.policy, breaker_factory=breakers)
        engine = RemoteEngine(config, fleet, client)
        base = unknown_model(config.served_model_name or "remote")
        discovered = await engine._discover(base, log_level=logging.WARNING)
        async with open_service_nursery() as nursery:
            engine._nursery = nursery
            if not discovered:
                nursery.start_soon(engine._discover_later, base)
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


@dataclasses.dataclass(eq=False)
class _Item:
    rid: str
    request: GenerateRequest
    sender: OutputSender
    stream: RequestStream | None = None
    scope: trio.CancelScope | None = None  # the forwarding task's
    attempt: trio.CancelScope | None = None  # the current try's
    started: bool = False  # an output has been delivered
    worker: Worker | None = None  # the one holding it now
    ended: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    #: Trio clock when the item's first token reached the front (its `Done` carries it).
    first_token_at: float | None = None


class RemoteEngine:
    """`EngineService` over a `Fleet` of workers. Every method is synchronous and never
    blocks, like `Engine`'s; the network work runs in the engine's nursery."""

    serves_remotely = True

    def __init__(self, config: RemoteConfig, fleet: Fleet, client: httpx.AsyncClient) -> None:
        self.config = config
        self.fleet = fleet
        self._client = client
        self._live: dict[str, _Item] = {}
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._models: dict[str, str] = {}  # openai worker URL -> its model name
        self._generated_tokens = 0
        self._aborted = 0
        self._info = unknown_model(config.served_model_name or "remote")

    # -- what the app reads -------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self._info

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
        return [_worker_stats(w) for w in self.fleet.workers]

    def add_worker(self, url: str, kind: str = "sglang") -> WorkerStats:
        if kind not in ("sglang", "openai"):
            raise ValueError(f"kind must be 'sglang' or 'openai', got {kind!r}")
        return _worker_stats(self.fleet.add(url, kind))  # type: ignore[arg-type]

    def remove_worker(self, url: str) -> WorkerStats:
        removed = self.fleet.remove(url)
        # A worker added again at this URL may serve another model (a redeployed vLLM).
        self._models.pop(removed.url, None)
        for item in self._live.values():
            if item.worker is removed and not item.started and item.attempt is not None:
                item.attempt.cancel()  # retried elsewhere; what has output finishes there
        return _worker_stats(removed)

    async def _discover(self, base: ModelInfo, *, log_level: int) -> bool:
        """Ask the workers about the model; whether one answered (else the model stays
        `base`: a name of the front's and no limits of its own)."""
        info = await discover_model(
            self._client,
            self.fleet.workers,
            timeout=self.config.health_check_timeout,
            base=base,
            log_level=log_level,
        )
        if self.config.served_model_name:
            info = dataclasses.replace(info, name=self.config.served_model_name)
        self._info = info
        return info is not base

    async def _discover_later(self, base: ModelInfo) -> None:
        """No worker answered at start (workers still loading their model, or none added
        yet): ask again until one does, so the model's name (what /v1 requests must name),
        context length and vocabulary become the workers' once they are up."""
        pause = self.config.health_check_interval or _REDISCOVER_SECONDS
        while not await self._discover(base, log_level=logging.DEBUG):
            await trio.sleep(pause)
        LOGGER.info("serving %s, as a worker describes it", self._info.name)

    # -- what stays on the workers ---------------------------------------------------------

    def flush_cache(self) -> bool:
        raise NotSupported(
            "This server fronts a fleet of workers; flush each worker's cache at the worker."
        )

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        raise NotSupported(_NO_TOKENIZER)

    def detokenize(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        raise NotSupported(_NO_TOKENIZER)

    def token_bytes(self, token_id: int) -> bytes:
        raise NotSupported(_NO_TOKENIZER)

    # -- requests -------------------------------------------------------------------------

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
        if request.custom_logit_processor:
            raise NotSupported(
                "Custom logit processors are not forwarded to remote workers; "
                "send the request to a worker started with --enable-custom-logit-processor."
            )
        if request.sampling.n != 1:
            raise BadRequest(f"n={request.sampling.n}: submit one request per sample.")
        if request.input_ids is None and request.text is None:
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        if request.input_ids is not None and not request.input_ids:
            raise BadRequest("input_ids cannot be empty.")
        self._check_kinds(request)
        rid = request.rid if request.rid is not None else uuid.uuid4().hex
        if rid in self._live:
            raise DuplicateRequestId(rid)
        if len(self._live) >= self.config.max_in_flight:
            self._aborted += 1
            raise QueueFull("The request queue is full.")
        sender, receiver = open_output_channel(rid)
        prompt = len(request.input_ids) if request.input_ids is not None else 0
        item = _Item(rid, request, sender, prompt_tokens=prompt)
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
        self._nursery.start_soon(self._forward, item)
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

    def _abort_many(self, items: list[_Item], message: str, status_code: int | None) -> int:
        err_type = None if status_code is None else "aborted"
        for item in items:
            self._abort_item(
                item, abort_reason(message, status_code=status_code, err_type=err_type)
            )
        return len(items)

    def _abort_item(self, item: _Item, reason: FinishReason) -> None:
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
        if worker is not None and self._nursery is not None:
            self._nursery.start_soon(self._post_abort, worker, item.rid)

    async def _post_abort(self, worker: Worker, rid: str) -> None:
        # Shielded: it must reach the worker even when the engine is closing.
        with trio.move_on_after(self.config.abort_timeout) as scope:
            scope.shield = True
            try:
                if worker.kind == "sglang":
                    await self._client.post(f"{worker.url}/abort_request", json={"rid": rid})
                # An OpenAI server has no abort route: closing the stream is its abort.
            except httpx.HTTPError as exc:
                LOGGER.info("abort of %s at %s failed: %s", rid, worker.url, exc)

    def _end(self, item: _Item, out: Output) -> None:
        item.ended = True
        item.sender.send(out)
        item.sender.close()
        # The stream's abort callbacks hold the item: without this, a reference cycle per
        # request for the garbage collector.
        item.stream = None
        if self._live.get(item.rid) is item:
            del self._live[item.rid]

    def _deliver(self, item: _Item, out: Output) -> None:
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

    # -- forwarding -----------------------------------------------------------------------

    async def _forward(self, item: _Item) -> None:
        with trio.CancelScope() as scope:
            item.scope = scope
            if item.ended:
                return
            try:
                await self._attempts(item)
            except Exception as exc:  # a bug here must end this item, not the engine
                LOGGER.exception("forwarding %s failed", item.rid)
                self._deliver(
                    item, Error(item.rid, WorkerFailure(f"{type(exc).__name__}: {exc}", status=500))
                )

    async def _attempts(self, item: _Item) -> None:
        assert item.stream is not None
        attempts = Attempts(
            self.fleet,
            self.config,
            item.request.input_ids if item.request.input_ids is not None else item.request.text,
            deadline=item.stream.deadline,
            skip_kind="openai" if openai.unsupported_fields(item.request) else None,
        )
        failure: EngineError = WorkerFailure(
            "No worker is available to serve the request.", status=503
        )
        while (worker := await attempts.next()) is not None:
            retry = await self._attempt(item, worker)
            if retry is None:
                return
            failure = retry
        self._deliver(item, Error(item.rid, failure))

    async def _attempt(self, item: _Item, worker: Worker) -> EngineError | None:
        """One try on `worker`. Returns the failure if the item may be retried elsewhere;
        None once the item has ended (or was aborted, which cancels this). A worker removed
        before the item's first output gives it up (`remove_worker` cancels the try)."""
        with trio.CancelScope() as scope:
            item.attempt = scope
            return await self._try(item, worker)
        if item.ended:
            return None  # cut while reading what followed its terminal item: nothing to retry
        assert self._nursery is not None
        self._nursery.start_soon(self._post_abort, worker, item.rid)
        return WorkerFailure(f"Worker {worker.url} was removed.", status=503)

    async def _try(self, item: _Item, worker: Worker) -> EngineError | None:
        item.worker = worker
        worker.in_flight += 1
        reader: sglang.GenerateStreamReader | openai.CompletionStreamReader | None = None
        try:
            if worker.kind == "openai":
                model = await self.model_of(worker)
                url = f"{worker.url}/v1/completions"
                body = openai.completions_body(item.request, item.rid, model)
                reader = openai.CompletionStreamReader(item.rid, item.request)
            else:
                url = f"{worker.url}/generate"
                body = sglang.generate_body(item.request, item.rid)
                reader = sglang.GenerateStreamReader(item.rid)
            async with self._client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    status = response.status_code
                    message = error_message(await response.aread(), status)
                    return self._failed(item, worker, status, message, started=False)
                payloads = SSEPayloads()
                chunks = response.aiter_bytes()
                async for chunk in chunks:
                    for payload in payloads.feed(chunk):
                        if payload == b"[DONE]":
                            break
                        outcome = self._take(item, worker, reader, orjson.loads(payload))
                        if not isinstance(outcome, _More):
                            await _read_to_end(chunks)
                            return outcome
                    else:
                        continue
                    await _read_to_end(chunks)
                    break  # [DONE]
            if isinstance(reader, openai.CompletionStreamReader):
                done = reader.done()
                if done is not None:
                    self._deliver(item, done)
                    worker.breaker.record_success()
                    return None
            raise httpx.RemoteProtocolError("the stream ended without a terminal frame")
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            # ValueError: a frame that is not JSON; KeyError, IndexError: a /v1/models answer
            # without a model. Either way the worker broke the exchange.
            worker.errors_total += 1
            worker.breaker.record_failure()
            detail = str(exc) or type(exc).__name__
            started = reader is not None and reader.started
            if not started:
                return WorkerFailure(f"Worker {worker.url} failed: {detail}", status=503)
            self._deliver(
                item,
                Error(
                    item.rid,
                    WorkerFailure(f"Worker {worker.url} failed mid-stream: {detail}", status=502),
                ),
            )
            return None
        finally:
            worker.in_flight -= 1
            item.worker = None

    def _take(
        self,
        item: _Item,
        worker: Worker,
        reader: sglang.GenerateStreamReader | openai.CompletionStreamReader,
        obj: Any,
    ) -> EngineError | _More | None:
        """One frame of the worker's: `_MORE` to read on, else what `_try` returns."""
        out = reader.read(obj)
        if out is None:
            return _MORE
        if isinstance(out, Error):
            status = out.error.http_status
            return self._failed(item, worker, status, out.error.message, started=reader.started)
        if isinstance(out, Done) and _worker_leaving(out) and not reader.started:
            # A worker shutting down refused it before any output: another may not.
            worker.errors_total += 1
            return WorkerFailure(str(out.finish_reason.get("message")), status=503)
        self._deliver(item, out)
        if isinstance(out, Done):
            worker.breaker.record_success()
            return None
        return _MORE

    def _failed(
        self, item: _Item, worker: Worker, status: int, message: str, *, started: bool
    ) -> EngineError | None:
        """A worker's error answer (a status, or an error frame)."""
        error = WorkerFailure(message, status=status)
        if counts_against_worker(status):
            worker.errors_total += 1
            worker.breaker.record_failure()
        if is_retryable_status(status) and not started:
            return error
        self._deliver(item, Error(item.rid, error))
        return None

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client every request to a worker goes through (one keep-alive pool)."""
        return self._client

    def open_passthrough(
        self, path: str, body: dict[str, Any], *, key: str | None, deadline: float = math.inf
    ) -> AbstractAsyncContextManager[Answer]:
        """Hand a request to one worker whole (`passthrough.open_passthrough`)."""
        if self._closed:
            raise EngineClosed("The engine is shutting down.")
        return open_passthrough(self, path, body, key=key, deadline=deadline)

    async def model_of(self, worker: Worker) -> str:
        """The model name a worker's OpenAI API serves (its `/v1/models`), asked once."""
        model = self._models.get(worker.url)
        if model is None:
            model = self._models[worker.url] = await openai_model_name(self._client, worker.url)
        return model


class _More:
    """`_take`'s answer for "the item goes on: read the next frame"."""


_MORE = _More()

_NO_TOKENIZER = (
    "This server fronts a fleet of workers and has no tokenizer of its own (tokenization "
    "stays on the workers); call /tokenize or /detokenize on a worker."
)


#: Seconds between asks about the model while no worker has answered (with health checks
#: off; else their interval).
_REDISCOVER_SECONDS = 1.0

#: How long the rest of a worker's body (`[DONE]`, the chunked body's end) may take to come
#: once the item has its terminal frame.
_TRAILER_SECONDS = 1.0


async def _read_to_end(chunks: AsyncIterator[bytes]) -> None:
    """Read what follows the terminal frame so the connection goes back to the keep-alive
    pool: httpx closes a connection whose response was left unread, and every request would
    then open a new one. A worker that holds the stream open, or breaks it now, costs the
    item nothing: its answer is already delivered."""
    with trio.move_on_after(_TRAILER_SECONDS):
        try:
            async for _ in chunks:
                pass
        except httpx.HTTPError:
            pass


def _worker_leaving(done: Done) -> bool:
    reason = done.finish_reason
    return reason.get("type") == "abort" and reason.get("status_code") == 503


def _worker_stats(worker: Worker) -> WorkerStats:
    return WorkerStats(
        url=worker.url,
        kind=worker.kind,
        breaker=worker.breaker.state,
        healthy=worker.healthy,
        in_flight=worker.in_flight,
        requests_total=worker.requests_total,
        errors_total=worker.errors_total,
        retries_total=worker.retries_total,
        breaker_opened_total=worker.breaker.opened_total,
    )
