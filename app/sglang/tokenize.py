"""`tokenize_blueprint`: SGLang's `POST /tokenize` and `POST /detokenize` (each also under
`/v1`, one handler for both paths), with the served model's own tokenizer.

Synopsis::

    POST /tokenize   {"prompt": "Hello"}        -> {"tokens": [...], "count": N, "max_model_len": C}
    POST /tokenize   {"prompt": ["a", "b"]}     -> {"tokens": [[...], [...]], "count": [n, m], ...}
    POST /tokenize   {"messages": [...]}        -> the prompt /v1/chat/completions would run
    POST /detokenize {"tokens": [1, 2]}         -> {"text": "..."}
    POST /detokenize {"tokens": [[1], [2, 3]]}  -> {"text": ["...", "..."]}

Errors, on both paths, are SGLang's `ErrorResponse`, `{"object": "error", "message", "type",
"param", "code"}`: SGLang serves these endpoints from its OpenAI layer. `type` follows SGLang
per case: `"BadRequestError"` with its handlers' messages (a prompt or token list of the wrong
type), `"Bad Request"` for what its request validation refuses (a malformed body, neither or
both of prompt and messages, a field of the wrong type), the status as a string otherwise.
Unlike SGLang, a token id outside [0, vocab) is a 400 naming it, not silently dropped or a 500.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any, TypeVar

import jinja2
from quart import Blueprint, Response

from tributary.engine import (
    BadRequest,
    EngineError,
    EngineService,
    TokenizerService,
)
from tributary.engine.offload import detokenize_all, tokenize_all
from tributary.engine.wire import Pending, convert_pending

from ..chat.messages import parse_messages
from ..chat.template import ChatTemplate, render_prompt_ids
from ..http.body import read_json_body
from ..http.errors import install_error_handlers
from ..http.responses import json_response
from .errors import sglang_error_object
from .protocol import DetokenizeBody, TokenizeBody

__all__ = ["tokenize_blueprint"]

LOGGER = logging.getLogger("tributary.app")

_Body = TypeVar("_Body", TokenizeBody, DetokenizeBody)


class InvalidTokenInput(BadRequest):
    """A prompt or token list of the wrong kind: SGLang's handler messages and their type."""

    sglang_type = "BadRequestError"


# Chat-template options SGLang's TokenizeRequest knows and this server cannot honour; each
# maps to "is it in use?". Refused rather than ignored: the ids would not be SGLang's.
# (TokenizeBody declares them, and /openapi.json and docs/api.md list them.)
_UNSUPPORTED_WITH_MESSAGES = {
    "tools": lambda v: v not in (None, []),
    "tool_choice": lambda v: v not in (None, "none", "auto"),
    "reasoning_effort": lambda v: v is not None,
    "continue_final_message": lambda v: v not in (None, False),
    "chat_template_kwargs": lambda v: v not in (None, {}),
}


def tokenize_blueprint(engine: EngineService, tokenizer: TokenizerService) -> Blueprint:
    """`tokenizer`: the engine's (`Capabilities.tokenizer`). A front has none: each use is its
    501 (capabilities.NO_TOKENIZER), where it happens."""
    bp = Blueprint("tributary_tokenize", __name__)
    template = _chat_template(engine)

    @bp.route("/tokenize", methods=["POST"])
    @bp.route("/v1/tokenize", methods=["POST"])
    async def tokenize() -> Response:
        body, pending = _object(await read_json_body(), TokenizeBody)
        prompt, messages = body.prompt, body.messages
        if (prompt is None) == (messages is None):
            raise BadRequest("Exactly one of 'prompt' or 'messages' must be provided.")
        max_model_len = engine.model_info.context_length
        if messages is not None:
            ids = await _chat_prompt_ids(tokenizer, template, body, pending)
            return json_response({"tokens": ids, "count": len(ids), "max_model_len": max_model_len})
        pending.raise_for("add_special_tokens")
        add_special = body.add_special_tokens is not False  # null: true
        if isinstance(prompt, str):
            [ids] = await tokenize_all(tokenizer, [prompt], add_special=add_special)
            return json_response({"tokens": ids, "count": len(ids), "max_model_len": max_model_len})
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            # All of them weighed together, and off the loop in one job when that is more
            # than a millisecond's work: many short prompts add up (offload.tokenize_all).
            lists = await tokenize_all(tokenizer, prompt, add_special=add_special)
            counts = [len(ids) for ids in lists]
            return json_response({"tokens": lists, "count": counts, "max_model_len": max_model_len})
        raise InvalidTokenInput(
            f"Invalid prompt type: {_prompt_kind(prompt)}. Expected str or List[str]."
        )

    @bp.route("/detokenize", methods=["POST"])
    @bp.route("/v1/detokenize", methods=["POST"])
    async def detokenize() -> Response:
        body, pending = _object(await read_json_body(), DetokenizeBody)
        pending.raise_for("skip_special_tokens")
        skip_special = body.skip_special_tokens is not False  # null: true
        tokens = body.tokens
        if tokens is None:
            raise BadRequest("'tokens' is required: a list of token ids, or a list of such lists.")
        if not isinstance(tokens, list):
            raise InvalidTokenInput(
                f"Invalid tokens type: {type(tokens).__name__}. "
                "Expected List[int] or List[List[int]]."
            )
        if tokens and isinstance(tokens[0], list):
            for i, ids in enumerate(tokens):
                if not isinstance(ids, list) or not _all_ints(ids):
                    raise InvalidTokenInput(
                        "Invalid input: Sublist in 'tokens' must contain only integers. "
                        f"Found: {json.dumps(ids)}"
                    )
                _check_ids(engine, ids, f"tokens[{i}]")
            texts = await detokenize_all(tokenizer, tokens, skip_special_tokens=skip_special)
            return json_response({"text": texts})
        if not _all_ints(tokens):
            raise InvalidTokenInput("Invalid input: 'tokens' must be a list of integers.")
        _check_ids(engine, tokens, "tokens")
        [text] = await detokenize_all(tokenizer, [tokens], skip_special_tokens=skip_special)
        return json_response({"text": text})

    install_error_handlers(
        bp,
        _error_response,
        logger=LOGGER,
        render_unexpected=partial(_error_response, err_type="InternalServerError"),
        where="tokenize/detokenize",  # the line log filters know
    )
    return bp


