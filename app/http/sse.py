"""Server-sent events as both APIs frame them: `data: <json>\\n\\n` per event, `data: [DONE]\\n\\n`
at the end, and the response that carries them.

Synopsis::

    return sse_response(body)              # body: a StreamedBody, or a DataBody held whole
    chunk = sse_event(obj) + ... + DONE
"""

from __future__ import annotations

from typing import Any

from quart import Response
from quart.wrappers.response import DataBody

from .responses import encode_json
from .streamed import StreamedBody

__all__ = ["DONE", "sse_event", "sse_response"]

DONE = b"data: [DONE]\n\n"

# Proxies (nginx) buffer responses unless told otherwise; a buffered token stream is useless.
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(obj: Any) -> bytes:
    return b"data: " + encode_json(obj) + b"\n\n"


def sse_response(body: StreamedBody | DataBody) -> Response:
    """A stream's response. Its body is a `StreamedBody` (it keeps the delivery contract:
    streamed.py) or bytes already whole (`DataBody`, one chunk, nothing to wait for)."""
    response = Response(body, mimetype="text/event-stream", headers=_HEADERS)
    # Quart-Trio cuts any response after RESPONSE_TIMEOUT (60 s) without a word; a long
    # generation is not a stuck one.
    response.timeout = None
    return response
