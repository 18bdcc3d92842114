"""The assistant's reply: one engine stream folded into Anthropic's `Message` (the folding is
`generation/generated.py: Generated`'s, as for OpenAI's choices).

Synopsis::

    reply = Reply(prompt_tokens=stream.prompt_tokens)
    failure = reply.add(item)                    # each engine item, at delivery
    reply.stop_fields(stop_sequences)            # {"stop_reason", "stop_sequence"}
    reply.usage()                                # {"input_tokens", ..., "output_tokens"}
    await collect_into([stream], [reply], [timing])   # unary (app/generation)

Stop reasons, from the engine's finish reason: `length` is `max_tokens` (the budget, or the
context is full); a stop with tool calls in the output is `tool_use`; a stop string is
`stop_sequence`, with `stop_sequence` set to it; a stop token (EOS, end of turn, a forced
call's grammar completing) is `end_turn`. Usage is llama-server's: `input_tokens` are the prompt
tokens computed, `cache_read_input_tokens` those restored from the prefix cache (their sum is
the prompt), `output_tokens` the tokens generated (a stop token counts, as in SGLang).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tributary.engine import FinishReason

from ..chat.tools import OutputSetup
from ..generation import Generated
from .errors import Aborted
from .tools import tool_use_block

__all__ = ["Reply", "content_blocks"]


@dataclasses.dataclass
class Reply(Generated):
    def aborted(self, reason: FinishReason) -> Aborted:
        """`/abort_request`: no stop reason says so, so the message fails (`Aborted`)."""
        return Aborted(reason.get("message") or "The request was aborted.")

    def stop_fields(
        self, stop_sequences: tuple[str, ...], *, called: bool = False
    ) -> dict[str, Any]:
        """`called`: the output held tool calls (then a stop is `tool_use`, SGLang's rule)."""
        reason = self.finish_reason or {}
        if reason.get("type") == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if called:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        matched = reason.get("matched")
        if isinstance(matched, str) and matched in stop_sequences:
            return {"stop_reason": "stop_sequence", "stop_sequence": matched}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def usage(self) -> dict[str, int]:
        return {
            "input_tokens": self.prompt_tokens - self.cached_tokens,
            "cache_read_input_tokens": self.cached_tokens,
            "output_tokens": self.completion_tokens,
        }


def content_blocks(text: str, output: OutputSetup | None) -> tuple[list[dict[str, Any]], bool]:
    """The message's `content` for the whole output, and whether it holds tool calls: a
    thinking block (with an empty `signature`, as llama-server sends: nothing here signs),
    a text block, then one `tool_use` block per call; empty ones are left out."""
    if output is None:
        return ([{"type": "text", "text": text}] if text else []), False
    read = output.split(text)
    blocks: list[dict[str, Any]] = []
    if read.reasoning:
        blocks.append({"type": "thinking", "thinking": read.reasoning, "signature": ""})
    if read.content:
        blocks.append({"type": "text", "text": read.content})
    blocks.extend(tool_use_block(call) for call in read.calls)
    return blocks, bool(read.calls)
