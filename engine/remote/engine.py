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
from .discovery import ModelUnknown, discover_model, openai_model_name, unknown_model
from .fleet import Attempts, Breaker, Fleet, Together, Worker, WorkerKind
from .health import run_health_checks
from .passthrough import Answer, open_passthrough
from .wire import (
    UPSTREAM_FAILURES,
    AnswerTooLarge,
    SendTracker,
    SSEPayloads,
    counts_against_worker,
    error_message,
    is_retryable_status,
    lost_failure,
    read_error_body,
    sent_then_failed,
    transport_failure_text,
)

__all__ = [
    "UPSTREAM_FAILURES",
    "RemoteConfig",
    "RemoteEngine",
    "RemoteWorkerStats",
    "open_remote_engine",
]

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
    #: The longest a worker may stay silent once it has a request (`--worker-timeout`): for
    #: its answer's headers (a unary answer comes whole, once generated), then between two
    #: chunks of its body. Past it the item ends with a 504, not retried elsewhere.
    worker_timeout: float = 600.0
    #: How long a worker may take to name its model (an OpenAI worker's `/v1/models`, asked
    #: before its first request); past it the request is retried on another worker.
    info_timeout: float = 5.0
    #: The largest answer the front holds whole (`--max-worker-answer-bytes`): a unary
    #: answer it relays (chat completions). Past it: a 502, not retried.
    max_answer_bytes: int = 64 << 20
    #: The largest single event of a worker's stream the front reads (`/generate`,
    #: `/v1/completions`): SGLang's cumulative frames hold the whole text so far. Past it: a
    #: 502, not retried.
    max_event_bytes: int = 16 << 20
    #: The most of a worker's error answer the front reads; the rest is cut (the status
    #: still decides: a 503 is retried elsewhere, a 400 is the client's).
    max_error_bytes: int = 1 << 20
    #: Forward `custom_logit_processor` (`/generate`, `/v1/completions`, chat relays) to the
    #: workers (`--enable-custom-logit-processor` at the front). Off, it is refused with a
    #: 501: a worker started with that flag runs the Python code a client sends.
    enable_custom_logit_processor: bool = False
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
    #: The items of its client request (a batch, n > 1): one worker for all (`_Group`).
    group: _Group | None = None
    #: Whether the current try's worker has the whole request (`SendTracker`).
    tracker: SendTracker | None = None


