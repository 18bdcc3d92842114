"""Reading a request body as JSON, within the request's deadline.

Synopsis::

    body, deadline = await read_within_deadline(settings)    # in a view: the body and the
                                                             # deadline its work must keep
    body = await read_json_body()                            # without a deadline
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from quart import request
from werkzeug.exceptions import RequestEntityTooLarge

from tributary.engine import BadRequest

from ..settings import ServerSettings
from .limits import TIMEOUT_HEADER, Deadline, RequestTooLarge

__all__ = ["read_json_body", "read_within_deadline"]


async def read_within_deadline(settings: ServerSettings) -> tuple[Any, Deadline]:
    """The current request's deadline (the server's `--request-timeout` and the request's
    `X-Request-Timeout` header) and its JSON body, read within that deadline."""
    deadline = Deadline.for_request(settings, request.headers.get(TIMEOUT_HEADER))
    with deadline.applied():
        body = await read_json_body()
    return body, deadline


async def read_json_body() -> Any:
    """The current request's body as JSON; anything that is not usable JSON is a
    `BadRequest` (400), never a 500 later on; a body past the size limit, `RequestTooLarge`
    (413), raised as soon as it passes the limit."""
    try:
        data = await request.get_data(as_text=False)
    except RequestEntityTooLarge:
        raise RequestTooLarge(request.max_content_length) from None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        # ValueError covers malformed JSON, bad UTF-8 and integers over Python's 4,300-digit
        # limit; RecursionError, nesting deeper than the parser's stack.
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else exc
        raise BadRequest(f"Invalid JSON in the request body: {reason}") from None
    # JSON may spell unpaired UTF-16 surrogates ("\\ud800"), which are not Unicode: they
    # would fail much later, when the response is encoded (a 500, or a cut stream). orjson
    # refuses them fast; what else it refuses (integers beyond 64 bits) is checked slowly.
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise BadRequest(
                "Invalid JSON in the request body: a string holds an unpaired UTF-16 surrogate."
            ) from None
    return body
