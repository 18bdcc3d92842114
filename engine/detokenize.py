"""Incremental detokenization with stop strings.

Synopsis::

    detok = IncrementalDetokenizer(runner.token_piece, stops=("\\n\\n",), no_stop_trim=False)
    matched = detok.add(token_id)        # the stop string that just completed, or None
    delta = detok.take_delta(final=matched is not None)

Two promises make streamed text safe to show as it arrives:

- a delta never ends in half a UTF-8 character (the incremental decoder holds the bytes back
  until the character completes; bytes that can never complete become U+FFFD, as in SGLang);
- a delta never contains text that might still turn out to be the start of a stop string: the
  longest suffix that is a prefix of some stop string is held back until the next token
  decides it.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    def __init__(
        self,
        piece: Callable[[int], bytes],
        *,
        stops: tuple[str, ...] = (),
        no_stop_trim: bool = False,
    ) -> None:
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = stops
        self._max_stop = max((len(s) for s in stops), default=0)
        self._no_stop_trim = no_stop_trim
        self.text = ""  # all text decoded so far (after any stop-string trim)
        self._emitted = 0  # characters of self.text already handed out
        self.stopped = False

    def add(self, token_id: int, *, check_stops: bool = True) -> str | None:
        """Append one token's text. Returns the stop string this token completed, if any:
        only a match that ends inside this token's text counts, so text added while checks
        were off (before min_new_tokens) never matches later."""
        assert not self.stopped, "no tokens after a stop string"
        old_len = len(self.text)
        self.text += self._decoder.decode(self._piece(token_id))
        if not check_stops or not self._stops or len(self.text) == old_len:
            return None
        best: tuple[int, str] | None = None
        for stop in self._stops:
            # Starting here or later, a match ends after old_len: in the new text.
            pos = self.text.find(stop, max(self._emitted, old_len - len(stop) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        self.text = self.text[: pos + len(stop)] if self._no_stop_trim else self.text[:pos]
        self.stopped = True
        return stop

    def take_delta(self, *, final: bool) -> str:
        """Text not handed out yet. Unless `final`, what may begin a stop string stays back."""
        if final:
            if not self.stopped:
                self.text += self._decoder.decode(b"", final=True)
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _held_back(self) -> int:
        text = self.text
        for n in range(min(self._max_stop - 1, len(text) - self._emitted), 0, -1):
            tail = text[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0
