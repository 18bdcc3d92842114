"""`ObserveExchanges`: each HTTP exchange counted in /metrics and its requests in the access log.

Synopsis::

    app.asgi_app = ObserveExchanges(app.asgi_app, metrics, log_requests=False)
    exchange = exchange_of(request.scope)        # in a view: the sink of its RequestTimings
    timing = RequestTiming.start(exchange)

The middleware learns the status from `http.response.start` and whether the final body
message went out; a view tells it the endpoint (the route rule, so `/v1/models/x` and
`/v1/models/y` are one series) and its requests (the exchange is their `RequestSink`:
`RequestTiming.for_item` hands it each one). When the exchange ends, however it ends, it
takes each request's `RequestRecord`, decides which ones count in /metrics as answers
(`answers`: here and nowhere else), counts one HTTP response, and writes one
`tributary.access` line per request (one per batch item). An exchange that ended before its
response did (the client left, or shutdown cut it) is `disconnected`, with status 499 when no
status had been sent (nginx's "client closed request"). Exchanges on a generation route that
never reached the engine (a 400, a full queue) get one line with a null rid.

Prompt text is never logged unless `log_requests` is set (`--log-requests`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .metrics import Metrics
    from .record import RequestRecord
    from .timing import RequestTiming

__all__ = [
    "GENERATION_PATHS",
    "Exchange",
    "JsonFormatter",
    "ObserveExchanges",
    "answers",
    "exchange_of",
]

LOGGER = logging.getLogger("tributary.access")

#: Routes that give the engine work: generations and embeddings (refused while draining;
#: logged even without a request).
GENERATION_PATHS = frozenset(
    {
        "/generate",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/embeddings",
        "/encode",
    }
)

#: The status logged and counted for an exchange that ended before any status was sent.
CLIENT_CLOSED = 499

_KEY = "tributary.exchange"

ASGIApp = Any


@dataclasses.dataclass
class Exchange:
    """One HTTP exchange, and the `RequestSink` of its requests' timings."""

    metrics: Metrics | None
    method: str
    path: str
    endpoint: str = "unmatched"
    status: int | None = None
    complete: bool = False  # the final body message was sent
    #: The app raised: its answer failed to render (before or after its status went out).
    failed: bool = False
    #: Its engine requests, in order (`RequestTiming.for_item`); none refers back to it.
    requests: list[RequestTiming] = dataclasses.field(default_factory=list)

    def begin(self, item: RequestTiming) -> None:
        self.requests.append(item)


def exchange_of(scope: Any) -> Exchange | None:
    """The exchange of this ASGI scope (None outside `ObserveExchanges`)."""
    exchange: Exchange | None = scope.get(_KEY)
    return exchange


class ObserveExchanges:
    def __init__(self, app: ASGIApp, metrics: Metrics | None, *, log_requests: bool) -> None:
        self.app = app
        self.metrics = metrics
        self.log_requests = log_requests

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = Exchange(self.metrics, scope["method"], scope["path"])
        scope[_KEY] = exchange

        async def send_observed(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                exchange.complete = True

        try:
            await self.app(scope, receive, send_observed)
        except Exception:  # not a cancellation (a client that left): that is no failure
            exchange.failed = True
            raise
        finally:
            self._ended(exchange)

    def _ended(self, exchange: Exchange) -> None:
        status = exchange.status if exchange.status is not None else CLIENT_CLOSED
        metrics = self.metrics
        if metrics is not None:
            metrics.count_http(exchange.endpoint, exchange.method, status)
        log = LOGGER.isEnabledFor(logging.INFO)
        if not exchange.requests:
            if log and exchange.endpoint in GENERATION_PATHS:
                self._log(access_fields(exchange, status, None, self.log_requests))
            return
        if metrics is None and not log:
            return
        records = [item.record() for item in exchange.requests]
        if metrics is not None:
            # An answer counts once it was built: an exchange whose answer failed to render
            # (a 500, or an exception once its stream had begun) counts none of its requests.
            responded = (
                exchange.status is not None and exchange.status < 500 and not exchange.failed
            )
            for record in answers(records, responded=responded):
                metrics.observe_finished(record)
        if log:
            for record in records:
                self._log(access_fields(exchange, status, record, self.log_requests))

    @staticmethod
    def _log(fields: dict[str, Any]) -> None:
        text = " ".join(f"{k}={_text(v)}" for k, v in fields.items())
        LOGGER.info("%s", text, extra={"access": fields})


def answers(records: Sequence[RequestRecord], *, responded: bool) -> list[RequestRecord]:
    """The requests of an ended exchange that /metrics counts as answers, decided here and
    nowhere else: each one that `answered`, provided a response was sent at all (a client
    that left before its status line was told nothing) and its answer was built (`responded`
    is False after a 5xx or an exception from the app), and of requests that are one answer
    (`whole`: a `/v1` response) none unless every one answered (one failed choice fails
    the whole response, and its client gets an error)."""
    if not responded:
        return []
    answered = [record for record in records if record.answered]
    if len(answered) < len(records) and any(record.whole for record in records):
        return []
    return answered


def access_fields(
    exchange: Exchange, status: int, item: RequestRecord | None, log_requests: bool
) -> dict[str, Any]:
    """One access log line's fields, in order."""
    fields: dict[str, Any] = {
        "rid": item.rid if item is not None else None,
        "method": exchange.method,
        "route": exchange.path,
        "status": status,
        "prompt_tokens": item.prompt_tokens if item is not None else 0,
        "completion_tokens": item.completion_tokens if item is not None else 0,
        "finish": item.finish if item is not None else None,
        "e2e_latency": item.e2e_latency if item is not None else None,
        "disconnected": not exchange.complete,
    }
    if log_requests and item is not None and item.request is not None:
        request = item.request
        fields["prompt"] = request.text if request.text is not None else request.input_ids
    return fields


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6f}"
    # Bare only when it cannot be misread: a client's rid with a newline or a tab would
    # otherwise forge a line or a field (json.dumps escapes them).
    if isinstance(value, str) and value.isprintable() and " " not in value and '"' not in value:
        return value
    return json.dumps(value, ensure_ascii=False)


class JsonFormatter(logging.Formatter):
    """One JSON object per line (`--log-format json`): time, level, logger, message, and for
    an access line its fields at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            obj.update(access)
        else:
            obj["message"] = record.getMessage()
        if record.exc_info:
            obj["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False)
