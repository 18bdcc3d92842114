"""`LogitHooks`: one sequence's work on its logits rows beyond the sampler chain.

Synopsis (what a runner does for a `SeqStep` whose `hooks` is set)::

    row = <the sampling row: float32, one entry per vocab id, writable>
    hooks.prepare(row)              # grammar mask, custom logit processor (in place)
    token = <sample from row>
    hooks.sampled(row, token)       # logprobs of this position; the grammar advances

    rows = <logits of tokens[step.prompt_offset:][:len(step.prompt_targets)]>
    hooks.score_prompt(rows, step.prompt_targets)

The order is SGLang's: the min_new_tokens mask (done by the runner), the grammar's mask,
logit_bias, the custom processor, then logprobs; temperature and the top-k/top-p/min-p cuts
come later in the sampler chain, so logprobs are never temperature-scaled. (Penalties run in
llama.cpp's chain after logprobs are read; SGLang applies them before.)

Everything here runs on the runner's compute thread while the scheduler awaits the step, so
nothing else touches a hook meanwhile. A failure of client-supplied code (a custom processor)
is kept in `failure`, and the scheduler ends that one request with it; the step and its other
sequences carry on.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from .custom_logit_processor import CustomLogitProcessor
from .errors import BadRequest, EngineError
from .request import LogprobRequest, Logprobs, TokenLogprob, TopLogprobs

__all__ = ["GrammarMatcher", "LogitHooks", "LogprobCollector", "ProcessorCall"]

#: Prompt rows scored per numpy pass: bounds the temporary arrays to a few MB.
_PROMPT_BLOCK = 32


class GrammarMatcher(Protocol):
    """A constraint that decides, position by position, which tokens may come next."""

    def fill_mask(self, row: np.ndarray) -> None:
        """Set the logits of every token the grammar forbids next to -inf."""

    def consume(self, token: int) -> None:
        """Advance past `token` (which the mask allowed)."""

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing more may be generated."""


class LogprobCollector:
    """Scores positions as the runner hands them over; the scheduler takes what accumulated
    with each output item."""

    def __init__(self, spec: LogprobRequest) -> None:
        self.spec = spec
        self._ids = np.asarray(spec.token_ids, dtype=np.int64) if spec.token_ids else None
        self._out_token: list[TokenLogprob] = []
        self._out_top: list[TopLogprobs] = []
        self._out_ids: list[TopLogprobs] = []
        self.input_token: list[TokenLogprob] = []
        self.input_top: list[TopLogprobs] = []
        self.input_ids: list[TopLogprobs] = []
        self._input_sent = False

    def start_prompt(self, prompt_ids: list[int]) -> None:
        """The first scored prompt position has no logprob (SGLang: `[null, id]`)."""
        start = self.spec.start_len
        if 0 <= start < len(prompt_ids):
            self._add_input(None, prompt_ids[start], None, None)

    def score_output(self, row: np.ndarray, token: int) -> None:
        lse = _logsumexp(row)
        self._out_token.append((float(row[token] - lse), token))
        if self.spec.top_n:
            self._out_top.append(_top(row, lse, self.spec.top_n))
        if self._ids is not None:
            self._out_ids.append(_pairs(row[self._ids] - lse, self._ids))

    def drop_last_output(self) -> None:
        """Forget the last output position scored: its token was never kept."""
        for scores in (self._out_token, self._out_top, self._out_ids):
            if scores:
                scores.pop()

    def score_prompt(self, rows: np.ndarray, targets: list[int]) -> None:
        """`rows[j]` are the logits that predict `targets[j]`."""
        for lo in range(0, len(targets), _PROMPT_BLOCK):
            block = rows[lo : lo + _PROMPT_BLOCK]
            lse = _logsumexp(block, axis=1)
            tgt = np.asarray(targets[lo : lo + _PROMPT_BLOCK], dtype=np.int64)
            picked = block[np.arange(len(tgt)), tgt] - lse
            for j, token in enumerate(tgt.tolist()):
                top = _top(block[j], lse[j], self.spec.top_n) if self.spec.top_n else None
                ids = (
                    _pairs(block[j, self._ids] - lse[j], self._ids)
                    if self._ids is not None
                    else None
                )
                self._add_input(float(picked[j]), token, top, ids)

    def _add_input(
        self, logprob: float | None, token: int, top: TopLogprobs, ids: TopLogprobs
    ) -> None:
        self.input_token.append((logprob, token))
        self.input_top.append(top)
        self.input_ids.append(ids)

    def take(self) -> Logprobs:
        """What accumulated since the last take: new output positions, and the prompt's
        families the first time."""
        top_asked, ids_asked = bool(self.spec.top_n), self._ids is not None
        out = Logprobs(
            output_token=self._out_token,
            output_top=self._out_top if top_asked else None,
            output_ids=self._out_ids if ids_asked else None,
        )
        self._out_token, self._out_top, self._out_ids = [], [], []
        if not self._input_sent:
            self._input_sent = True
            out = Logprobs(
                output_token=out.output_token,
                output_top=out.output_top,
                output_ids=out.output_ids,
                input_token=self.input_token,
                input_top=self.input_top if top_asked else None,
                input_ids=self.input_ids if ids_asked else None,
            )
        return out


