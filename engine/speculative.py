"""N-gram speculative decoding (SGLang's `--speculative-algorithm NGRAM`, llama.cpp's lookup
decoding, vLLM's prompt lookup): draft tokens from the request's own prompt and output, have
the runner verify them in one batch, keep what the model itself would have sampled.

Synopsis::

    spec = Speculation.for_config(config, runner)   # None: no speculation on this server
    seq.spec = spec.open(seq)                       # at admission; None: this one never drafts
    draft = seq.spec.draft(seq, room)               # planning: at most `room` tokens, maybe []
    decodes = spec.expand(plan, sampling, sampled)  # commit: a verified entry's tokens in order

Drafting (`NgramDrafter`) is prompt lookup: the most recent earlier occurrence of the longest
suffix of the tokens so far (between `min_n` and `max_n` tokens long) proposes the tokens that
followed it. An index from token to its positions, extended as tokens come, keeps a lookup to
a few dozen comparisons, never a rescan of the prompt.

Verification is the runner's (`VerifiesDrafts`): it feeds [last token, d1 .. dk], samples each
position with the request's own sampler chain, and accepts while the sample equals the next
draft (llama.cpp's `common_sampler_sample_and_accept_n`). Every token kept is one the request's
sampler drew from the model's logits at its position, so the output distribution is the
non-speculative one for any sampler (and a seeded chain draws the same numbers), while greedy
tokens can differ only where logits computed in a batch of k + 1 differ in their last bits.

Requests with logit hooks (grammar, logprobs, a custom processor) never draft, and no draft is
made while `min_new_tokens` masks tokens: their per-position work is not verified.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from .config import EngineConfig
from .logits import LogitHooks
from .request import SpecCounts
from .runners.base import Runner, SeqStep, VerifiesDrafts
from .sampling import SamplingParams

__all__ = ["NgramDrafter", "SeqSpeculation", "Speculation"]

#: Earlier occurrences of the last token one lookup compares, most recent first: enough to
#: find the right line of a repeated code snippet, cheap on a token that occurs everywhere.
MAX_CANDIDATES = 64


class NgramDrafter:
    """Prompt lookup over one sequence's tokens, with an incremental index."""

    __slots__ = ("_index", "_indexed", "max_n", "min_n", "tokens")

    def __init__(self, tokens: list[int], *, min_n: int, max_n: int) -> None:
        self.tokens = tokens  # the prompt, then the output as it is committed (a copy)
        self.min_n = min_n
        self.max_n = max_n
        #: token -> the positions where it occurs, ascending; positions < `_indexed` only.
        self._index: dict[int, list[int]] = {}
        self._indexed = 0

    def draft(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier match of the tokens' suffix."""
        tokens = self.tokens
        last = len(tokens) - 1
        if k <= 0 or last < 1:
            return []
        index = self._index
        for pos in range(self._indexed, last):  # every position but the last, which asks
            index.setdefault(tokens[pos], []).append(pos)
        self._indexed = last
        candidates = index.get(tokens[last])
        if not candidates:
            return []
        best, best_len = -1, 0
        max_n = self.max_n
        for n_seen, pos in enumerate(reversed(candidates)):
            if n_seen == MAX_CANDIDATES:
                break
            length = 1
            limit = min(max_n, pos + 1)
            while length < limit and tokens[pos - length] == tokens[last - length]:
                length += 1
            if length > best_len:
                best, best_len = pos, length
                if length == max_n:
                    break
        if best_len < self.min_n:
            return []
        # What followed the match; past the end it goes on with the draft itself (a period
        # of `last - best` tokens: "a a a" drafts more a's, a repeated line the next one).
        out: list[int] = []
        src = best + 1
        end = last + 1
        while len(out) < k:
            out.append(tokens[src] if src < end else out[src - end])
            src += 1
        return out


class SeqSpeculation:
    """One speculating request: its drafter, its bound and its counts.

    The draft length adapts: it starts at `max_draft`; after a verification that kept every
    draft it doubles (up to `max_draft`), after one that did not it becomes the number kept
    plus one. A draft costs a decode of its length once its first token is kept (a batch of
    k tokens costs more than one token on a CPU), so a request whose drafts keep failing
    drafts one or two tokens, and one that copies its prompt soon drafts the most."""

    __slots__ = ("_drafter", "_fed", "accepted", "drafted", "max_draft", "verifies", "window")

    def __init__(self, drafter: NgramDrafter, max_draft: int, prompt_len: int) -> None:
        self._drafter = drafter
        self._fed = prompt_len  # tokens of prompt + output the drafter holds
        self.max_draft = max_draft
        self.window = max_draft  # the next draft's length at most
        self.verifies = 0
        self.drafted = 0
        self.accepted = 0

    def draft(self, prompt_len: int, output: list[int], room: int) -> list[int]:
        """Draft tokens to verify after the last of `output`: at most `room`."""
        k = min(self.window, room)
        if k <= 0:
            return []
        drafter = self._drafter
        done = self._fed - prompt_len
        if done < len(output):
            drafter.tokens.extend(output[done:])
            self._fed += len(output) - done
        return drafter.draft(k)

    def verified(self, drafted: int, accepted: int) -> None:
        self.verifies += 1
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.window = min(self.max_draft, 2 * self.window)
        else:
            self.window = accepted + 1

    def counts(self) -> SpecCounts:
        return SpecCounts(self.verifies, self.drafted, self.accepted)


class Speculates(Protocol):
    """A scheduler's sequence, as `Speculation.expand` sees it."""

    @property
    def spec(self) -> SeqSpeculation | None: ...


@dataclasses.dataclass(slots=True)
class Speculation:
    """The server's speculation settings and counts (the scheduler holds one)."""

    num_draft_tokens: int
    min_n: int
    max_n: int
    #: Totals since the engine opened, for /metrics.
    verifies: int = 0
    drafted: int = 0
    accepted: int = 0

    @classmethod
    def for_config(cls, config: EngineConfig, runner: Runner) -> Speculation | None:
        """None unless the server speculates and its runner verifies drafts."""
        if config.speculative_algorithm is None or config.speculative_num_draft_tokens < 1:
            return None
        if not (isinstance(runner, VerifiesDrafts) and runner.verifies_drafts):
            return None
        return cls(
            config.speculative_num_draft_tokens,
            config.speculative_ngram_min_match_window_size,
            config.speculative_ngram_max_match_window_size,
        )

    def open(
        self, prompt_ids: list[int], params: SamplingParams, hooks: LogitHooks | None
    ) -> SeqSpeculation | None:
        """Speculation for a request just admitted; None when it must not draft: its own
        `speculative_num_draft_tokens` is 0, or logit hooks see each position."""
        wanted = params.speculative_num_draft_tokens
        k = self.num_draft_tokens if wanted is None else min(wanted, self.num_draft_tokens)
        if k < 1 or hooks is not None:
            return None
        drafter = NgramDrafter(list(prompt_ids), min_n=self.min_n, max_n=self.max_n)
        return SeqSpeculation(drafter, k, len(prompt_ids))

    def expand(
        self, plan: Sequence[SeqStep], sampling: Sequence[Speculates], sampled: list[int]
    ) -> list[list[int]]:
        """A step's sampled tokens as decodes for `Scheduler._commit`: a verified entry's
        accepted drafts come first, each in its own decode, then its sampled token; other
        sequences' tokens (-1: none) line up with the last decode. Counts the verifications."""
        extra: list[tuple[int, list[int]]] = []  # (index in sampling, accepted drafts)
        k = 0
        for entry in plan:
            if not entry.sample:
                continue
            verify = entry.verify
            if verify is not None:
                spec = sampling[k].spec
                drafted = len(entry.tokens) - 1
                self.verifies += 1
                self.drafted += drafted
                self.accepted += verify.accepted
                if spec is not None:
                    spec.verified(drafted, verify.accepted)
                if verify.accepted:
                    extra.append((k, entry.tokens[1 : 1 + verify.accepted]))
            k += 1
        if not extra:
            return [sampled]
        depth = max(len(tokens) for _, tokens in extra)
        decodes = [[-1] * len(sampled) for _ in range(depth)]
        for k, tokens in extra:
            offset = depth - len(tokens)
            for j, token in enumerate(tokens):
                decodes[offset + j][k] = token
        decodes.append(sampled)
        return decodes