def _error_response(error: EngineError, *, err_type: str | None = None) -> Response:
    status = error.http_status
    if err_type is None:
        err_type = getattr(error, "sglang_type", "Bad Request" if status == 400 else str(status))
    obj = sglang_error_object(
        error.message, status, err_type=err_type, param=getattr(error, "param", None)
    )
    return json_response(obj, status=status)


def _chat_template(engine: EngineService) -> ChatTemplate | None:
    try:
        return ChatTemplate.for_engine(engine)
    except jinja2.TemplateError:
        return None  # logged once by the /v1 blueprint, which compiles the same template


async def _chat_prompt_ids(
    tokenizer: TokenizerService, template: ChatTemplate | None, body: TokenizeBody, pending: Pending
) -> list[int]:
    """The ids /v1/chat/completions would run for these messages: the template's text,
    tokenized with no special tokens added (the template writes them)."""
    for field, in_use in _UNSUPPORTED_WITH_MESSAGES.items():
        if in_use(getattr(body, field)):
            raise BadRequest(f"{field} is not supported by this server yet.")
    messages = parse_messages(body.messages)
    pending.raise_for("add_generation_prompt")
    add_generation_prompt = body.add_generation_prompt is not False  # null: true
    if template is None:
        raise BadRequest(
            "This model has no chat template (its GGUF has no tokenizer.chat_template), so "
            "messages cannot be rendered; send a prompt instead."
        )
    return await render_prompt_ids(
        template, tokenizer, messages, add_generation_prompt=add_generation_prompt
    )


def _check_ids(engine: EngineService, ids: list[int], where: str) -> None:
    vocab = engine.model_info.vocab_size
    for j, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise InvalidTokenInput(
                f"Invalid input: {where}[{j}] is {token}, which is not a token id of this "
                f"model; valid ids are in [0, {vocab})."
            )


def _object(raw: Any, model: type[_Body]) -> tuple[_Body, Pending]:
    """`raw` through its declaration, and the type faults of its fields (`_words`), each
    raised where the handler reads the field; `model`'s first."""
    if not isinstance(raw, dict):
        raise BadRequest("The request body must be a JSON object.")
    body, pending = convert_pending(raw, model, _words)
    pending.raise_for("model")
    return body, pending


def _words(key: str, value: Any) -> BadRequest | None:
    """The 400 for a declared field that did not convert (`prompt`, `messages` and `tokens`
    are declared as any: the handlers word theirs)."""
    kind = "a string" if key == "model" else "a boolean"
    return BadRequest(f"{key} must be {kind}, got {value!r}.")


def _all_ints(values: list[Any]) -> bool:
    # JSON true/false arrive as bool, a subclass of int; they are not token ids.
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _prompt_kind(prompt: Any) -> str:
    """The Python type a client sent, and where a list goes wrong."""
    if isinstance(prompt, list):
        for i, item in enumerate(prompt):
            if not isinstance(item, str):
                return f"list with {type(item).__name__} at prompt[{i}]"
    return type(prompt).__name__
