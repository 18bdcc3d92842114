"""`bearer_is`, `x_api_key_is`: the API-key checks of the app's hook (`app/routes.py`:
`--api-key`, `--admin-api-key`) and of a front's worker routes (`sglang/admin.py`).

Synopsis::

    if not bearer_is(settings.admin_api_key): raise Unauthorized(...)
    x_api_key_is(key)          # Anthropic's clients send the key as `x-api-key` instead
"""

from __future__ import annotations

import hmac

from quart import request

__all__ = ["bearer_is", "x_api_key_is"]


def bearer_is(key: str) -> bool:
    """The request's `Authorization: Bearer` key is `key` (constant-time compare; the scheme
    name case-insensitively, RFC 7235, the key itself not)."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), key.encode())


def x_api_key_is(key: str) -> bool:
    """The request's `x-api-key` header (Anthropic's clients', which llama-server takes too)
    is `key`, compared in constant time."""
    given = request.headers.get("x-api-key")
    return given is not None and hmac.compare_digest(given.strip().encode(), key.encode())
