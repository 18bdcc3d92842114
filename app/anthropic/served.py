"""`ServedChat`: what `/v1/messages` knows about the model it serves, and the checks every
request passes before anything is submitted (the API-neutral ones are
`chat/served.py: ServedChatModel`'s, as for `/v1/chat/completions`).

Synopsis::

    served = ServedChat.for_engine(eng, settings, capabilities)
    served.check_model(req.model)                # ModelNotFound (404) for another name
    ids = await served.prompt_ids(req)           # the chat template's prompt, tokenized
    item = served.generation(ids, req, rid)      # the one GenerateRequest, checked
"""

from __future__ import annotations

import dataclasses
import logging

from tributary.engine import GenerateRequest

from ..chat.served import ServedChatModel
from ..generation import check_fan_out
from .errors import ModelNotFound
from .protocol import MessagesRequest, PromptRequest

__all__ = ["ServedChat"]

LOGGER = logging.getLogger("tributary.anthropic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedChat(ServedChatModel):
    chat_path = "/v1/messages"
    logger = LOGGER

    def model_not_found(self, model: str) -> ModelNotFound:
        return ModelNotFound(model, self.name)

    async def prompt_ids(self, req: PromptRequest) -> list[int]:
        """The chat rendered by the model's template (`render_chat`, with the request's tools
        and thinking switch), then a prefill's tokens: the answer continues it."""
        ids = await self.render_chat(req.chat, tools=req.tools, extra=req.extra)
        if req.prefill:
            ids = ids + self.tokenizer.tokenize(req.prefill, add_special=False)
        return ids

    def generation(self, prompt_ids: list[int], req: MessagesRequest, rid: str) -> GenerateRequest:
        """The one engine request, after SGLang's check that the budget can ever be met."""
        self.check_budget(req.sampling.max_new_tokens, field="max_tokens", limit="tokens")
        check_fan_out(1, self.engine.capacity)
        return GenerateRequest(
            input_ids=prompt_ids, sampling=req.sampling, rid=rid, stream=req.stream
        )
