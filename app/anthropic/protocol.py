"""Parsing `/v1/messages` bodies into checked requests: Anthropic's messages as the chat template
sees them, its tools as `app/chat/tools.py`'s, and its sampling fields as the engine's.

Synopsis::

    req = parse_messages_body(body, vocab_size=eng.model_info.vocab_size)
    req.chat        # template messages: {"role", "content", "tool_calls"?, "tool_call_id"?}
    req.prefill     # the text of a last assistant message, which the answer continues
    req.tools       # ToolCalling, or None
    req.sampling    # engine.SamplingParams (a forced call's json_schema included)
    req.output      # OutputSetup reading calls and thinking from the output, or None

Mapping (as llama-server's `convert_anthropic_to_oai`): `system` becomes a first system
message; `max_tokens` -> `max_new_tokens` (required, as in Anthropic's API); `stop_sequences`
-> `stop`; `temperature`, `top_p`, `top_k` keep their names and the engine's validation;
`tools` and `tool_choice` as tools.py says; `thinking` sets the template's `enable_thinking`
(and `thinking`) and, with a `--reasoning-parser`, whether the output is read for thinking.
`metadata` is accepted and ignored.

A message is `user` or `assistant`; its content a string or blocks. Consecutive messages of
one role are one turn, their blocks in order (Anthropic merges them; templates that require
alternating roles would refuse them). Text blocks are joined with newlines. An assistant's
`tool_use` blocks are its `tool_calls` and its `thinking` blocks its `reasoning_content`
(templates that render earlier reasoning read it); a user's `tool_result` blocks are `tool`
messages, before the user's text (templates expect a call's results right after it). Image
and document blocks are a 400 that says the model reads text only. A last assistant message
without calls is a prefill: the answer continues it (Anthropic's rule), so it is not
templated as a finished turn but appended to the prompt. Claude Code's system prompt starts
with an `x-anthropic-billing-header` line whose `cch=` stamp changes on every request; it is
written as `cch=fffff;` (as llama-server does), so the prompt prefix cache still reaches past
it.

Every failure raises `InvalidRequest` naming the field; nothing is submitted.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import msgspec

from tributary.engine import SamplingParams
from tributary.engine.wire import convert

from ..chat.messages import message_list, template_tool_call
from ..chat.tools import OutputSetup, ReasoningSetup, ToolCalling
from ..http.errors import InvalidRequest
from .models import (
    ROLES,
    AnthropicMessage,
    Block,
    CountTokensBody,
    MessagesBody,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from .tools import object_type, parse_tools

__all__ = ["MessagesRequest", "PromptRequest", "parse_count_tokens_body", "parse_messages_body"]

_KINDS = {
    "model": "a string",
    "system": "a string or a list of text blocks",
    "max_tokens": "an integer of at least 0",
    "stop_sequences": "a list of strings",
    "temperature": "a number",
    "top_p": "a number",
    "top_k": "an integer",
    "stream": "a boolean",
    "metadata": "an object",
}
_THINKING = ("enabled", "disabled", "adaptive")
#: Claude Code's billing line's per-request stamp (llama-server's
#: `normalize_anthropic_billing_header`), at the start of the system prompt or a block of it.
_BILLING_STAMP = re.compile(r"(?m)^(x-anthropic-billing-header:[^\n]*?\bcch=)[0-9A-Za-z]+;")
#: Content block types that carry what a text model cannot read.
_MEDIA = ("image", "document", "search_result")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptRequest:
    """What the prompt is made of (all `/v1/messages/count_tokens` reads)."""

    #: None when the client left `model` out (the served model is meant).
    model: str | None
    #: The messages as the chat template sees them, without a prefill.
    chat: list[dict[str, Any]]
    #: A last assistant message's text: the answer continues it ("" when there is none).
    prefill: str
    #: The request's tools (None: none, or `tool_choice` none).
    tools: ToolCalling | None = None
    #: Variables for the template beside `messages` (`enable_thinking` from `thinking`).
    extra: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MessagesRequest(PromptRequest):
    sampling: SamplingParams
    stream: bool
    #: `stop_sequences`, to tell a matched one from a stop token.
    stop_sequences: tuple[str, ...]
    #: How the output is read for calls and thinking (None: it is all text).
    output: OutputSetup | None = None


def parse_count_tokens_body(raw: Any, *, tool_call_parser: str | None = None) -> PromptRequest:
    body = convert(_object(raw), CountTokensBody, fault=_fault)
    prompt, _ = _prompt(body, tool_call_parser)
    return PromptRequest(**prompt)


def parse_messages_body(
    raw: Any,
    *,
    vocab_size: int,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> MessagesRequest:
    """`tool_call_parser`, `reasoning_parser`: the server's (`--tool-call-parser`,
    `--reasoning-parser`)."""
    body = convert(_object(raw), MessagesBody, fault=_fault)
    if body.max_tokens is None:
        raise InvalidRequest("max_tokens is required.", param="max_tokens")
    prompt, thinking = _prompt(body, tool_call_parser)
    calling: ToolCalling | None = prompt["tools"]
    stops = body.stop_sequences or []
    sampling = SamplingParams.from_dict(
        {
            "max_new_tokens": body.max_tokens,
            **({"stop": stops} if stops else {}),
            **{
                key: getattr(body, key)
                for key in ("temperature", "top_p", "top_k")
                if getattr(body, key) is not None
            },
            # Forced calls follow the tools' schemas; call markers may be special tokens.
            **({"json_schema": calling.constraint()} if calling and calling.forced else {}),
            **({"skip_special_tokens": False} if calling else {}),
        }
    )
    sampling.verify(vocab_size)
    reasoning = ReasoningSetup(reasoning_parser, thinking=thinking) if reasoning_parser else None
    output = OutputSetup(calling, reasoning)
    return MessagesRequest(
        **prompt,
        sampling=sampling,
        stream=bool(body.stream),
        stop_sequences=tuple(stops),
        output=output if output.active else None,
    )


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


def _fault(key: str, value: Any) -> Any:
    """The 400 for a body field that is not of its declared type."""
    if key == "system" and isinstance(value, list):
        for i, block in enumerate(value):
            _text_block(f"system[{i}]", block)
    raise InvalidRequest(f"{key} must be {_KINDS[key]}, got {value!r}.", param=key)


def _prompt(body: CountTokensBody, tool_call_parser: str | None) -> tuple[dict[str, Any], bool]:
    """The prompt's fields, and whether the request lets the model think."""
    calling = parse_tools(body.tools, body.tool_choice, parser=tool_call_parser)
    extra = _thinking(body.thinking)
    chat = _chat(body.messages)
    prefill = ""
    if chat[-1]["role"] == "assistant" and "tool_calls" not in chat[-1]:
        prefill = chat.pop()["content"]
    if body.system is not None:
        system = body.system
        text = system if isinstance(system, str) else "\n".join(b.text for b in system)
        chat.insert(0, {"role": "system", "content": _BILLING_STAMP.sub(r"\g<1>fffff;", text)})
    prompt = {"model": body.model, "chat": chat, "prefill": prefill, "tools": calling}
    return {**prompt, "extra": extra}, extra is None or extra["enable_thinking"]