class ProcessorCall:
    """A custom logit processor bound to one request's `custom_params` (SGLang: the same dict
    on every call, with `__req__` added, so a processor may keep state in it)."""

    def __init__(self, processor: CustomLogitProcessor, params: dict[str, Any] | None) -> None:
        self.processor = processor
        self.params = params

    def apply(self, row: np.ndarray) -> None:
        view = row.reshape(1, -1)
        arg = _as_tensor(view)
        result = self.processor(arg, [self.params])
        if result is not arg:
            out = np.asarray(result, dtype=np.float32)
            if out.shape != view.shape:
                raise BadRequest(
                    f"custom_logit_processor returned shape {out.shape}, expected {view.shape}"
                )
            np.copyto(view, out)


class LogitHooks:
    """`logit_bias`, when given, is applied here (after the grammar's mask, before the
    processor and logprobs), and the runner's sampler chain must then leave it out: the
    scheduler opens such a sequence with params without it."""

    def __init__(
        self,
        *,
        grammar: GrammarMatcher | None = None,
        processor: ProcessorCall | None = None,
        logprobs: LogprobCollector | None = None,
        logit_bias: Mapping[int, float] | None = None,
    ) -> None:
        self.grammar = grammar
        self.processor = processor
        self.logprobs = logprobs
        self.bias = (
            (
                np.fromiter(logit_bias.keys(), dtype=np.int64),
                np.fromiter(logit_bias.values(), dtype=np.float32),
            )
            if logit_bias
            else None
        )
        #: Set when client-supplied code failed; the scheduler ends the request with it.
        self.failure: EngineError | None = None

    def prepare(self, row: np.ndarray) -> None:
        if self.grammar is not None:
            self.grammar.fill_mask(row)
        if self.bias is not None:
            row[self.bias[0]] += self.bias[1]
        if self.processor is not None and self.failure is None:
            try:
                self.processor.apply(row)
            except EngineError as exc:
                self.failure = exc
            # The client's code: whatever it raises (SystemExit included) is its request's
            # failure, never the server's. This runs on the compute thread, where nothing
            # else could want a KeyboardInterrupt.
            except BaseException as exc:
                self.failure = BadRequest(f"custom_logit_processor raised {exc!r}")
            else:
                _sanitize(row)

    def sampled(self, row: np.ndarray, token: int) -> None:
        if self.logprobs is not None:
            self.logprobs.score_output(row, token)
        if self.grammar is not None:
            self.grammar.consume(token)

    def score_prompt(self, rows: np.ndarray, targets: list[int]) -> None:
        if self.logprobs is not None:
            self.logprobs.score_prompt(rows, targets)


def _sanitize(row: np.ndarray) -> None:
    """What a processor wrote that sampling and logprobs cannot use: NaN becomes -inf (never
    sampled, as SGLang's sanitize_nan_logits); +inf means "only these", so the +inf tokens
    become 0 and every other token -inf (a large finite value would turn back into inf when
    the sampler divides by a temperature below 1)."""
    if np.isfinite(row).all():
        return
    forced = np.isposinf(row)
    if forced.any():
        row[:] = np.where(forced, 0.0, -np.inf)
    else:
        np.nan_to_num(row, copy=False, nan=-np.inf, neginf=-np.inf)


def _logsumexp(x: np.ndarray, axis: int | None = None) -> Any:
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return out.reshape(()) if axis is None else out.reshape(-1)


def _top(row: np.ndarray, lse: float, n: int) -> list[tuple[float, int]]:
    n = min(n, row.shape[0])
    idx = np.argpartition(row, -n)[-n:]
    idx = idx[np.argsort(-row[idx], kind="stable")]
    return _pairs(row[idx] - lse, idx)


def _pairs(logprobs: np.ndarray, ids: np.ndarray) -> list[tuple[float, int]]:
    return list(zip(logprobs.tolist(), ids.tolist(), strict=True))


_torch: Any = None
_torch_checked = False


def _as_tensor(view: np.ndarray) -> Any:
    """What SGLang processors expect: a torch tensor (sharing the row's memory) when torch is
    installed; a numpy array otherwise (indexing, slicing and assignment work alike)."""
    global _torch, _torch_checked
    if not _torch_checked:
        _torch_checked = True
        if importlib.util.find_spec("torch") is not None:
            import torch

            _torch = torch
    return _torch.from_numpy(view) if _torch is not None else view
