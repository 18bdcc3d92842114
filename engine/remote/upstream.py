"""`Upstream`: what every exchange of the front with a worker shares, whoever makes it (the
forwarded items, `forward`; the requests handed to a worker whole, `passthrough`).

Synopsis::

    upstream = Upstream(config, fleet, client)
    model = await upstream.model_of(worker)          # an OpenAI worker's model, asked once
    failure, reason = upstream.worker_failed(worker, exc, sent=..., started=..., what=rid)
    upstream.abort_soon(worker, rid)                 # POST /abort_request, shielded

One HTTP client (one keep-alive pool) carries every request to a worker. `worker_failed` is
the one place that decides what a broken exchange means: retried on another worker only if
the worker never had the whole request (a request a worker had may be what killed it);
`upstream_failures` counts the requests lost that way (`/metrics`).
"""

from __future__ import annotations

import logging

import httpx
import trio

from ..errors import WorkerFailure
from .config import RemoteConfig
from .discovery import ModelUnknown, openai_model_name
from .fleet import Fleet
from .wire import (
    UPSTREAM_FAILURES,
    AnswerTooLarge,
    lost_failure,
    read_error_body,
    sent_then_failed,
    transport_failure_text,
)
from .worker import Worker

__all__ = ["Upstream"]

LOGGER = logging.getLogger("tributary.engine.remote")

#: The most the front reads of an answer it only needs the status of (`/abort_request`).
_SMALL_BODY = 64 << 10


class Upstream:
    """The front's side of its workers: the settings, the fleet, the HTTP client, the model
    name each OpenAI worker serves, and the count of requests its workers lost. Belongs to
    one Trio run; `nursery` (set by `open_remote_engine`) runs the aborts it posts."""

    def __init__(self, config: RemoteConfig, fleet: Fleet, client: httpx.AsyncClient) -> None:
        self.config = config
        self.fleet = fleet
        #: The HTTP client every request to a worker goes through (one keep-alive pool).
        self.client = client
        self.nursery: trio.Nursery | None = None
        self._models: dict[str, str] = {}  # openai worker URL -> its model name
        #: Items ended by a worker's failure after it had the request, never retried
        #: (`UPSTREAM_FAILURES` are the reasons): `tributary:front_upstream_failures_total`.
        self.upstream_failures = dict.fromkeys(UPSTREAM_FAILURES, 0)

    async def model_of(self, worker: Worker) -> str:
        """The model name a worker's OpenAI API serves (its `/v1/models`), asked once;
        `ModelUnknown` unless it answers within `info_timeout`."""
        model = self._models.get(worker.url)
        if model is None:
            model = await openai_model_name(self.client, worker, timeout=self.config.info_timeout)
            if not worker.removed:
                self._models[worker.url] = model
        return model

    def forget_model(self, worker: Worker) -> None:
        """`worker` left the fleet: a worker added again at its URL may serve another model
        (a redeployed vLLM)."""
        self._models.pop(worker.url, None)

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

    def abort_soon(self, worker: Worker, rid: str) -> None:
        """Tell `worker` to abort `rid` (`/abort_request`), in a task of its own, shielded,
        for at most `abort_timeout` seconds: it reaches the worker even when the engine is
        closing. An OpenAI server has no abort route: closing the stream is its abort."""
        if self.nursery is not None:
            self.nursery.start_soon(self._post_abort, worker, rid)

    async def _post_abort(self, worker: Worker, rid: str) -> None:
        # Shielded: it must reach the worker even when the engine is closing.
        with trio.move_on_after(self.config.abort_timeout) as scope:
            scope.shield = True
            try:
                if worker.kind == "sglang":
                    url = f"{worker.url}/abort_request"
                    async with self.client.stream("POST", url, json={"rid": rid}) as response:
                        await read_error_body(response, _SMALL_BODY)
                # An OpenAI server has no abort route: closing the stream is its abort.
            except httpx.HTTPError as exc:
                LOGGER.info("abort of %s at %s failed: %r", rid, worker.url, exc)
