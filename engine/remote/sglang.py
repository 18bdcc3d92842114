"""The SGLang upstream kind: `POST {worker}/generate` with `"stream": true`, read as SSE.

Synopsis::

    body = generate_body(request, rid)          # the JSON the worker gets
    reader = GenerateStreamReader(rid)
    for payload in payloads: item = reader.read(json.loads(payload))   # Frame / Done / Error

Tokenization stays on the worker: `text` or `input_ids` and the sampling params are passed
through as the client sent them (after the front's validation). The reader does not need to
know whether the worker streams cumulative text (SGLang's default) or deltas
(`--incremental-streaming-output`): from the second frame on, `output_ids` holding every
token so far (not only the new ones) says cumulative, and the front cuts the delta itself.
An abort frame carries the whole text and only the last id (the contract, 5.4), whatever the
mode; an `{"error": {...}}` frame becomes an `Error` with its `code` as the status.
"""

from __future__ import annotations

from typing import Any

from ..errors import WorkerFailure
from ..request import Done, Error, Frame, GenerateRequest, Output
from ..sampling import TOP_K_ALL, SamplingParams
from .wire import error_message, error_status

__all__ = ["GenerateStreamReader", "generate_body", "sampling_to_wire"]

_DEFAULTS = SamplingParams()


def sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    """`sampling_params` as SGLang takes them: only the fields that differ from SGLang's
    defaults (an older worker that lacks a newer key is then never sent it needlessly)."""
    wire: dict[str, Any] = {}
    for name in params.__dataclass_fields__:
        value = getattr(params, name)
        if name == "n" or value == getattr(_DEFAULTS, name):
            continue
        if name == "top_k" and value == TOP_K_ALL:
            value = -1
        elif isinstance(value, tuple | frozenset):
            value = sorted(value) if isinstance(value, frozenset) else list(value)
        elif name == "logit_bias":
            value = {str(k): v for k, v in value.items()}
        elif name == "custom_params":
            value = dict(value)
        wire[name] = value
    if params.max_new_tokens is None:
        wire["max_new_tokens"] = None  # unbounded, not SGLang's 128
    return wire


def generate_body(request: GenerateRequest, rid: str) -> dict[str, Any]:
    body: dict[str, Any] = {"rid": rid, "stream": True}
    if request.input_ids is not None:
        body["input_ids"] = list(request.input_ids)
    else:
        body["text"] = request.text
    body["sampling_params"] = sampling_to_wire(request.sampling)
    if request.custom_logit_processor:
        # Only when the front forwards them (RemoteConfig.enable_custom_logit_processor).
        body["custom_logit_processor"] = request.custom_logit_processor
    return body


class GenerateStreamReader:
    """One item's SSE frames → `Frame`s, then `Done` or `Error` (deltas, cumulative counts)."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.text = ""  # everything delivered so far
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._cumulative: bool | None = None  # unknown until the second frame

    @property
    def started(self) -> bool:
        return self.completion_tokens > 0 or bool(self.text)

    def read(self, obj: Any) -> Output:
        if not isinstance(obj, dict):
            message = f"The worker sent a frame that is not an object: {obj!r:.200}"
            return Error(self.rid, WorkerFailure(message))
        if "error" in obj:
            status = error_status(obj, 400)  # SGLang's error frames are its ValueErrors
            return Error(self.rid, WorkerFailure(error_message(obj, status), status=status))
        meta = obj.get("meta_info") or {}
        finish = meta.get("finish_reason")
        text = obj.get("text")
        ids = obj.get("output_ids") or []
        prev = self.completion_tokens
        completion = meta.get("completion_tokens")
        if not isinstance(completion, int):
            completion = prev + len(ids)
        is_abort = isinstance(finish, dict) and finish.get("type") == "abort"
        if self._cumulative is None and prev > 0 and not is_abort:
            if len(ids) == completion:  # all ids so far (a delta would lack the first `prev`)
                self._cumulative = True
            elif len(ids) == completion - prev:
                self._cumulative = False
        delta_text = self._delta_text(text if isinstance(text, str) else "", is_abort)
        if is_abort:
            new = completion - prev
            delta_ids = ids[-new:] if 0 < new <= len(ids) else []
        elif self._cumulative:
            delta_ids = ids[prev:]
        else:
            delta_ids = list(ids)
        self.text += delta_text
        self.completion_tokens = completion
        self.prompt_tokens = int(meta.get("prompt_tokens") or self.prompt_tokens)
        self.cached_tokens = int(meta.get("cached_tokens") or self.cached_tokens)
        if finish is None:
            return Frame(
                self.rid, delta_text, delta_ids, self.prompt_tokens, completion, self.cached_tokens
            )
        if not isinstance(finish, dict):
            finish = {"type": str(finish)}
        latency = meta.get("e2e_latency")
        return Done(
            self.rid,
            delta_text,
            delta_ids,
            self.prompt_tokens,
            completion,
            self.cached_tokens,
            finish_reason=finish,
            worker_e2e_latency=float(latency) if isinstance(latency, int | float) else None,
        )

    def _delta_text(self, text: str, is_abort: bool) -> str:
        if (is_abort or self._cumulative) and text.startswith(self.text):
            return text[len(self.text) :]
        if self._cumulative:
            # A cumulative text that rewrote what was already sent (never seen from SGLang):
            # send what lies past it rather than repeat it.
            return text[len(self.text) :]
        return text
