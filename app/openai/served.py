"""`ServedModel`: what `/v1` knows about the one model it serves, and the checks every
generation request passes before anything is submitted.

Synopsis::

    served = ServedModel.for_engine(eng)
    served.check_model(req.model)              # ModelNotFound (404) for another name
    served.check_max_tokens(req.sampling)      # SGLang's "max_completion_tokens is too large"
    items = served.expand(prompts, req)        # prompt-major GenerateRequests, n per prompt
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import jinja2

from tributary.engine import (
    Capabilities,
    EngineService,
    GenerateRequest,
    PassthroughService,
    TokenizerService,
)

from ..chat.template import ChatTemplate
from ..generation import check_fan_out, seeded_sample
from ..http.errors import InvalidRequest
from .errors import ModelNotFound, NoChatTemplate
from .logprobs import TokenSpeller
from .protocol import OpenAIRequest

__all__ = ["ServedModel"]

LOGGER = logging.getLogger("tributary.openai")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedModel:
    engine: EngineService
    #: The engine's vocabulary; a front's answers each call with its 501 (`Capabilities`).
    tokenizer: TokenizerService
    #: A front's: chat completions go to a worker whole (the template and tokenizer are the
    #: workers'). None with a model of its own.
    passthrough: PassthroughService | None
    #: `--served-model-name`; without it the engine's model name, read at each use (a front
    #: serving from workers learns it once a worker answers).
    served_model_name: str | None
    #: Unix time the API started serving it (OpenAI's model card `created`).
    created: int
    template: ChatTemplate | None
    #: How logprob entries spell token ids.
    speller: TokenSpeller
    #: Responses carry a `timings` object (`enable_request_timing`).
    timing_detail: bool = False
    #: `--max-logprobs`: the most alternatives per token (within OpenAI's 20).
    max_logprobs: int = 20

    @classmethod
    def for_engine(
        cls,
        engine: EngineService,
        capabilities: Capabilities | None = None,
        *,
        timing_detail: bool = False,
        max_logprobs: int = 20,
    ) -> ServedModel:
        """Look the model up once (`capabilities`: the engine's, if the app already asked). A
        template that does not compile is logged and treated as absent, so chat answers a
        clear 400 instead of failing on every request."""
        info = engine.model_info
        capabilities = capabilities or Capabilities.of(engine)
        try:
            template = ChatTemplate.for_engine(engine)
        except jinja2.TemplateError as exc:
            LOGGER.error("the chat template of %s does not compile: %s", info.name, exc)
            template = None
        return cls(
            engine=engine,
            tokenizer=capabilities.tokenizer,
            passthrough=capabilities.passthrough,
            served_model_name=engine.config.served_model_name,
            created=int(time.time()),
            template=template,
            speller=TokenSpeller(capabilities.tokenizer),
            timing_detail=timing_detail,
            max_logprobs=max_logprobs,
        )

    @property
    def name(self) -> str:
        return self.served_model_name or self.engine.model_info.name

    @property
    def context_length(self) -> int:
        return self.engine.model_info.context_length

    def card(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "tributary",
            "root": self.name,
            "parent": None,
            "max_model_len": self.context_length,
        }

    def check_model(self, model: str | None) -> None:
        """A request may omit `model` (the served one is meant); any other name is a 404."""
        if model is not None and model != self.name:
            raise ModelNotFound(model)

    def check_max_tokens(self, req: OpenAIRequest) -> None:
        """SGLang's check, before tokenization: a completion budget beyond the whole context
        can never be met. (A budget that does not fit beside the prompt is the engine's
        "Requested token count exceeds ..." 400.)"""
        max_new = req.sampling.max_new_tokens
        if max_new is not None and max_new > self.context_length:
            raise InvalidRequest(
                f"max_completion_tokens is too large: {max_new}. This model supports at most "
                f"{self.context_length} completion tokens.",
                param="max_tokens",
            )

    def chat_template(self) -> ChatTemplate:
        if self.template is None:
            raise NoChatTemplate()
        return self.template

    def expand(
        self, prompts: Sequence[str | list[int]], req: OpenAIRequest
    ) -> list[GenerateRequest]:
        """`req.n` requests per prompt, prompt-major, so choice `i` is prompt `i // n`.

        A client `rid` names the only request as-is, or fans out as `rid_0`, `rid_1`, ...
        (so `/abort_request` with the rid, a prefix match, aborts them all)."""
        count = len(prompts) * req.n
        check_fan_out(count, self.engine.capacity)
        rids: list[str | None]
        if req.rid is None:
            rids = [None] * count
        elif count == 1:
            rids = [req.rid]
        else:
            rids = [f"{req.rid}_{i}" for i in range(count)]
        items = []
        for p, prompt in enumerate(prompts):
            for s in range(req.n):
                items.append(
                    GenerateRequest(
                        text=prompt if isinstance(prompt, str) else None,
                        input_ids=prompt if isinstance(prompt, list) else None,
                        sampling=seeded_sample(req.sampling, s),
                        rid=rids[p * req.n + s],
                        logprobs=req.logprobs,
                        custom_logit_processor=req.custom_logit_processor,
                        stream=req.stream,
                    )
                )
        return items

    def response_head(self, prefix: str, obj: str, req: OpenAIRequest) -> dict[str, Any]:
        """`id`, `object`, `created` (now: when this completion was created) and `model`."""
        return {
            "id": self.response_id(prefix, req),
            "object": obj,
            "created": int(time.time()),
            "model": self.name,
        }

    @staticmethod
    def response_id(prefix: str, req: OpenAIRequest) -> str:
        """The client's `rid` when it gave one (SGLang echoes it as the id), else a fresh one."""
        return req.rid if req.rid is not None else f"{prefix}-{uuid.uuid4().hex}"
