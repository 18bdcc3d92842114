"""The OpenAI upstream kind: `POST {worker}/v1/completions` with `"stream": true`, for vLLM,
llama.cpp's server or another Tributary.

Synopsis::

    refused = unsupported_fields(request)        # [] or the names a 400 lists
    body = completions_body(request, rid, model)
    reader = CompletionStreamReader(rid, request)
    for payload in payloads: item = reader.read(json.loads(payload))   # Frame / Done / None

Fields both sides have are mapped (SGLang's name → OpenAI's: `max_new_tokens` → `max_tokens`,
`min_new_tokens` → `min_tokens`, `sampling_seed` → `seed`; `top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens` are vLLM's
extensions, which llama.cpp's server and Tributary take too). The rest has no OpenAI
equivalent and is refused with a 400 naming it, never dropped. The OpenAI stream carries
no token ids: frames count one token a chunk until the usage chunk gives the real counts,
and `output_ids` stay empty.
"""

from __future__ import annotations

from typing import Any

from ..errors import WorkerFailure
from ..request import Done, Error, FinishReason, Frame, GenerateRequest, Output, length_reason
from ..sampling import TOP_K_ALL, SamplingParams
from .wire import error_message, error_status

__all__ = ["CompletionStreamReader", "completions_body", "unsupported_fields"]

_DEFAULTS = SamplingParams()

#: SGLang sampling field -> OpenAI (or vLLM extension) field.
_MAPPED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "logit_bias": "logit_bias",
    "sampling_seed": "seed",
    "n": "n",
}


def unsupported_fields(request: GenerateRequest) -> list[str]:
    """The fields `request` sets that an OpenAI completions worker cannot honour."""
    params = request.sampling
    names = [
        name
        for name in params.__dataclass_fields__
        if name not in _MAPPED and getattr(params, name) != getattr(_DEFAULTS, name)
    ]
    if request.logprobs is not None:
        names.append("return_logprob")
    if request.custom_logit_processor:
        names.append("custom_logit_processor")
    return names


def completions_body(request: GenerateRequest, rid: str, model: str) -> dict[str, Any]:
    params = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.input_ids) if request.input_ids is not None else request.text,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": params.max_new_tokens,
    }
    for name, wire in _MAPPED.items():
        value = getattr(params, name)
        if name in ("max_new_tokens", "n") or value == getattr(_DEFAULTS, name):
            continue
        if name == "top_k" and value == TOP_K_ALL:
            continue
        if isinstance(value, frozenset):
            value = sorted(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif name == "logit_bias":
            value = {str(k): v for k, v in value.items()}
        body[wire] = value
    if params.top_k == 1 and params.temperature == 1.0:
        body["temperature"] = 0.0  # SGLang's greedy spelling; OpenAI servers' is temperature 0
    body["user"] = rid  # OpenAI has no request id field; vLLM logs `user`
    return body


class CompletionStreamReader:
    """One item's completion chunks → `Frame`s, then one `Done` once usage (or [DONE]) has
    come; `read` returns None for chunks that carry nothing yet."""

    def __init__(self, rid: str, request: GenerateRequest) -> None:
        self.rid = rid
        self.request = request
        self.completion_tokens = 0
        self.prompt_tokens = len(request.input_ids) if request.input_ids is not None else 0
        self._finish: FinishReason | None = None
        self._ended = False

    @property
    def started(self) -> bool:
        return self.completion_tokens > 0

    def read(self, obj: Any) -> Output | None:
        if not isinstance(obj, dict):
            return Error(
                self.rid,
                WorkerFailure(f"The worker sent a chunk that is not an object: {obj!r:.200}"),
            )
        if "error" in obj or obj.get("object") == "error":
            status = error_status(obj, 500)
            return Error(self.rid, WorkerFailure(error_message(obj, status), status=status))
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = int(usage.get("prompt_tokens") or self.prompt_tokens)
            self.completion_tokens = int(usage.get("completion_tokens") or self.completion_tokens)
        text = ""
        for choice in obj.get("choices") or []:
            text += choice.get("text") or ""
            if choice.get("finish_reason") is not None:
                self._finish = self._finish_reason(choice)
        if text and not isinstance(usage, dict):
            self.completion_tokens += 1
        if isinstance(usage, dict) and self._finish is not None:
            return self.done(text)
        if text:
            return Frame(self.rid, text, [], self.prompt_tokens, self.completion_tokens, 0)
        return None

    def done(self, text: str = "") -> Done | None:
        """The terminal item (at the usage chunk, or at [DONE] if the worker sent none);
        None once given, or if the worker never said why it finished."""
        if self._ended or self._finish is None:
            return None
        self._ended = True
        return Done(
            self.rid,
            text,
            [],
            self.prompt_tokens,
            self.completion_tokens,
            0,
            finish_reason=self._finish,
        )

    def _finish_reason(self, choice: dict[str, Any]) -> FinishReason:
        reason = choice.get("finish_reason")
        if reason == "length":
            return length_reason(self.request.sampling.max_new_tokens or self.completion_tokens)
        if reason == "stop":
            # vLLM names what matched `stop_reason`; SGLang and Tributary, `matched_stop`.
            matched = choice.get("stop_reason")
            if matched is None:
                matched = choice.get("matched_stop")
            return {"type": "stop", "matched": matched}
        if reason == "abort":
            return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        return {"type": str(reason)}