def _thinking(thinking: Any) -> dict[str, Any] | None:
    """The template's thinking switches (as SGLang's `chat_template_kwargs` set them) for
    Anthropic's `thinking`; None when the request leaves it to the template."""
    if thinking is None:
        return None
    kind = object_type("thinking", thinking, _THINKING)
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool)):
        raise InvalidRequest(
            f"thinking.budget_tokens must be an integer, got {budget!r}.",
            param="thinking.budget_tokens",
        )
    on = kind != "disabled"
    return {"enable_thinking": on, "thinking": on}


_MESSAGES = list[AnthropicMessage]


def _chat(raw: Any) -> list[dict[str, Any]]:
    """Anthropic's messages as template messages, checked: the first fault is reported."""
    message_list(raw, within="request")
    try:
        messages: list[AnthropicMessage] = msgspec.convert(raw, _MESSAGES)
    except msgspec.ValidationError:
        messages = [_message(f"messages[{i}]", m) for i, m in enumerate(raw)]
    for i, message in enumerate(messages):
        _check_role(f"messages[{i}]", message.role)
        if not isinstance(message.content, str):
            _check_blocks(f"messages[{i}]", message.role, message.content)
    chat: list[dict[str, Any]] = []
    for message in _turns(messages):
        content = message.content
        if isinstance(content, str):
            chat.append({"role": message.role, "content": content})
        else:
            chat.extend(_turn(message.role, content))
    return chat


def _turns(messages: list[AnthropicMessage]) -> list[AnthropicMessage]:
    """Consecutive messages of one role merged into one, their blocks in order."""
    turns: list[AnthropicMessage] = []
    for message in messages:
        if turns and turns[-1].role == message.role:
            blocks = [*_blocks(turns[-1].content), *_blocks(message.content)]
            turns[-1] = AnthropicMessage(role=message.role, content=blocks)
        else:
            turns.append(message)
    return turns


