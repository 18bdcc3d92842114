"""The start-up check of the model's chat template: a template that cannot render a plain chat
stops the server before it listens, instead of failing every chat request.

Synopsis::

    template = check_chat_template(eng)   # UnusableChatTemplate (a ValueError) if it cannot
    app = create_app(eng, settings)        # serve; None when the model has no template

What is fatal, and what is not:

- a template that does not compile (a jinja syntax error, an unknown filter, test or tag) is
  fatal: no chat request could ever render;
- so is one that fails, or renders nothing, for the plainest chat, one user message with the
  generation prompt: whatever a client sends, it would fail the same way;
- a template that refuses only some chats is not: many refuse by design, with
  `raise_exception` ("System role not supported" in Gemma 2's and Mistral 7B v0.1's,
  "roles must alternate" in Gemma 3's), and those requests get a 400 with the template's words.
  The check tries a system message and a multi-turn chat too and logs a warning for each it
  refuses, so an operator learns at start-up which chats will be 400s.
"""

from __future__ import annotations

import logging

import jinja2

from tributary.engine import EngineService

from .template import ChatTemplate

__all__ = [
    "TRIAL_CHATS",
    "UnusableChatTemplate",
    "check_chat_template",
    "compile_template",
    "read_template_file",
]

LOGGER = logging.getLogger("tributary.chat")

_USER = {"role": "user", "content": "Hello"}

#: What the template is tried on at start-up. The first must render (else the template is
#: unusable); the others may be refused (logged).
TRIAL_CHATS: tuple[tuple[str, list[dict[str, str]]], ...] = (
    ("one user message", [_USER]),
    ("a system message", [{"role": "system", "content": "Be brief."}, _USER]),
    (
        "a multi-turn chat",
        [_USER, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye."}],
    ),
)


class UnusableChatTemplate(ValueError):
    """The chat template cannot serve any chat; the message says why and what to do."""


def compile_template(source: str, *, origin: str) -> ChatTemplate:
    """`source` compiled as `ChatTemplate` compiles it (placeholder BOS/EOS: only for the
    check). Raises UnusableChatTemplate naming `origin`, the jinja error and its line."""
    try:
        return ChatTemplate(source, bos_token="", eos_token="")
    except jinja2.TemplateError as exc:
        raise UnusableChatTemplate(
            f"the chat template of {origin} does not compile: {_described(exc)}"
        ) from None


def read_template_file(path: str | None) -> str | None:
    """The template `--chat-template-file` names, compiled once so that a syntax error stops
    `tributary serve` before the model loads (UnusableChatTemplate; an unreadable file is an
    OSError). None for None."""
    if path is None:
        return None
    with open(path, encoding="utf-8") as file:
        source = file.read()
    compile_template(source, origin=path)
    return source


def check_chat_template(engine: EngineService) -> ChatTemplate | None:
    """The engine's chat template, tried on TRIAL_CHATS (see the module doc); None when the
    model has none, or when the engine has no tokenizer (a front: its workers render)."""
    name = engine.model_info.name
    try:
        template = ChatTemplate.for_engine(engine)
    except jinja2.TemplateError as exc:
        raise UnusableChatTemplate(
            f"the chat template of {name} does not compile: {_described(exc)}{_REMEDY}"
        ) from None
    if template is None:
        return None
    for i, (what, messages) in enumerate(TRIAL_CHATS):
        try:
            failure = None if template.render(messages) else "it renders nothing"
        except Exception as exc:  # whatever it is, the template raised it
            failure = f"{exc}"
        if failure is None:
            continue
        if i == 0:
            raise UnusableChatTemplate(
                f"the chat template of {name} cannot render {what}: {failure}{_REMEDY}"
            )
        LOGGER.warning(
            "the chat template of %s refuses %s (such requests get a 400): %s",
            name,
            what,
            failure,
        )
    return template


_REMEDY = " (serve the model with a working template: --chat-template-file PATH)"


def _described(exc: jinja2.TemplateError) -> str:
    line = getattr(exc, "lineno", None)
    return f"{exc.message} (line {line})" if line else f"{exc.message}"
