"""Every error the engine raises or delivers, each knowing its HTTP status.

The hierarchy::

    EngineError                      500  base class; also "the runner failed"
    ├── BadRequest                   400  the request itself is wrong
    │   ├── InvalidSamplingParams    400  a sampling value or key is wrong
    │   ├── ContextLengthExceeded    400  prompt (+ max_new_tokens) does not fit the context
    │   └── DuplicateRequestId       400  a request with this rid is in flight
    ├── QueueFull                    503  the waiting queue is at --max-queued-requests
    │   └── GrammarCompilerBusy      503  no grammar checker or compile thread free in time
    ├── EngineClosed                 503  the engine is shutting down or not started
    ├── RunnerFailure                500  the model runner raised during a step
    ├── RequestTruncated             500  the output channel closed before a terminal item
    ├── NotSupported                 501  this engine cannot do it (a remote fleet: tokenize...)
    └── WorkerFailure                any  a remote worker's answer, its status kept (4xx, 5xx)

`app` maps errors to HTTP with `error.http_status` and `error.message` alone, so a status is
decided here and nowhere else. Messages follow SGLang's wording where SGLang has one, because
clients match on them.
"""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "ContextLengthExceeded",
    "DuplicateRequestId",
    "EngineClosed",
    "EngineError",
    "GrammarCompilerBusy",
    "InvalidSamplingParams",
    "NotSupported",
    "QueueFull",
    "RequestTruncated",
    "RunnerFailure",
    "WorkerFailure",
]


class EngineError(Exception):
    """Base class. `http_status` is what an HTTP front end should answer with."""

    http_status: int = 500
    err_type: str = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(EngineError):
    http_status = 400
    err_type = "invalid_request_error"


class InvalidSamplingParams(BadRequest):
    pass


class ContextLengthExceeded(BadRequest):
    pass


class DuplicateRequestId(BadRequest):
    def __init__(self, rid: str) -> None:
        super().__init__(f"Duplicate request ID detected: {rid}")
        self.rid = rid


class QueueFull(EngineError):
    http_status = 503
    err_type = "queue_full"
    #: Seconds a client should wait before retrying (sent as Retry-After).
    retry_after = 1


class GrammarCompilerBusy(QueueFull):
    """No grammar checker or compile thread was free in time: a 503 with Retry-After, as a
    full queue (engine/grammar_guard.py)."""

    err_type = "grammar_compiler_busy"


class EngineClosed(EngineError):
    http_status = 503
    err_type = "unavailable"


class RunnerFailure(EngineError):
    http_status = 500
    err_type = "runner_failure"


class RequestTruncated(EngineError):
    http_status = 500
    err_type = "internal_error"

    def __init__(self, message: str = "response truncated before completion") -> None:
        super().__init__(message)


class NotSupported(EngineError):
    """The engine serving this request cannot do what it asks (a remote fleet has no tokenizer
    at the front, for one); the message names what and why."""

    http_status = 501
    err_type = "not_implemented"


class WorkerFailure(EngineError):
    """A remote worker refused or failed a request: its status is kept (a 400 for the
    client's bad input, a 503 when no worker could take it, a 502 for a broken upstream)."""

    err_type = "worker_error"

    def __init__(self, message: str, *, status: int = 502) -> None:
        super().__init__(message)
        self.http_status = status