def _blocks(content: str | list[Block]) -> list[Block]:
    return [TextBlock(text=content)] if isinstance(content, str) else content


def _check_blocks(where: str, role: str, blocks: list[Block]) -> None:
    misplaced = ToolResultBlock if role == "assistant" else (ToolUseBlock, ThinkingBlock)
    for j, block in enumerate(blocks):
        if isinstance(block, misplaced):
            kind = block.__struct_config__.tag
            raise InvalidRequest(
                f"{where}.content[{j}]: a {kind} block cannot be in "
                f"{'an assistant' if role == 'assistant' else 'a user'} message.",
                param=f"{where}.content",
            )


def _turn(role: str, blocks: list[Block]) -> list[dict[str, Any]]:
    """One turn's blocks as template messages (as the tools machinery reads them): a user
    turn's tool results are `tool` messages, before its text; an assistant turn's calls are
    its `tool_calls`, its thinking its `reasoning_content`."""
    text = "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
    if role == "assistant":
        entry: dict[str, Any] = {"role": role, "content": text}
        calls = [
            template_tool_call(b.id, b.name, b.input) for b in blocks if isinstance(b, ToolUseBlock)
        ]
        if calls:
            entry["tool_calls"] = calls
        thoughts = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
        if thoughts:
            entry["reasoning_content"] = "\n".join(thoughts)
        return [entry]
    results = [b for b in blocks if isinstance(b, ToolResultBlock)]
    turn = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)} for b in results
    ]
    if not results or any(isinstance(b, TextBlock) for b in blocks):
        turn.append({"role": role, "content": text})
    return turn


def _result_text(block: ToolResultBlock) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.text for part in content)


def _check_role(where: str, role: Any) -> None:
    if role == "system":
        raise InvalidRequest(
            f'{where}.role: unexpected role "system". The Messages API takes a top-level '
            '`system` field, not "system" as a message role.',
            param=f"{where}.role",
        )
    if role not in ROLES:
        raise InvalidRequest(
            f"{where}.role must be one of {', '.join(map(repr, ROLES))}, got {role!r}.",
            param=f"{where}.role",
        )


def _message(where: str, raw: Any) -> AnthropicMessage:
    """One message that did not convert with the others: its first fault, worded."""
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be an object.", param=where)
    _check_role(where, raw.get("role"))
    content = raw.get("content")
    if isinstance(content, list):
        blocks = [_block(f"{where}.content[{j}]", b) for j, b in enumerate(content)]
        return AnthropicMessage(role=raw["role"], content=blocks)
    if not isinstance(content, str):
        raise InvalidRequest(
            f"{where}.content must be a string or a list of content blocks, got {content!r}.",
            param=f"{where}.content",
        )
    return AnthropicMessage(role=raw["role"], content=content)


def _block(where: str, raw: Any) -> Any:
    kind = raw.get("type") if isinstance(raw, dict) else None
    _text_only(where, kind)
    if kind == "tool_result" and isinstance(raw.get("content"), list):  # a screenshot, say
        for k, part in enumerate(raw["content"]):
            _text_only(
                f"{where}.content[{k}]", part.get("type") if isinstance(part, dict) else None
            )
    if kind == "text":
        return _text_block(where, raw)
    if kind in ("tool_use", "tool_result", "thinking", "redacted_thinking"):
        try:
            return msgspec.convert(raw, Block)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(
                f"{where} is not a valid {kind} block: {exc}.", param=where.rpartition("[")[0]
            ) from None
    raise InvalidRequest(
        f"{where}: content block type {kind!r} is not supported by this server (text, "
        "tool_use, tool_result and thinking are).",
        param=where.rpartition("[")[0],
    )


def _text_only(where: str, kind: Any) -> None:
    if kind in _MEDIA:
        raise InvalidRequest(
            f"{where}: {kind} content blocks are not supported: this server's model reads "
            "text only.",
            param=where.rpartition("[")[0],
        )


def _text_block(where: str, raw: Any) -> TextBlock:
    try:
        return msgspec.convert(raw, TextBlock)
    except msgspec.ValidationError:
        raise InvalidRequest(
            f'{where} must be a text block {{"type": "text", "text": ...}}, got {raw!r}.',
            param=where.rpartition("[")[0],
        ) from None
