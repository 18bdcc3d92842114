"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the
model's own chat template.

Unary::

    {"id": "msg_...", "type": "message", "role": "assistant",
     "content": [{"type": "thinking", "thinking", "signature": ""},   # --reasoning-parser
                 {"type": "text", "text"},
                 {"type": "tool_use", "id": "toolu_...", "name", "input"}, ...],  # if any
     "model", "stop_reason": "end_turn" | "max_tokens" | "stop_sequence" | "tool_use",
     "stop_sequence": str | null,
     "usage": {"input_tokens", "cache_read_input_tokens", "output_tokens"}}

Streaming: Anthropic's events (streaming.py). count_tokens: `{"input_tokens": N}`, the prompt
`/v1/messages` would run for the same fields.

The `id` is also the engine request's rid, so `/abort_request` with it aborts the message.
"""

from __future__ import annotations

import uuid
from typing import Any

from quart import Response

from ..generation import collect_into, submit_owned
from ..http.responses import json_response
from ..http.view import ViewRequest
from ..observe.timing import RequestTiming
from .protocol import parse_count_tokens_body, parse_messages_body
from .reply import Reply, content_blocks
from .served import ServedChat
from .streaming import message_stream_response

__all__ = ["count_message_tokens", "create_message"]


async def create_message(served: ServedChat, request: ViewRequest) -> Response:
    """One message (the `ViewRequest` contract): the chat rendered, the one engine request
    submitted with the message's id as its rid, answered whole or as Anthropic's events."""
    req = parse_messages_body(
        request.body,
        vocab_size=served.engine.model_info.vocab_size,
        tool_call_parser=served.tool_call_parser,
        reasoning_parser=served.reasoning_parser,
    )
    served.check_model(req.model)
    timing = RequestTiming.start(request.exchange, whole=True)
    prompt_ids = await served.prompt_ids(req)
    message_id = f"msg_{uuid.uuid4().hex}"
    item = served.generation(prompt_ids, req, message_id)
    (stream,) = await submit_owned(
        served.engine, [item], request, tools=req.tools, schemas="input schemas"
    )
    timing = timing.for_item(stream, item)
    head = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": served.name,
    }
    if req.stream:
        return message_stream_response(stream, head, req, timing)
    reply = Reply(prompt_tokens=stream.prompt_tokens)
    await collect_into([stream], [reply], [timing])
    content, called = content_blocks(reply.text, req.output)
    timing.called_tools = called
    return json_response(
        {
            **head,
            "content": content,
            **reply.stop_fields(req.stop_sequences, called=called),
            "usage": reply.usage(),
        }
    )


async def count_message_tokens(served: ServedChat, body: Any) -> Response:
    req = parse_count_tokens_body(body, tool_call_parser=served.tool_call_parser)
    served.check_model(req.model)
    return json_response({"input_tokens": len(await served.prompt_ids(req))})
