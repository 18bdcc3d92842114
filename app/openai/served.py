"""`ServedModel`: what `/v1` knows about the one model it serves, and the checks every
generation request passes before anything is submitted (the API-neutral ones are
`chat/served.py: ServedChatModel`'s).

Synopsis::

    served = ServedModel.for_engine(eng, settings)
    served.check_model(req.model)              # ModelNotFound (404) for another name
    served.check_max_tokens(req)               # SGLang's "max_completion_tokens is too large"
    items = served.expand(prompts, req)        # prompt-major GenerateRequests, n per prompt
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from tributary.engine import Capabilities, GenerateRequest

from ..chat.served import ServedChatModel
from ..generation import check_fan_out, seeded_sample
from ..settings import ServerSettings
from .errors import ModelNotFound
from .logprobs import TokenSpeller
from .protocol import OpenAIRequest

__all__ = ["ServedModel"]

LOGGER = logging.getLogger("tributary.openai")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedModel(ServedChatModel):
    chat_path = "/v1/chat/completions"
    logger = LOGGER

    #: Unix time the API started serving it (OpenAI's model card `created`).
    created: int
    #: How logprob entries spell token ids.
    speller: TokenSpeller
    #: Responses carry a `timings` object (`enable_request_timing`).
    timing_detail: bool = False
    #: `--max-logprobs`: the most alternatives per token (within OpenAI's 20).
    max_logprobs: int = 20

    @classmethod
    def api_fields(cls, settings: ServerSettings, capabilities: Capabilities) -> dict[str, Any]:
        return {
            "created": int(time.time()),
            "speller": TokenSpeller(capabilities.tokenizer),
            "timing_detail": settings.enable_request_timing,
            "max_logprobs": settings.max_logprobs,
        }

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

    def model_not_found(self, model: str) -> ModelNotFound:
        return ModelNotFound(model)

    def check_max_tokens(self, req: OpenAIRequest) -> None:
        """SGLang's check and words (`check_budget`)."""
        self.check_budget(
            req.sampling.max_new_tokens, field="max_completion_tokens", limit="completion tokens"
        )

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