class _Group(Together):
    """The items of one client request (a batch, n > 1), as `prepare` received them: they go
    to one worker, as SGLang's gateway sends a batch body to one worker whole, so a poison
    batch reaches one worker, never one per item."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _GroupedRequest(GenerateRequest):
    """A request `prepare` saw with the other items of its client request."""

    group: _Group = dataclasses.field(repr=False, compare=False)


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
        #: Items ended by a worker's failure after it had the request, never retried
        #: (`UPSTREAM_FAILURES` are the reasons): `tributary:front_upstream_failures_total`.
        self.upstream_failures = dict.fromkeys(UPSTREAM_FAILURES, 0)

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

    async def prepare(self, items: Sequence[GenerateRequest]) -> list[GenerateRequest]:
        """The workers tokenize and compile grammars; here the items of one client request
        only learn that they belong together (`_Group`). An item submitted unprepared goes
        on its own."""
        group = _Group()
        names = [f.name for f in dataclasses.fields(GenerateRequest)]
        return [
            _GroupedRequest(**{name: getattr(item, name) for name in names}, group=group)
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
        item = _Item(rid, request, sender, prompt_tokens=prompt, group=_group_of(request))
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
                    url = f"{worker.url}/abort_request"
                    async with self._client.stream("POST", url, json={"rid": rid}) as response:
                        await read_error_body(response, _SMALL_BODY)
                # An OpenAI server has no abort route: closing the stream is its abort.
            except httpx.HTTPError as exc:
                LOGGER.info("abort of %s at %s failed: %r", rid, worker.url, exc)

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
                message = f"Internal error while forwarding the request ({type(exc).__name__})."
                self._deliver(item, Error(item.rid, WorkerFailure(message, status=500)))

    async def _attempts(self, item: _Item) -> None:
        assert item.stream is not None
        attempts = Attempts(
            self.fleet,
            self.config,
            item.request.input_ids if item.request.input_ids is not None else item.request.text,
            deadline=item.stream.deadline,
            skip_kind="openai" if openai.unsupported_fields(item.request) else None,
            together=item.group,
        )
        failure: EngineError = WorkerFailure(
            "No worker is available to serve the request.", status=503
        )
        while (worker := await attempts.next()) is not None:
            retry = await self._attempt(item, worker)
            if retry is None:
                return
            failure = retry
        lost = item.group.lost if item.group is not None else None
        if isinstance(lost, EngineError):
            failure = lost  # a sibling's worker had it and died: not tried elsewhere
        self._deliver(item, Error(item.rid, failure))

    async def _attempt(self, item: _Item, worker: Worker) -> EngineError | None:
        """One try on `worker`. Returns the failure if the item may be retried elsewhere;
        None once the item has ended (or was aborted, which cancels this). A worker removed
        before the item's first output gives it up (`remove_worker` cancels the try): it is
        retried elsewhere if the worker did not have the whole request yet, else it ends
        with a 503 (a request a worker had is never handed to another)."""
        with trio.CancelScope() as scope:
            item.attempt = scope
            return await self._try(item, worker)
        if item.ended:
            return None  # cut while reading what followed its terminal item: nothing to retry
        assert self._nursery is not None
        self._nursery.start_soon(self._post_abort, worker, item.rid)
        if item.tracker is not None and item.tracker.sent:
            message = (
                f"Worker {worker.id} was removed from the fleet while it had the request; "
                "the request is not retried on another worker."
            )
            self._deliver(item, Error(item.rid, WorkerFailure(message, status=503)))
            return None
        return WorkerFailure(f"Worker {worker.id} was removed from the fleet.", status=503)

    async def _try(self, item: _Item, worker: Worker) -> EngineError | None:
        item.worker = worker
        worker.in_flight += 1
        reader: sglang.GenerateStreamReader | openai.CompletionStreamReader | None = None
        tracker = item.tracker = SendTracker()
        status: int | None = None  # an error status whose body is being read
        config = self.config
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
            stream = self._client.stream("POST", url, json=body, extensions=tracker.extensions)
            async with stream as response:
                if response.status_code != 200:
                    status = response.status_code
                    raw = await read_error_body(response, config.max_error_bytes)
                    return self._failed(
                        item, worker, status, error_message(raw, status), started=False
                    )
                payloads = SSEPayloads(config.max_event_bytes)
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
        except (
            httpx.HTTPError,
            ValueError,  # a frame that is not JSON
            KeyError,
            IndexError,
            AnswerTooLarge,
            ModelUnknown,  # before the request was sent: another worker may take it
        ) as exc:
            started = reader is not None and reader.started
            failure, reason = self.worker_failed(
                worker, exc, sent=tracker.sent, started=started, status=status, what=item.rid
            )
            if reason is None:
                return failure  # the worker never had the whole request: retried elsewhere
            if reason != "ended":
                assert self._nursery is not None
                self._nursery.start_soon(self._post_abort, worker, item.rid)
                if reason in ("dropped", "timeout") and item.group is not None:
                    # Its siblings would be lost the same way: none goes anywhere now.
                    item.group.lost = failure
            self._deliver(item, Error(item.rid, failure))
            return None
        finally:
            worker.in_flight -= 1
            item.worker = None

    def worker_failed(
        self,
        worker: Worker,
        exc: Exception,
        *,
        sent: bool,
        started: bool,
        status: int | None = None,
        what: str,
    ) -> tuple[WorkerFailure, str | None]:
        """An exchange with `worker` failed with `exc` (a transport error, an answer past
        the limits or one the front cannot read, a model it did not name): count it against
        the worker, log it with the worker's URL, and say what it means for the request,
        with a message for its client that names the worker by number only.

        `sent`: the worker had the whole request (`SendTracker`); `started`: its answer had
        begun (some of it went to the client); `status`: it had answered with that error
        status, whose body was being read. Returns the failure and a reason: None, the
        worker never had the whole request, so another worker may take it (a retry); else
        the request ends with this failure, never retried: `UPSTREAM_FAILURES`' reason
        (counted in `upstream_failures`) when the worker had it and then dropped it, went
        silent or sent too much, "ended" for any other failure after the answer began."""
        worker.errors_total += 1
        worker.breaker.record_failure()
        LOGGER.warning(
            "worker %d (%s) failed %s%s: %r",
            worker.id,
            worker.url,
            what,
            " mid-answer" if started else "",
            exc,
        )
        if isinstance(exc, AnswerTooLarge) or sent_then_failed(exc, sent=sent or started):
            reason, code, message = lost_failure(
                worker.id,
                exc,
                started=started,
                worker_timeout=self.config.worker_timeout,
                status=status,
            )
            self.upstream_failures[reason] += 1
            return WorkerFailure(message, status=code), reason
        detail = str(exc) if isinstance(exc, ModelUnknown) else transport_failure_text(exc)
        if started:
            message = f"Worker {worker.id} failed mid-answer: {detail}."
            return WorkerFailure(message, status=502), "ended"
        return WorkerFailure(f"Worker {worker.id} failed: {detail}.", status=503), None

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
        """Hand a request to one worker whole (`passthrough.open_passthrough`). A body with
        a custom logit processor (SGLang's `custom_logit_processor`, vLLM's
        `logits_processors`) is refused with `NotSupported` unless the front relays them."""
        if self._closed:
            raise EngineClosed("The engine is shutting down.")
        if not self.config.enable_custom_logit_processor:
            for field in CODE_FIELDS:
                if body.get(field) not in (None, "", []):
                    raise NotSupported(f"{field}: {NO_CUSTOM_LOGIT_PROCESSOR}")
        return open_passthrough(self, path, body, key=key, deadline=deadline)

    async def model_of(self, worker: Worker) -> str:
        """The model name a worker's OpenAI API serves (its `/v1/models`), asked once;
        `ModelUnknown` unless it answers within `info_timeout`."""
        model = self._models.get(worker.url)
        if model is None:
            model = await openai_model_name(self._client, worker, timeout=self.config.info_timeout)
            if not worker.removed:
                self._models[worker.url] = model
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
#: once the item has its terminal frame, and how much of it the front reads.
_TRAILER_SECONDS = 1.0
_TRAILER_BYTES = 64 << 10

#: The most the front reads of an answer it only needs the status of (`/abort_request`).
_SMALL_BODY = 64 << 10

#: Seconds an idle keep-alive connection to a worker is kept. Below the 5 s that uvicorn
#: (SGLang, vLLM), Hypercorn (Tributary) and llama.cpp's server keep one: the front drops
#: an idle connection before the worker would, so a request is never sent on a connection
#: the worker is closing at that moment (which would read as the worker dropping it).
KEEPALIVE_SECONDS = 4.0

#: Request fields that make a worker run code the client sent: SGLang's custom logit
#: processor (a pickled callable), vLLM's logits processors (classes by qualified name).
CODE_FIELDS = ("custom_logit_processor", "logits_processors")

NO_CUSTOM_LOGIT_PROCESSOR = (
    "This server does not forward custom logit processors to its workers (a worker that "
    "takes them runs Python code the client sends). Start the front with "
    "--enable-custom-logit-processor to forward them, or send the request to a worker."
)


async def _read_to_end(chunks: AsyncIterator[bytes]) -> None:
    """Read what follows the terminal frame so the connection goes back to the keep-alive
    pool: httpx closes a connection whose response was left unread, and every request would
    then open a new one. A worker that holds the stream open, or breaks it now, costs the
    item nothing: its answer is already delivered (and at most `_TRAILER_BYTES` are read)."""
    with trio.move_on_after(_TRAILER_SECONDS):
        read = 0
        try:
            async for chunk in chunks:
                read += len(chunk)
                if read > _TRAILER_BYTES:
                    return
        except httpx.HTTPError:
            pass


def _worker_leaving(done: Done) -> bool:
    reason = done.finish_reason
    return reason.get("type") == "abort" and reason.get("status_code") == 503


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteWorkerStats(WorkerStats):
    """`WorkerStats` with the worker's number in the fleet (what client errors name)."""

    id: int = 0


def _worker_stats(worker: Worker) -> WorkerStats:
    return RemoteWorkerStats(
        id=worker.id,
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


def _group_of(request: GenerateRequest) -> _Group:
    return request.group if isinstance(request, _GroupedRequest) else _Group()
