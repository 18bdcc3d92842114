"""Streaming `/v1/messages`: Anthropic's server-sent events, each `event: <type>` then
`data: <json>`.

Synopsis::

    return message_stream_response(stream, head, req, timing)

The events, as Anthropic sends them (the `anthropic` client's `RawMessageStreamEvent`s)::

    message_start        {"message": {id, type, role, content: [], model, stop_reason: null,
                                      stop_sequence: null, usage}}     with the first output
    content_block_start  {"index", "content_block": {"type": "text", "text": ""}}
    content_block_delta  {"index", "delta": {"type": "text_delta", "text"}}    per delta
    content_block_stop   {"index"}
    ... more blocks ...
    message_delta        {"delta": {stop_reason, stop_sequence}, "usage": {output_tokens}}
    message_stop         {}

(every `data` also carries its `type`). Blocks come one after another, numbered from 0: a
thinking block (`thinking_delta`s, then an empty `signature_delta` before it stops, as
llama-server sends), text, and one `tool_use` block per call (`{"type": "tool_use", "id",
"name", "input": {}}`, then `input_json_delta`s whose `partial_json` join into the call's
input). A block stops before the next starts; an answer with no text has no block, as its
unary `content` is empty. When the request reads its output for calls or thinking
(`req.output`), each delta goes through the same parsers as the unary answer, which hold
back text that may still be a call's marker.

The plumbing is `/generate`'s `MultiplexedBody` over the one stream: a frame is rendered at
delivery when the connection allows, a backlog as one write. A failure (an `Error` item, or
an abort) is one `event: error` with Anthropic's error object, and the stream ends there, as
Anthropic's does. Leaving the body early aborts the request.
"""

from __future__ import annotations

from typing import Any

from quart import Response

from tributary.engine import Done, Frame, Output, RequestStream

from ..chat.tool_parsers import ToolCallDelta
from ..chat.tools import OutputDelta
from ..http.multiplex import MultiplexedBody
from ..http.responses import encode_json
from ..http.sse import sse_response
from ..observe.timing import RequestTiming
from .errors import anthropic_error_object
from .protocol import MessagesRequest
from .reply import Reply
from .tools import new_tool_use_id

__all__ = ["MessageStreamBody", "message_stream_response", "sse_named_event"]

Event = tuple[str, dict[str, Any]]
#: A block's kind and its delta's type and text field.
_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


def sse_named_event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + encode_json(data) + b"\n\n"


def message_stream_response(
    stream: RequestStream, head: dict[str, Any], req: MessagesRequest, timing: RequestTiming
) -> Response:
    return sse_response(MessageStreamBody(stream, head, req, timing))


class MessageStreamBody(MultiplexedBody):
    """`head`: the message's `id`, `type`, `role`, `content` and `model`, in that order."""

    renders_frames = True

    def __init__(
        self,
        stream: RequestStream,
        head: dict[str, Any],
        req: MessagesRequest,
        timing: RequestTiming,
    ) -> None:
        self._head = head
        self._stops = req.stop_sequences
        self._read = req.output.stream() if req.output is not None else None
        self._timing = timing
        self._reply = Reply(prompt_tokens=stream.prompt_tokens)
        self._started = False
        #: The open block: its kind ("text", "thinking", or a call's index) and number.
        self._open: tuple[str | int, int] | None = None
        self._blocks = 0
        self._ended = False
        super().__init__([stream])

    def on_item(self, index: int, item: Output) -> None:
        self._timing.observe(item)

    def render_frame(self, index: int, item: Frame) -> bytes:
        self._reply.add(item)  # a Frame never reports a failure
        return self._render(item)

    async def next_chunk(self) -> bytes:
        while not self._ended:
            backlog = await self.next_backlog()
            if backlog is None:
                break
            chunk = b""
            for _, item in backlog:
                failure = self._reply.add(item)
                if failure is not None:
                    self._ended = True
                    return chunk + sse_named_event("error", anthropic_error_object(failure))
                assert isinstance(item, (Frame, Done))  # add() reports every Error
                chunk += self._render(item)
                self._ended = isinstance(item, Done)
            if chunk:
                return chunk
        raise StopAsyncIteration

    def _render(self, item: Frame | Done) -> bytes:
        events: list[Event] = []
        if not self._started:
            self._started = True
            message = {**self._head, "stop_reason": None, "stop_sequence": None}
            message["usage"] = {**self._reply.usage(), "output_tokens": 0}
            events.append(("message_start", {"type": "message_start", "message": message}))
        if self._read is None:
            self._write(events, OutputDelta(content=item.text))
        else:
            self._write(events, self._read.feed(item.text))
            if isinstance(item, Done):
                self._write(events, self._read.finish())
        if isinstance(item, Done):
            self._close(events)
            called = self._read is not None and self._read.called
            self._timing.called_tools = called
            end = {
                "type": "message_delta",
                "delta": self._reply.stop_fields(self._stops, called=called),
                "usage": {"output_tokens": self._reply.completion_tokens},
            }
            events.append(("message_delta", end))
            events.append(("message_stop", {"type": "message_stop"}))
        return b"".join(sse_named_event(name, data) for name, data in events)

    def _write(self, events: list[Event], delta: OutputDelta) -> None:
        for kind, text in (("thinking", delta.reasoning), ("text", delta.content)):
            if text:
                index = self._block(events, kind, {"type": kind, kind: ""})
                name, field = _DELTAS[kind]
                self._delta(events, index, {"type": name, field: text})
        for call in delta.calls:
            self._call(events, call)

    def _call(self, events: list[Event], call: ToolCallDelta) -> None:
        if call.name is not None:  # a call's first delta: its block starts
            self._close(events)
            block = {"type": "tool_use", "id": new_tool_use_id(), "name": call.name, "input": {}}
            self._block(events, call.index, block)
        if call.arguments:
            assert self._open is not None and self._open[0] == call.index  # calls come in turn
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            self._delta(events, self._open[1], delta)

    def _block(self, events: list[Event], kind: str | int, block: dict[str, Any]) -> int:
        """The number of the open block of `kind`, starting it (and stopping another)."""
        if self._open is not None and self._open[0] == kind:
            return self._open[1]
        self._close(events)
        index = self._blocks
        self._blocks += 1
        self._open = (kind, index)
        start = {"type": "content_block_start", "index": index, "content_block": block}
        events.append(("content_block_start", start))
        return index

    def _delta(self, events: list[Event], index: int, delta: dict[str, Any]) -> None:
        events.append(
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        )

    def _close(self, events: list[Event]) -> None:
        if self._open is None:
            return
        kind, index = self._open
        if kind == "thinking":  # Anthropic's clients expect a signature before it stops
            self._delta(events, index, {"type": "signature_delta", "signature": ""})
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        self._open = None
