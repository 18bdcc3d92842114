"""SGLang's custom logit processors: the wire format, the base class, and the built-ins.

Synopsis::

    class OnlyToken(CustomLogitProcessor):            # in the client
        def __call__(self, logits, custom_param_list):
            for i, params in enumerate(custom_param_list):
                logits[i, :] = -float("inf")
                logits[i, params["token_id"]] = 0.0
            return logits

    body = {"text": "...", "custom_logit_processor": OnlyToken.to_str(),
            "sampling_params": {"custom_params": {"token_id": 5}}}

The wire format is SGLang's: `{"callable": "<hex of dill.dumps(cls)>"}`, a pickled *class*
that the server instantiates. A processor is called with a `[rows, vocab]` array of logits
(a `torch.Tensor` sharing memory with the row when torch is installed, else a numpy array)
and one `custom_params` dict per row, and returns logits of the same shape.

Clients written for SGLang pickle classes whose base (or whole class, for SGLang's built-in
processors) lives in `sglang.srt.sampling.custom_logit_processor`; unpickling maps that module
to this one, which defines the same names, so those payloads load unchanged without SGLang.

Running a processor runs code the client sent: the engine refuses them unless it was started
with `enable_custom_logit_processor` (`--enable-custom-logit-processor`).
"""

from __future__ import annotations

import functools
import io
import json
from abc import ABC, abstractmethod
from typing import Any

import dill

from .errors import BadRequest

__all__ = [
    "CustomLogitProcessor",
    "DeepSeekR1ThinkingBudgetLogitProcessor",
    "DisallowedTokensLogitsProcessor",
    "Glm4MoeThinkingBudgetLogitProcessor",
    "Qwen3ThinkingBudgetLogitProcessor",
    "ThinkingBudgetLogitProcessor",
    "load_processor",
]

#: Where SGLang keeps these names; payloads that reference it load from this module instead.
SGLANG_MODULE = "sglang.srt.sampling.custom_logit_processor"


class CustomLogitProcessor(ABC):
    """Subclass and implement `__call__`; send `YourClass.to_str()` as the request's
    `custom_logit_processor`."""

    @abstractmethod
    def __call__(self, logits: Any, custom_param_list: list[dict[str, Any] | None]) -> Any:
        """Return logits of the same shape as `logits` (it may be modified in place)."""

    @classmethod
    def to_str(cls) -> str:
        return json.dumps({"callable": dill.dumps(cls).hex()})

    @classmethod
    def from_str(cls, json_str: str) -> CustomLogitProcessor:
        return load_processor(json_str)


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """`custom_params["token_ids"]` may never be sampled."""

    def __call__(self, logits: Any, custom_param_list: list[dict[str, Any] | None]) -> Any:
        for i, params in enumerate(custom_param_list):
            if params:
                logits[i, list(params["token_ids"])] = -float("inf")
        return logits


class ThinkingBudgetLogitProcessor(CustomLogitProcessor):
    """Ends a thinking block once it is `custom_params["thinking_budget"]` tokens long: a
    newline first, then the end-of-thinking token."""

    THINKING_START_TOKEN_ID: int
    THINKING_END_TOKEN_ID: int
    NEW_LINE_TOKEN_ID: int

    def __call__(self, logits: Any, custom_param_list: list[dict[str, Any] | None]) -> Any:
        for i, params in enumerate(custom_param_list):
            budget = params.get("thinking_budget") if params else None
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                continue
            assert params is not None
            req = params["__req__"]
            ids = [*req.origin_input_ids, *req.output_ids]
            start = _open_thinking_start(
                ids, self.THINKING_START_TOKEN_ID, self.THINKING_END_TOKEN_ID
            )
            if start < 0 or len(ids) - start - 1 < budget:
                continue
            if not req.output_ids or req.output_ids[-1] != self.NEW_LINE_TOKEN_ID:
                forced = self.NEW_LINE_TOKEN_ID
            else:
                forced = self.THINKING_END_TOKEN_ID
            logits[i, :] = -float("inf")
            logits[i, forced] = 0.0
        return logits


class Glm4MoeThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID = 151350
    THINKING_END_TOKEN_ID = 151351
    NEW_LINE_TOKEN_ID = 198


class Qwen3ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID = 151667
    THINKING_END_TOKEN_ID = 151668
    NEW_LINE_TOKEN_ID = 198


class DeepSeekR1ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID = 128798
    THINKING_END_TOKEN_ID = 128799
    NEW_LINE_TOKEN_ID = 201


def _open_thinking_start(ids: list[int], start_id: int, end_id: int) -> int:
    """Index of the start token of the thinking block still open at the end, or -1."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == start_id:
            return i
        if ids[i] == end_id:
            return -1
    return -1


class _Unpickler(dill.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == SGLANG_MODULE:
            module = __name__
        return super().find_class(module, name)


@functools.lru_cache(maxsize=256)
def _load_class(serialized: str) -> type:
    """The processor class a payload carries; cached, as SGLang does, since clients send the
    same processor with every request."""
    try:
        data = json.loads(serialized)
        payload = bytes.fromhex(data["callable"])
    except (ValueError, TypeError, KeyError) as exc:
        raise BadRequest(
            'custom_logit_processor must be SGLang\'s serialized form, {"callable": "<hex>"} '
            f"(CustomLogitProcessor.to_str()): {exc}"
        ) from None
    try:
        cls = _Unpickler(io.BytesIO(payload)).load()
    except Exception as exc:
        raise BadRequest(f"custom_logit_processor could not be loaded: {exc!r}") from None
    if not (isinstance(cls, type) and callable(cls)):
        raise BadRequest(
            f"custom_logit_processor must be a pickled processor class, got {type(cls).__name__}"
        )
    return cls


def load_processor(serialized: str) -> CustomLogitProcessor:
    """A fresh processor instance from its wire form. Raises BadRequest with the reason when
    the payload is malformed or cannot be unpickled here (for example, it needs a module this
    server does not have)."""
    cls = _load_class(serialized)
    try:
        return cls()
    except Exception as exc:
        raise BadRequest(f"custom_logit_processor could not be instantiated: {exc!r}") from None
