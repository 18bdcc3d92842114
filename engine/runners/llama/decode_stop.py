"""Giving up llama.cpp decodes midway, so that an engine under CPU load closes at once.

Synopsis::

    stop = DecodeStop(ctx)               # once, when the context is created
    stop.set()                           # the engine is closing: from any thread
    if (rc := llama_cpp.llama_decode(ctx, batch)) != 0:
        raise stop.failure(rc)           # DecodeStopped once set, else RunnerFailure
    stop.release()                       # closed: llama.cpp's errors are shown again

Why: ggml's OpenMP team meets at a barrier after every graph node, hundreds per decode,
and a member spins there while the kernel runs someone else on the core its partner
needs. With other processes keeping both cores busy, one decode of three tokens took
0.07-1.6 s instead of 5-10 ms, and the engine's exit waited for the decode in flight and
the one launched ahead of it (the model is never freed under a decode): 0.85-10.4 s in 6
tries (6.9 s once when first seen). llama.cpp asks an abort callback between graph nodes,
so a decode stopped by `set` ends at the next node: the exit took 0.15-0.33 s under the
same load, most of it freeing the model's memory.

The callback is the C library's `strlen` over a two-byte flag: 0 until `set` writes the
first byte, then 1, read as the callback's `bool` (the return register's low byte). No
Python runs between graph nodes: a Python callback would take the GIL at every node,
waiting for the event loop each time, and slow every decode.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import llama_cpp

from ...errors import RunnerFailure

__all__ = ["DecodeStop", "DecodeStopped"]

LOGGER = logging.getLogger("tributary.engine.llama")

#: llama.cpp's log, as llama-cpp-python prints it (the llama runner keeps errors only).
LLAMA_LOGGER = logging.getLogger("llama-cpp-python")

#: llama_decode's status for a decode its abort callback stopped.
ABORTED = 2


class DecodeStopped(RunnerFailure):
    """A decode given up because the runner is closing (`DecodeStop.set`)."""


def _flag_reader() -> Any:
    """`strlen` as a `ggml_abort_callback`, or None where the C library has none to give."""
    try:
        address = ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value
    except (OSError, AttributeError, TypeError):  # pragma: no cover - no C library to dlopen
        # (TypeError: Windows' ctypes cannot dlopen the process itself.)
        return None
    return None if address is None else llama_cpp.ggml_abort_callback(address)


_READ_FLAG = _flag_reader()

# Contexts stopped and not yet released: while any is, llama.cpp's errors are not printed.
# A decode it gives up rolls its KV back with one ERROR line per sequence ("removing memory
# module entries"), which would be noise on every exit that interrupts a decode.
_quiet_lock = threading.Lock()
_quiet = 0
_level_before = logging.NOTSET


class DecodeStop:
    """The abort flag of one llama.cpp context."""

    def __init__(self, ctx: Any) -> None:
        self._flag = (ctypes.c_char * 2)()  # the C string "" until set, then "\x01"
        self._quieting = False
        self._released = False  # the context is freed: `set` quiets llama.cpp no more
        if _READ_FLAG is None:  # pragma: no cover - no C library to dlopen
            LOGGER.warning("no strlen in the C library: closing waits for the decode in flight")
            return
        llama_cpp.llama_set_abort_callback(
            ctx, _READ_FLAG, ctypes.cast(self._flag, ctypes.c_void_p)
        )

    @property
    def is_set(self) -> bool:
        return self._flag[0] != b"\0"

    def set(self) -> None:
        """Stop the decode in flight at its next graph node, and every later one at its
        first (llama_decode returns `ABORTED`). From any thread; there is no unset. After
        `release` it only sets the flag: no decode of a freed context is left to quiet."""
        global _quiet, _level_before
        with _quiet_lock:
            if not self._quieting and not self._released:
                self._quieting = True
                if _quiet == 0:
                    _level_before = LLAMA_LOGGER.level
                    LLAMA_LOGGER.setLevel(logging.CRITICAL)
                _quiet += 1
        self._flag[0] = b"\x01"

    def release(self) -> None:
        """The context is freed (no decode of it runs): llama.cpp's errors are printed again
        once no other context is stopping."""
        global _quiet
        with _quiet_lock:
            self._released = True
            if self._quieting:
                self._quieting = False
                _quiet -= 1
                # Put the level back unless someone changed it meanwhile.
                if _quiet == 0 and LLAMA_LOGGER.level == logging.CRITICAL:
                    LLAMA_LOGGER.setLevel(_level_before)

    def failure(self, status: int) -> RunnerFailure:
        """What a decode that returned `status` (not 0) raises."""
        if status == ABORTED and self.is_set:
            return DecodeStopped("the decode was given up: the engine is closing")
        return RunnerFailure(f"llama_decode failed with status {status}")
