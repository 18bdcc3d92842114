"""SGLang's response objects: `{text, output_ids, meta_info[, index]}`, built from engine items.

Key order is part of the contract (clients and parity fixtures compare bytes), so objects are
built as ordered dicts and encoded with `encode_json` (app/http/responses.py), never through
a key-sorting encoder.

`meta_info` keys, in order::

    id, finish_reason, prompt_tokens, weight_version, num_retractions, reasoning_tokens,
    completion_tokens, cached_tokens[, logprob families][, e2e_latency][, timing detail]

`finish_reason` is null on non-terminal stream frames, and `e2e_latency` appears only on a
terminal output; so does the timing detail (`RequestTiming.detail`), and only with
`enable_request_timing`.

Logprob families (with `return_logprob`), SGLang's: `input_token_logprobs`,
`output_token_logprobs`, `output_token_logprobs_length`, then `input_top_logprobs` and
`output_top_logprobs` (with `top_logprobs_num`), then `input_token_ids_logprobs` and
`output_token_ids_logprobs` (with `token_ids_logprob`). Each entry is `[logprob, token_id,
text]`, text null unless `return_text_in_logprobs`; a position with nothing scored is null;
a logprob of -inf (a token a grammar or processor forbade) is null, as SGLang's orjson
writes it.

A unary answer and a stream's terminal frame carry every position. Other stream frames
carry no position twice, so a stream's logprobs cost O(positions) bytes, not O(positions^2)
(SGLang's cumulative stream resends every position in every frame): the output families
hold the positions no earlier frame carried, and the input families come in the first frame
only (empty lists after it) and again in the terminal frame. `output_token_logprobs_length`
is always the count so far.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tributary.engine import Done, FinishReason, Frame, Logprobs, TokenLogprob, TopLogprobs

__all__ = [
    "LogprobFormat",
    "OutputAccumulator",
    "output_object",
]


def output_object(
    *,
    rid: str,
    text: str,
    output_ids: list[int],
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    finish_reason: FinishReason | None,
    weight_version: str,
    e2e_latency: float | None = None,
    index: int | None = None,
    logprobs: dict[str, Any] | None = None,
    timing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "weight_version": weight_version,
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
    }
    if logprobs is not None:
        meta.update(logprobs)
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    if timing is not None:
        meta.update(timing)
    obj: dict[str, Any] = {"text": text, "output_ids": output_ids, "meta_info": meta}
    if index is not None:
        obj["index"] = index
    return obj


class LogprobFormat:
    """How one request's logprobs are written: which families, and with or without text.

    `token_text` renders one token (special tokens spelled out, as SGLang's per-token
    decode does) when `return_text_in_logprobs` is set; otherwise the text slot is null.
    """

    def __init__(
        self, *, top: bool, ids: bool, token_text: Callable[[int], str] | None = None
    ) -> None:
        self.top = top
        self.ids = ids
        self._token_text = token_text

    def tokens(self, entries: list[TokenLogprob]) -> list[list[Any]]:
        return [[_finite(lp), token, self._text(token)] for lp, token in entries]

    def positions(self, positions: list[TopLogprobs]) -> list[list[list[Any]] | None]:
        return [
            None if entries is None else [[_finite(lp), t, self._text(t)] for lp, t in entries]
            for entries in positions
        ]

    def _text(self, token: int) -> str | None:
        return None if self._token_text is None else self._token_text(token)


def _finite(logprob: float | None) -> float | None:
    return logprob if logprob is not None and math.isfinite(logprob) else None


class _LogprobLists:
    """One request's logprob families, rendered: input families once, output families as
    they grow."""

    def __init__(self, fmt: LogprobFormat) -> None:
        self.fmt = fmt
        self.input_token: list[list[Any]] = []
        self.input_top: list[Any] = []
        self.input_ids: list[Any] = []
        self.output_token: list[list[Any]] = []
        self.output_top: list[Any] = []
        self.output_ids: list[Any] = []

    def add(self, lp: Logprobs) -> dict[str, list[Any]]:
        """Fold in one item's logprobs; return that item's own output lists (the
        incremental shape)."""
        fmt = self.fmt
        if lp.input_token is not None:
            self.input_token = fmt.tokens(lp.input_token)
            self.input_top = fmt.positions(lp.input_top or [])
            self.input_ids = fmt.positions(lp.input_ids or [])
        delta: dict[str, list[Any]] = {
            "token": fmt.tokens(lp.output_token),
            "top": fmt.positions(lp.output_top or []),
            "ids": fmt.positions(lp.output_ids or []),
        }
        self.output_token += delta["token"]
        self.output_top += delta["top"]
        self.output_ids += delta["ids"]
        return delta

    def since(self, start: int) -> dict[str, list[Any]]:
        """The output lists from position `start` on."""
        return {
            "token": self.output_token[start:],
            "top": self.output_top[start:],
            "ids": self.output_ids[start:],
        }

    def meta(
        self, output: dict[str, list[Any]] | None = None, *, inputs: bool = True
    ) -> dict[str, Any]:
        """The meta_info keys, with all output positions so far, or `output`'s; the input
        families empty unless `inputs`."""
        token = self.output_token if output is None else output["token"]
        meta: dict[str, Any] = {
            "input_token_logprobs": self.input_token if inputs else [],
            "output_token_logprobs": token,
            "output_token_logprobs_length": len(self.output_token),
        }
        if self.fmt.top:
            meta["input_top_logprobs"] = self.input_top if inputs else []
            meta["output_top_logprobs"] = self.output_top if output is None else output["top"]
        if self.fmt.ids:
            meta["input_token_ids_logprobs"] = self.input_ids if inputs else []
            meta["output_token_ids_logprobs"] = self.output_ids if output is None else output["ids"]
        return meta


class OutputAccumulator:
    """Folds one request's deltas into its cumulative output."""

    def __init__(
        self,
        rid: str,
        prompt_tokens: int,
        *,
        weight_version: str,
        logprobs: LogprobFormat | None = None,
    ) -> None:
        self.rid = rid
        self.weight_version = weight_version
        self.text = ""
        self.output_ids: list[int] = []
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._logprobs = _LogprobLists(logprobs) if logprobs is not None else None
        self._last_delta: dict[str, list[Any]] | None = None
        # Stream frames: output positions some frame carried already, and whether one
        # carried the input families.
        self._framed = 0
        self._inputs_framed = False

    def add(self, item: Frame | Done) -> None:
        self.text += item.text
        self.output_ids.extend(item.output_ids)
        self.prompt_tokens = item.prompt_tokens
        self.completion_tokens = item.completion_tokens
        self.cached_tokens = item.cached_tokens
        if self._logprobs is not None:
            empty = Logprobs(output_token=[])
            self._last_delta = self._logprobs.add(item.logprobs or empty)

    def cumulative(
        self,
        *,
        finish_reason: FinishReason | None = None,
        e2e_latency: float | None = None,
        index: int | None = None,
        timing: dict[str, Any] | None = None,
        frame: bool = False,
    ) -> dict[str, Any]:
        """All text and ids so far. The logprobs: every position, or, for a non-terminal
        stream `frame`, only what no earlier frame carried (module docstring)."""
        logprobs = None
        lists = self._logprobs
        if lists is not None:
            if frame:
                logprobs = lists.meta(lists.since(self._framed), inputs=self._take_inputs())
                self._framed = len(lists.output_token)
            else:
                logprobs = lists.meta()
        return self._object(
            self.text, list(self.output_ids), finish_reason, e2e_latency, index, logprobs, timing
        )

    def _take_inputs(self) -> bool:
        """The input families go in this frame: no earlier frame carried them."""
        first = not self._inputs_framed
        self._inputs_framed = True
        return first

    def delta(
        self,
        item: Frame | Done,
        *,
        finish_reason: FinishReason | None = None,
        e2e_latency: float | None = None,
        index: int | None = None,
        timing: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The incremental shape: this item's text, ids and output logprobs (the last item
        added), cumulative counts; the input families in the first and the terminal frame
        (`finish_reason` set)."""
        logprobs = None
        if self._logprobs is not None:
            inputs = self._take_inputs() or finish_reason is not None
            logprobs = self._logprobs.meta(self._last_delta, inputs=inputs)
        return self._object(
            item.text, list(item.output_ids), finish_reason, e2e_latency, index, logprobs, timing
        )

    def _object(
        self,
        text: str,
        output_ids: list[int],
        finish_reason: FinishReason | None,
        e2e_latency: float | None,
        index: int | None,
        logprobs: dict[str, Any] | None,
        timing: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return output_object(
            rid=self.rid,
            text=text,
            output_ids=output_ids,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            finish_reason=finish_reason,
            weight_version=self.weight_version,
            e2e_latency=e2e_latency,
            index=index,
            logprobs=logprobs,
            timing=timing,
        )
