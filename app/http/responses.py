"""JSON on the wire, as both APIs write it: compact, in insertion order, encoded as SGLang's
orjson encodes it.

Key order is part of the contract (clients and parity fixtures compare bytes), so objects are
built as ordered dicts and encoded with `encode_json`, never through a key-sorting encoder.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from quart import Response

__all__ = ["encode_json", "json_response"]


def encode_json(obj: Any) -> bytes:
    """Compact UTF-8 JSON in insertion order, encoded with orjson as SGLang does (so floats
    read the same, and a non-finite float is null)."""
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits, a non-string key
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        encode_json(obj), status=status, headers=headers, content_type="application/json"
    )
