"""`ServedChatModel`: what every API knows about the one model it serves, and the checks its
requests pass before anything is submitted, apart from any API's wire shape.
`openai/served.py: ServedModel` and `anthropic/served.py: ServedChat` are its subclasses; each
says how its API names a missing model (`model_not_found`) and where its chat is posted
(`chat_path`, named in the messages below).

Synopsis::

    served = ServedModel.for_engine(eng, settings, capabilities)   # a subclass
    served.check_model(req.model)                  # the API's 404 for another name
    served.check_budget(max_new, field="max_tokens", limit="tokens")   # SGLang's check
    ids = await served.render_chat(messages, tools=calling, extra=kwargs)

Errors (beyond the subclass's own)::

    engine.EngineError
    ├── engine.NotSupported                501  a front has no chat template of its own
    └── http.errors.InvalidRequest         400
        └── NoChatTemplate                 400  the model has no chat template
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Self

import jinja2

from tributary.engine import (
    Capabilities,
    EngineError,
    EngineService,
    NotSupported,
    PassthroughService,
    TokenizerService,
)

from ..http.errors import InvalidRequest
from ..settings import ServerSettings
from .template import ChatTemplate, render_prompt_ids
from .tools import ToolCalling

__all__ = ["NoChatTemplate", "ServedChatModel"]


class NoChatTemplate(InvalidRequest):
    def __init__(self, path: str) -> None:
        super().__init__(
            "This model has no chat template (its GGUF has no tokenizer.chat_template), so "
            f"{path} cannot build a prompt from messages. Use /v1/completions with a prompt "
            "you format yourself.",
            param="messages",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedChatModel(ABC):
    #: The API's chat endpoint, as its errors name it.
    chat_path: ClassVar[str]
    #: Where the API logs (a chat template that does not compile).
    logger: ClassVar[logging.Logger]

    engine: EngineService
    #: The engine's vocabulary; a front's answers each call with its 501 (`Capabilities`).
    tokenizer: TokenizerService
    #: A front's: its workers hold the template and tokenizer. None with a model of its own.
    passthrough: PassthroughService | None
    #: `--served-model-name`; without it the engine's model name, read at each use (a front
    #: serving from workers learns it once a worker answers).
    served_model_name: str | None
    template: ChatTemplate | None
    #: `--tool-call-parser` and `--reasoning-parser` (app/chat/tools.py reads output with them).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    @classmethod
    def for_engine(
        cls,
        engine: EngineService,
        settings: ServerSettings,
        capabilities: Capabilities | None = None,
    ) -> Self:
        """Look the model up once (`capabilities`: the engine's, if the app already asked).
        A template that does not compile is logged and treated as absent, so every chat gets
        a clear 400 instead of a failure."""
        capabilities = capabilities or Capabilities.of(engine)
        try:
            template = ChatTemplate.for_engine(engine)
        except jinja2.TemplateError as exc:
            cls.logger.error(
                "the chat template of %s does not compile: %s", engine.model_info.name, exc
            )
            template = None
        return cls(
            engine=engine,
            tokenizer=capabilities.tokenizer,
            passthrough=capabilities.passthrough,
            served_model_name=engine.config.served_model_name,
            template=template,
            tool_call_parser=settings.tool_call_parser,
            reasoning_parser=settings.reasoning_parser,
            **cls.api_fields(settings, capabilities),
        )

    @classmethod
    def api_fields(cls, settings: ServerSettings, capabilities: Capabilities) -> dict[str, Any]:
        """The subclass's own fields, for `for_engine` (none here)."""
        return {}

    @property
    def name(self) -> str:
        return self.served_model_name or self.engine.model_info.name

    @property
    def context_length(self) -> int:
        return self.engine.model_info.context_length

    @abstractmethod
    def model_not_found(self, model: str) -> EngineError:
        """The API's 404 for a `model` this server does not serve."""

    def check_model(self, model: str | None) -> None:
        """A request may omit `model` (the served one is meant); any other name is a 404."""
        if model is not None and model != self.name:
            raise self.model_not_found(model)

    def check_budget(self, max_new: int | None, *, field: str, limit: str) -> None:
        """SGLang's check, before tokenization: a completion budget beyond the whole context
        can never be met (`field` and `limit` word it as the API does). A budget that does
        not fit beside the prompt is the engine's "Requested token count exceeds ..." 400."""
        if max_new is not None and max_new > self.context_length:
            raise InvalidRequest(
                f"{field} is too large: {max_new}. This model supports at most "
                f"{self.context_length} {limit}.",
                param="max_tokens",
            )

    def chat_template(self) -> ChatTemplate:
        if self.passthrough is not None:
            raise NotSupported(
                "This server fronts a fleet of workers and has no chat template of its own: "
                f"send {self.chat_path} to a server that holds the model."
            )
        if self.template is None:
            raise NoChatTemplate(self.chat_path)
        return self.template

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: ToolCalling | None,
        extra: dict[str, Any] | None,
    ) -> list[int]:
        """The prompt tokens for `messages`: the model's template rendered (add_generation_prompt
        on, with the tools' `tools=` and the template kwargs `extra`) and tokenized without
        special tokens added (the template writes them), off the event loop unless the chat is
        short (`render_prompt_ids`)."""
        return await render_prompt_ids(
            self.chat_template(),
            self.tokenizer,
            messages,
            tools=tools.template_tools() if tools is not None else None,
            extra=extra,
        )
