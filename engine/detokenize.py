"""Incremental detokenization with stop strings and stop regexes.

Synopsis::

    detok = IncrementalDetokenizer(
        runner.token_piece, stops=("\\n\\n",), stop_regexes=params.stop_regex_patterns
    )
    matched = detok.add(token_id)        # the stop string or pattern just matched, or None
    delta = detok.take_delta(final=matched is not None)

Two promises make streamed text safe to show as it arrives:

- a delta never ends in half a UTF-8 character (the incremental decoder holds the bytes back
  until the character completes; bytes that can never complete become U+FFFD, as in SGLang);
- a delta never contains text that might still turn out to be part of a stop match, and so be
  trimmed: the longest suffix that is a prefix of some stop string is held back, and so is
  everything from the earliest position where a stop regex could still match (the `regex`
  package's partial matching decides it), until later tokens settle it.

Stop regexes follow SGLang: after each token they are searched (not fullmatched) in the
generated text as it stands, so `$` and `\\b` judge the end of the text so far. `^` is the
start of the generated text; the prompt is never searched. When a stop string and a regex
match in the same token, the one that starts first wins; on a tie, the stop string.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable, Sequence

import regex  # type: ignore[import-untyped]

from .errors import BadRequest

__all__ = ["REGEX_BUDGET", "IncrementalDetokenizer"]

#: Seconds all of one token's stop_regex searches may take together. They run on the event
#: loop between steps, so a pattern that backtracks catastrophically (`(a|aa)+$`) must not
#: stall everyone else: past this, its request ends with a 400 abort (SGLang aborts a request
#: whose pattern fails). A search that timed out having used under half of it in CPU time
#: was only descheduled, and is tried again (`_RegexBudget`), up to REGEX_ATTEMPTS timeouts.
REGEX_BUDGET = 0.02
REGEX_ATTEMPTS = 3


class _RegexBudget:
    """One token's REGEX_BUDGET for all its stop_regex searches. The regex engine's timeout is
    wall-clock, so a search that ran out of time while the process was descheduled (a busy
    machine) gets a fresh deadline; the budget is spent when the searches have used half of
    it in CPU time, or after REGEX_ATTEMPTS timeouts."""

    def __init__(self) -> None:
        self._cpu_start = time.thread_time()
        self._timeouts = 0
        self.deadline = time.monotonic() + REGEX_BUDGET

    def spent(self) -> bool:
        """Called on a timeout: True if the request must end, else a fresh deadline is set."""
        self._timeouts += 1
        burned = time.thread_time() - self._cpu_start >= REGEX_BUDGET / 2
        if burned or self._timeouts >= REGEX_ATTEMPTS:
            return True
        self.deadline = time.monotonic() + REGEX_BUDGET
        return False


class IncrementalDetokenizer:
    def __init__(
        self,
        piece: Callable[[int], bytes],
        *,
        stops: tuple[str, ...] = (),
        stop_regexes: Sequence[regex.Pattern] = (),
        no_stop_trim: bool = False,
    ) -> None:
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = stops
        self._max_stop = max((len(s) for s in stops), default=0)
        self._regexes = tuple(stop_regexes)
        # Per regex, the earliest position where one of its matches could still begin (what
        # comes before was settled by earlier tokens); searches start there, not at 0.
        self._regex_from = [0] * len(self._regexes)
        # Matches must end after this: text added with checks off (min_new_tokens) is plain.
        self._checked_from = 0
        self._no_stop_trim = no_stop_trim
        self.text = ""  # all text decoded so far (after any stop trim)
        self._emitted = 0  # characters of self.text already handed out
        # The last `_held_back` answer, and len(self.text) then (it bounds the next one).
        self._held = 0
        self._held_at = 0
        self.stopped = False

    def add(self, token_id: int, *, check_stops: bool = True, last: bool = False) -> str | None:
        """Append one token's text. Returns the stop string or the stop regex's pattern this
        token matched, if any. Only a match that ends inside this token's text counts (a
        regex match ending just before it counts too when a lookahead needed this token), so
        text added while checks were off (before min_new_tokens) never matches later.
        `last`: no token follows (a length finish), so nothing is searched or held back."""
        assert not self.stopped, "no tokens after a stop"
        old_len = len(self.text)
        self.text += self._decoder.decode(self._piece(token_id))
        if len(self.text) == old_len or last:
            return None
        if not check_stops:
            self._checked_from = len(self.text)
        elif not self._stops and not self._regexes:
            return None
        best: tuple[int, int, str] | None = None  # (start, end, what matched)
        if check_stops:
            for stop in self._stops:
                # Starting here or later, a match ends after old_len: in the new text.
                pos = self.text.find(stop, max(self._emitted, old_len - len(stop) + 1))
                if pos >= 0 and (best is None or pos < best[0]):
                    best = (pos, pos + len(stop), stop)
        budget = _RegexBudget() if self._regexes else None
        for i, pattern in enumerate(self._regexes):
            assert budget is not None
            while True:
                try:
                    match, self._regex_from[i] = _scan(
                        pattern, self.text, self._regex_from[i], self._checked_from, budget.deadline
                    )
                    break
                except TimeoutError:
                    if budget.spent():
                        raise BadRequest(
                            f"stop_regex took more than {REGEX_BUDGET} s on one token (pattern "
                            f"{pattern.pattern!r}: catastrophic backtracking?); the request "
                            "was stopped."
                        ) from None
            if match is not None and (best is None or match.start() < best[0]):
                best = (match.start(), match.end(), pattern.pattern)
        if best is None:
            return None
        start, end, matched = best
        self.text = self.text[: end if self._no_stop_trim else start]
        self.stopped = True
        return matched

    def take_delta(self, *, final: bool) -> str:
        """Text not handed out yet. Unless `final`, what may still be part of a stop match
        stays back."""
        if final:
            if not self.stopped:
                self.text += self._decoder.decode(b"", final=True)
            end = len(self.text)
        elif self._max_stop or self._regexes:
            end = min([len(self.text) - self._held_back(), *self._regex_from])
        else:  # nothing can be held back (a request without stops: most of them)
            end = len(self.text)
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _held_back(self) -> int:
        """The longest unemitted suffix of the text that begins some stop string. It is at
        most the previous answer plus the characters added since (a shorter suffix of the
        older text began that stop too), so each character is tested against the stops a
        bounded number of times in all, even while a stop regex keeps the text unemitted:
        at the caps (64 stops of 256 bytes) a token costs tens of microseconds."""
        text = self.text
        most = min(
            self._max_stop - 1, len(text) - self._emitted, self._held + len(text) - self._held_at
        )
        held = 0
        for n in range(most, 0, -1):
            tail = text[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                held = n
                break
        self._held, self._held_at = held, len(text)
        return held


def _scan(
    pattern: regex.Pattern, text: str, pos: int, counted_after: int, deadline: float
) -> tuple[regex.Match | None, int]:
    """The leftmost match at or after `pos` that ends after `counted_after` (or None), and the
    earliest position at or after `pos` where a match could still begin (len(text) if none).

    A partial search answers both in one call: it reports the leftmost complete match if
    there is one, else the leftmost partial match (text that some continuation would turn
    into a match). The loop runs only when a complete match does not count because it lies
    in text added before the checks began. Raises TimeoutError once `deadline` (on
    `time.monotonic`) has passed.
    """

    def left() -> float:
        # A partial search may make two passes, each given the timeout afresh: half each.
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return remaining / 2

    hold: int | None = None
    while True:
        match = pattern.search(text, pos, partial=True, timeout=left())
        if match is None:
            return None, len(text) if hold is None else hold
        if match.partial:
            return None, match.start() if hold is None else hold
        if match.end() > counted_after:
            return match, match.start()
        if hold is None:
            # The regex package prefers a complete match to a partial one, so partial matches
            # starting before this one went unreported: test those starts one at a time. A
            # start is live if some match attempt from it reaches the end of the text.
            starts = range(pos, match.start() + 1)
            hold = next(
                (p for p in starts if pattern.fullmatch(text, p, partial=True, timeout=left())),
                None,
            )
        pos = match.start() + 1
