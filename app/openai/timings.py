"""`llama_timings`: a `/v1` response's `timings` object (`--enable-request-timing`), with
llama.cpp server's field names and formulas, so clients written for llama-server read it.

Synopsis::

    response["timings"] = llama_timings(item_timings)   # one RequestTiming per choice

- `prompt_n`, `predicted_n`: prompt tokens computed and tokens generated, all choices
  together (each choice's prompt is computed on its own: no prefix cache yet);
- `prompt_ms`: from the first admission to a running slot to the last choice's first token
  (one choice: exactly its `prefill_time`);
- `predicted_ms`: from then to the last choice's end (one choice: its `decode_time`);
- `*_per_token_ms` = ms / n and `*_per_second` = 1000 / ms * n, as llama.cpp computes them
  (null where they would divide by zero); `cache_n`: cached prompt tokens (0);
- `draft_n`, `draft_n_accepted`: tokens drafted and drafts kept (speculative decoding), only
  when some choice could speculate, as llama-server adds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..observe.timing import RequestTiming

__all__ = ["llama_timings"]


def llama_timings(items: Sequence[RequestTiming]) -> dict[str, Any]:
    prompt_n = sum(t.prompt_tokens for t in items)
    predicted_n = sum(t.completion_tokens for t in items)
    admitted = [t.admitted_at for t in items if t.admitted_at is not None]
    first = [t.first_token_at for t in items if t.first_token_at is not None]
    ended = [t.finished_at for t in items if t.finished_at is not None]
    prompt_ms = predicted_ms = None
    if admitted and first:
        prompt_ms = (max(first) - min(admitted)) * 1000
        if ended:
            predicted_ms = (max(ended) - max(first)) * 1000
    timings = {
        "cache_n": sum(t.cached_tokens for t in items),
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": _per_token(prompt_ms, prompt_n),
        "prompt_per_second": _per_second(prompt_ms, prompt_n),
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": _per_token(predicted_ms, predicted_n),
        "predicted_per_second": _per_second(predicted_ms, predicted_n),
    }
    spec = [t.speculative for t in items if t.speculative is not None]
    if spec:  # llama-server's fields when it speculates
        timings["draft_n"] = sum(s.draft_tokens for s in spec)
        timings["draft_n_accepted"] = sum(s.accepted_tokens for s in spec)
    return timings


def _per_token(ms: float | None, n: int) -> float | None:
    return ms / n if ms is not None and n > 0 else None


def _per_second(ms: float | None, n: int) -> float | None:
    return 1e3 / ms * n if ms is not None and ms > 0 else None
